"""What a daemon stores and under which keys, and the batch checks of PUT records.

Storage layout (store format ``kvcache-store-v4``, LMDB named databases)::

    shards     tenant 8 | key 16 | index u16 BE                → segment u32 | offset u32 | length u32 | header_check u32
    retention  tenant 8 | key 16 | index u16 BE                → expiry_ms | size | stripe | written_ms | class
    expiry     tenant 8 | class 16 | expiry_ms u64 BE          → key 16 | index u16 BE  (DUPSORT, DUPFIXED)
    meta       b"format"; b"usage:" + tenant 8 + class 16 → bytes u64 | shards u64; b"policy";
               b"seg:" + segment u32 BE → end u64 | live bytes u64 | live records u64

The records themselves (``header || body``, as PUT carried them) are in
append-only segment files beside the index (:mod:`kvcache.server.segments`).

Every key starts with the tenant's 8-byte id (:func:`kvcache.credentials.tenant_id`),
taken from the connection's authenticated tenant, never from the request: a
tenant cannot name another tenant's shards even if it knows their block keys.
One key's shards are adjacent and in index order. The expiry index is cut
into *partitions*, one per (tenant, class), each walked oldest first: that is
what lets a tenant's quota evict its own shards, and a class quota the
tenant's shards of that class.

The expiry index keeps one key per (partition, expiry) and the shards expiring
then as its fixed-size sorted duplicates (LMDB packs those 18 bytes apiece, no
node header): every shard of a PUT batch shares its batch's expiry, so the
index costs about a fifth of what a key per shard did (v2: 96 bytes a shard on
disk at 10^5 shards, see bench/scale.py and docs/benchmarks.md).

A PUT carries hundreds of ``header || body`` shard records. They are checked
as a batch (:func:`check_put`): the header rules are
:func:`kvcache.shard.header_verdicts` (one home for them); only the body
checksums are computed per record (xxh3 runs at memory speed). The verdicts
are exactly those of :func:`kvcache.shard.split_shard` followed by the key
check (a property test holds the two side by side):

* malformed header or body length → ``BAD_ITEM``
* body checksum mismatch → ``CHECKSUM``
* a well-formed shard of another key or shard index → ``WRONG_KEY``
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache import native
from kvcache.credentials import TenantId
from kvcache.errors import ProtocolError
from kvcache.shard import HEADER_BYTES, HEADER_DTYPE, header_verdicts
from kvcache.wire import NO_RETAIN, Retain, Status, data_offsets

__all__ = [
    "FORMAT",
    "KEY_LEN",
    "PARTITION_LEN",
    "RETENTION_HEAD",
    "SEGMENT_PREFIX",
    "CheckedPut",
    "Retention",
    "check_put",
    "class_field",
    "expiry_entry",
    "fresh_rows",
    "partition",
    "record_class",
    "record_expiry",
    "split_expiry_entry",
    "split_partition",
    "split_store_key",
    "store_keys",
    "usage_key",
]

FORMAT = b"kvcache-store-v4"
TENANT_LEN = 8
#: Storage key: tenant (8) + block key (16) + shard index (u16 big-endian).
KEY_LEN = TENANT_LEN + 18
CLASS_LEN = 16
#: Expiry-index partition: tenant (8) + traffic class name, NUL-padded (16).
PARTITION_LEN = TENANT_LEN + CLASS_LEN
USAGE_PREFIX = b"usage:"
#: Meta rows of the segment files' end and live bytes (kvcache.server.segments).
SEGMENT_PREFIX = b"seg:"

_FIELDS: Mapping[str, Any] = HEADER_DTYPE.fields or {}
_KEY_AT: int = _FIELDS["block_key"][1]
_NAME_AT: int = _FIELDS["traffic_class"][1]
_CHECKED_LEN = HEADER_BYTES - 4

_RETENTION = struct.Struct(">QIQQ")
_U64 = struct.Struct(">Q")
#: The fixed head of a packed Retention record (expiry_ms, size, stripe, written_ms).
RETENTION_HEAD = _RETENTION


@dataclass(frozen=True, slots=True)
class Retention:
    """The small side record kept per stored shard, so a hit never rewrites shard bytes.

    Stored as ``expiry_ms u64 BE | size u32 BE | stripe u64 BE | written_ms u64 BE |
    class ASCII``; ``written_ms`` is when this daemon stored the shard (its own clock),
    which decides whether another writer may replace it (see docs/spec/wire.md, PUT).
    """

    expiry_ms: int
    size: int
    stripe: int
    written_ms: int
    traffic_class: str

    def pack(self) -> bytes:
        """The record's bytes."""
        head = _RETENTION.pack(self.expiry_ms, self.size, self.stripe, self.written_ms)
        return head + self.traffic_class.encode()

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> Retention:
        """Parse a record written by :meth:`pack` (our own disk: trusted layout)."""
        expiry_ms, size, stripe, written_ms = _RETENTION.unpack_from(raw)
        name = bytes(raw[_RETENTION.size :]).decode("ascii")
        return cls(expiry_ms, size, stripe, written_ms, name)


def record_expiry(raw: bytes | memoryview) -> int:
    """Just the expiry of a packed :class:`Retention` (the hot read path needs nothing else)."""
    return int(_U64.unpack_from(raw)[0])


def record_class(raw: bytes | memoryview) -> str:
    """Just the traffic class of a packed :class:`Retention`."""
    return bytes(raw[_RETENTION.size :]).decode("ascii")


def class_field(name: str) -> bytes:
    """A class name as the 16-byte, NUL-padded field of partition keys."""
    return name.encode("ascii").ljust(CLASS_LEN, b"\x00")


def partition(tenant: bytes, traffic_class: str) -> bytes:
    """The expiry-index partition of a tenant's shards of one class."""
    return tenant + class_field(traffic_class)


def split_partition(raw: bytes) -> tuple[TenantId, str]:
    """(tenant, class) of a partition key."""
    return TenantId(raw[:TENANT_LEN]), raw[TENANT_LEN:PARTITION_LEN].rstrip(b"\x00").decode()


def expiry_entry(skey: bytes, traffic_class: str, expiry_ms: int) -> tuple[bytes, bytes]:
    """(key, duplicate) of the expiry index for storage key ``skey``: the key is the
    partition and the expiry, the duplicate the block key and shard index."""
    return skey[:TENANT_LEN] + class_field(traffic_class) + _U64.pack(expiry_ms), skey[TENANT_LEN:]


def fresh_rows(
    skeys: list[bytes],
    sizes: npt.NDArray[np.int64],
    stripes: npt.NDArray[np.uint64],
    *,
    traffic_class: str,
    expiry_ms: int,
    written_ms: int,
) -> tuple[list[bytes], list[tuple[bytes, bytes]]]:
    """(retention records, expiry-index entries) of shards of one tenant and class, built as
    columns: the batch twin of :meth:`Retention.pack` and :func:`expiry_entry` (a property
    test holds them byte-identical)."""
    n = len(skeys)
    name = traffic_class.encode("ascii")
    rec = np.empty(
        n,
        [("expiry", ">u8"), ("size", ">u4"), ("stripe", ">u8"), ("written", ">u8"),
         ("name", f"V{len(name)}")],
    )  # fmt: skip
    rec["expiry"] = expiry_ms
    rec["size"] = sizes
    rec["stripe"] = stripes
    rec["written"] = written_ms
    rec["name"] = np.frombuffer(name, f"V{len(name)}")[0] if name else b""
    if not n:
        return [], []
    ekey = skeys[0][:TENANT_LEN] + class_field(traffic_class) + _U64.pack(expiry_ms)
    return (
        rec.view(f"V{rec.dtype.itemsize}").tolist(),
        [(ekey, skey[TENANT_LEN:]) for skey in skeys],
    )


def split_expiry_entry(key: bytes | memoryview, dup: bytes | memoryview) -> tuple[int, bytes]:
    """(expiry_ms, storage key) of an expiry-index entry."""
    raw = bytes(key)
    return int(_U64.unpack_from(raw, PARTITION_LEN)[0]), raw[:TENANT_LEN] + bytes(dup)


def usage_key(part: bytes) -> bytes:
    """The meta key of a partition's byte and shard counters."""
    return USAGE_PREFIX + part


@dataclass(frozen=True, slots=True)
class CheckedPut:
    """Verdicts for a PUT batch and, for the items that passed, what to store."""

    #: One Status per request item.
    status: npt.NDArray[np.uint8]
    #: Positions of the items that passed, in request order.
    positions: list[int]
    #: Their storage keys (see :func:`store_keys`).
    keys: list[bytes]
    #: Their ``header || body`` records (views into the request's data section).
    records: list[memoryview]
    #: Their traffic class names as written in the header.
    classes: list[str]
    #: Their stripe ids.
    stripes: list[int]
    #: The stripe id each item expects to replace (0: none), from the request.
    expects: list[int]
    #: Their header checks (the index keeps them beside each record's location).
    checks: list[int]
    #: The request's retention hint (TTL, pin), from its header.
    retain: Retain = NO_RETAIN


def store_keys(
    tenant: bytes, keys: npt.NDArray[np.void], indices: npt.NDArray[np.integer]
) -> list[bytes]:
    """Storage keys of one tenant for parallel arrays of 16-byte block keys and shard indices."""
    n = len(keys)
    packed = np.empty((n, KEY_LEN), dtype=np.uint8)
    if n:
        packed[:, :TENANT_LEN] = np.frombuffer(tenant, np.uint8)
        packed[:, TENANT_LEN : TENANT_LEN + 16] = np.frombuffer(
            np.ascontiguousarray(keys).tobytes(), np.uint8
        ).reshape(n, 16)
        idx = np.asarray(indices, dtype=np.uint16)
        packed[:, -2] = idx >> 8
        packed[:, -1] = idx & 0xFF
    raw = packed.tobytes()
    return [raw[i : i + KEY_LEN] for i in range(0, n * KEY_LEN, KEY_LEN)]


def split_store_key(key: bytes | memoryview) -> tuple[TenantId, bytes, int]:
    """(tenant, block key, shard index) of a storage key."""
    raw = bytes(key)
    return TenantId(raw[:TENANT_LEN]), raw[TENANT_LEN:-2], int.from_bytes(raw[-2:], "big")


def check_put(tenant: bytes, items: npt.NDArray[np.void], data: memoryview) -> CheckedPut:
    """Check every record of a PUT batch; never raises on bad records, only marks them."""
    n = len(items)
    status = np.full(n, Status.BAD_ITEM, dtype=np.uint8)
    if n == 0:
        return CheckedPut(status, [], [], [], [], [], [], [])
    lengths = items["length"].astype(np.int64)
    if int(lengths.sum()) != len(data):
        raise ProtocolError(
            f"item lengths add up to {int(lengths.sum())}, data is {len(data)} bytes"
        )
    offsets = data_offsets(items)
    raw = np.frombuffer(data, dtype=np.uint8)
    cand = np.flatnonzero(lengths >= HEADER_BYTES)
    gathered = np.ascontiguousarray(raw[offsets[cand, None] + np.arange(HEADER_BYTES)])
    hdr = gathered.view(HEADER_DTYPE).reshape(-1)
    ok = header_verdicts(hdr, checksum=False) & (
        lengths[cand] == HEADER_BYTES + hdr["shard_len"].astype(np.int64)
    )
    view = memoryview(data)
    sel = np.flatnonzero(ok)
    rows = cand[sel]
    # Both checksums of every candidate record in two batched native calls
    # (kvcache.native; the Python fallback hashes one record at a time).
    starts = offsets[rows].astype(np.uint64)
    base = np.uint64(native.addresses_of(raw)) if len(raw) else np.uint64(0)
    head_ok = (
        native.xxh3_64_many(base + starts, np.uint64(_CHECKED_LEN)) & np.uint64(0xFFFFFFFF)
    ) == hdr["header_check"][sel]
    body_ok = (
        native.xxh3_64_many(
            base + starts + np.uint64(HEADER_BYTES),
            lengths[rows].astype(np.uint64) - np.uint64(HEADER_BYTES),
        )
        == hdr["shard_hash"][sel]
    )
    hash_fail = np.flatnonzero(head_ok & ~body_ok)  # header_fail rows stay BAD_ITEM
    passed = np.flatnonzero(head_ok & body_ok).tolist()
    records: list[memoryview] = [
        view[start : start + length]
        for start, length in zip(
            offsets[rows[passed]].tolist(), lengths[rows[passed]].tolist(), strict=True
        )
    ]
    status[rows[hash_fail]] = Status.CHECKSUM
    if not passed:
        return CheckedPut(status, [], [], [], [], [], [], [])
    sel = sel[passed]
    pos = rows[passed]
    item_keys = np.frombuffer(items["key"][pos].tobytes(), np.uint8).reshape(-1, 16)
    hdr_keys = gathered[sel, _KEY_AT : _KEY_AT + 16]
    same = (item_keys == hdr_keys).all(axis=1) & (
        items["index"][pos].astype(np.int64) == hdr["shard_index"][sel]
    )
    status[pos[~same]] = Status.WRONG_KEY
    good = pos[same]
    status[good] = Status.OK
    keep = sel[same]
    # Valid names are non-NUL bytes padded with NULs (checked above), so the
    # field as a NUL-stripped bytes string is the name.
    raw_names = np.ascontiguousarray(gathered[keep, _NAME_AT : _NAME_AT + 16]).view("S16")
    names: dict[bytes, str] = {}
    classes = [
        names.get(name) or names.setdefault(name, name.decode("ascii"))
        for name in raw_names.ravel().tolist()
    ]
    return CheckedPut(
        status,
        good.tolist(),
        store_keys(tenant, items["key"][good], items["index"][good]),
        [records[t] for t in np.flatnonzero(same).tolist()] if not same.all() else records,
        classes,
        hdr["stripe_id"][keep].tolist(),
        items["expect"][good].tolist(),
        hdr["header_check"][keep].tolist(),
    )
