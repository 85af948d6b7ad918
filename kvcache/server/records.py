"""Batch checks of PUT records, vectorised, and the daemon's storage keys.

A PUT carries hundreds of ``header || body`` shard records. Checking each
with :func:`kvcache.shard.split_shard` costs about 5 µs of Python per shard,
more than LMDB needs to store it, so this module checks a whole batch with
numpy: all headers are gathered into one structured array and every rule of
``docs/spec/shard-layout.md`` is applied column-wise; only the two checksums
are computed per record (xxh3 runs at memory speed).

The verdicts must be exactly those of ``split_shard`` followed by the key
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
import xxhash

from kvcache.errors import ProtocolError
from kvcache.shard import (
    HEADER_BYTES,
    HEADER_DTYPE,
    MAGIC,
    MAX_CLASS_NAME,
    SHARD_ALIGNMENT,
    VERSION,
)
from kvcache.wire import Status, data_offsets

__all__ = [
    "HEADER_DTYPE",
    "KEY_LEN",
    "RETENTION_HEAD",
    "CheckedPut",
    "Retention",
    "check_put",
    "expiry_key",
    "record_class",
    "record_expiry",
    "record_stripe",
    "split_expiry_key",
    "split_store_key",
    "store_keys",
]

#: Storage key: block key (16 bytes) + shard index (u16 big-endian), so one
#: key's shards are adjacent and in index order.
KEY_LEN = 18

_CHECKED_LEN = HEADER_BYTES - 4
_STRIPE = struct.Struct("<Q")
_FIELDS: Mapping[str, Any] = HEADER_DTYPE.fields or {}
_STRIPE_OFFSET: int = _FIELDS["stripe_id"][1]
_KEY_AT: int = _FIELDS["block_key"][1]
_NAME_AT: int = _FIELDS["traffic_class"][1]

_NAME_FIRST = np.zeros(256, dtype=bool)
_NAME_REST = np.zeros(256, dtype=bool)
for _c in b"abcdefghijklmnopqrstuvwxyz0123456789":
    _NAME_FIRST[_c] = _NAME_REST[_c] = True
for _c in b"_-":
    _NAME_REST[_c] = True


_RETENTION = struct.Struct(">QIQ")
_EXPIRY = struct.Struct(">Q")
#: The fixed head of a packed Retention record (expiry_ms, size, stripe), for hot loops.
RETENTION_HEAD = _RETENTION


@dataclass(frozen=True, slots=True)
class Retention:
    """The small side record kept per stored shard, so a hit never rewrites shard bytes.

    Stored as ``expiry_ms u64 BE | size u32 BE | stripe u64 BE | class ASCII``.
    """

    expiry_ms: int
    size: int
    stripe: int
    traffic_class: str

    def pack(self) -> bytes:
        """The record's bytes."""
        return _RETENTION.pack(self.expiry_ms, self.size, self.stripe) + self.traffic_class.encode()

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> Retention:
        """Parse a record written by :meth:`pack` (our own disk: trusted layout)."""
        expiry_ms, size, stripe = _RETENTION.unpack_from(raw)
        return cls(expiry_ms, size, stripe, bytes(raw[_RETENTION.size :]).decode("ascii"))


def record_expiry(raw: bytes | memoryview) -> int:
    """Just the expiry of a packed :class:`Retention` (the hot read path needs nothing else)."""
    return int(_EXPIRY.unpack_from(raw)[0])


def record_class(raw: bytes | memoryview) -> str:
    """Just the traffic class of a packed :class:`Retention`."""
    return bytes(raw[_RETENTION.size :]).decode("ascii")


def expiry_key(expiry_ms: int, key: bytes) -> bytes:
    """Key of the expiry index: ``expiry_ms u64 BE || storage key``, so a cursor walks by expiry."""
    return _EXPIRY.pack(expiry_ms) + key


def split_expiry_key(raw: bytes | memoryview) -> tuple[int, bytes]:
    """(expiry_ms, storage key) of an expiry-index key."""
    data = bytes(raw)
    return int(_EXPIRY.unpack_from(data)[0]), data[_EXPIRY.size :]


@dataclass(frozen=True, slots=True)
class CheckedPut:
    """Verdicts for a PUT batch and, for the items that passed, what to store."""

    #: One Status per request item.
    status: npt.NDArray[np.uint8]
    #: Positions of the items that passed, in request order.
    positions: list[int]
    #: Their storage keys (see :func:`store_keys`).
    keys: list[bytes]
    #: Their ``header || body`` records (views into the request's data frame).
    records: list[memoryview]
    #: Their traffic class names as written in the header.
    classes: list[str]
    #: Their stripe ids.
    stripes: list[int]


def store_keys(keys: npt.NDArray[np.void], indices: npt.NDArray[np.integer]) -> list[bytes]:
    """18-byte storage keys for parallel arrays of 16-byte block keys and shard indices."""
    n = len(keys)
    packed = np.empty((n, KEY_LEN), dtype=np.uint8)
    if n:
        packed[:, :16] = np.frombuffer(np.ascontiguousarray(keys).tobytes(), np.uint8).reshape(
            n, 16
        )
        idx = np.asarray(indices, dtype=np.uint16)
        packed[:, 16] = idx >> 8
        packed[:, 17] = idx & 0xFF
    raw = packed.tobytes()
    return [raw[i : i + KEY_LEN] for i in range(0, n * KEY_LEN, KEY_LEN)]


def split_store_key(key: bytes | memoryview) -> tuple[bytes, int]:
    """(block key, shard index) of an 18-byte storage key."""
    raw = bytes(key)
    return raw[:16], int.from_bytes(raw[16:18], "big")


def record_stripe(record: bytes | memoryview) -> int:
    """Stripe id of a stored ``header || body`` record (already checked when stored)."""
    return int(_STRIPE.unpack_from(record, _STRIPE_OFFSET)[0])


def check_put(items: npt.NDArray[np.void], data: memoryview) -> CheckedPut:
    """Check every record of a PUT batch; never raises on bad records, only marks them."""
    n = len(items)
    status = np.full(n, Status.BAD_ITEM, dtype=np.uint8)
    if n == 0:
        return CheckedPut(status, [], [], [], [], [])
    lengths = items["length"].astype(np.int64)
    if int(lengths.sum()) != len(data):
        raise ProtocolError(
            f"item lengths add up to {int(lengths.sum())}, data is {len(data)} bytes"
        )
    offsets = data_offsets(items)
    raw = np.frombuffer(data, dtype=np.uint8)
    cand = np.flatnonzero(lengths >= HEADER_BYTES)
    gathered = raw[offsets[cand, None] + np.arange(HEADER_BYTES)]
    hdr = np.ascontiguousarray(gathered).view(HEADER_DTYPE).reshape(-1)

    k = hdr["k"].astype(np.int64)
    m = hdr["m"].astype(np.int64)
    payload_len = hdr["payload_len"].astype(np.int64)
    safe_k = np.maximum(k, 1)
    per = -(-payload_len // safe_k)
    shard_len = -(-per // SHARD_ALIGNMENT) * SHARD_ALIGNMENT
    class_len = hdr["class_len"].astype(np.int64)
    ok = (
        (hdr["magic"] == MAGIC)
        & (hdr["version"] == VERSION)
        & (hdr["header_len"] == HEADER_BYTES)
        & (hdr["reserved"] == 0)
        & (k >= 1)
        & (m <= 255 - k)
        & (hdr["shard_index"].astype(np.int64) < k + m)
        & (payload_len >= 1)
        & (hdr["expiry_ms"] >= hdr["created_ms"])
        & (shard_len <= 0xFFFFFFFF)
        & (hdr["shard_len"].astype(np.int64) == shard_len)
        & (lengths[cand] == HEADER_BYTES + shard_len)
        & (class_len >= 1)
        & (class_len <= MAX_CLASS_NAME)
        & _names_ok(gathered[:, _NAME_AT : _NAME_AT + 16], class_len)
    )
    view = memoryview(data)
    # Only the two checksums are per record; everything around them is columns.
    sel = np.flatnonzero(ok)
    rows = cand[sel]
    checks = hdr["header_check"][sel].tolist()
    shard_hashes = hdr["shard_hash"][sel].tolist()
    records: list[memoryview] = []
    passed: list[int] = []
    hash_fail: list[int] = []
    digest = xxhash.xxh3_64_intdigest
    for t, (start, length) in enumerate(
        zip(offsets[rows].tolist(), lengths[rows].tolist(), strict=True)
    ):
        record = view[start : start + length]
        if digest(record[:_CHECKED_LEN]) & 0xFFFFFFFF != checks[t]:
            continue  # header corrupted: BAD_ITEM
        if digest(record[HEADER_BYTES:]) != shard_hashes[t]:
            hash_fail.append(t)
            continue
        passed.append(t)
        records.append(record)
    status[rows[hash_fail]] = Status.CHECKSUM
    if not passed:
        return CheckedPut(status, [], [], [], [], [])
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
        names.get(raw) or names.setdefault(raw, raw.decode("ascii"))
        for raw in raw_names.ravel().tolist()
    ]
    return CheckedPut(
        status,
        good.tolist(),
        store_keys(items["key"][good], items["index"][good]),
        [records[t] for t in np.flatnonzero(same).tolist()] if not same.all() else records,
        classes,
        hdr["stripe_id"][keep].tolist(),
    )


def _names_ok(name: npt.NDArray[np.uint8], length: npt.NDArray[np.int64]) -> npt.NDArray[np.bool_]:
    """Row-wise: the first ``length`` bytes are a valid class name, the rest zeros."""
    col = np.arange(name.shape[1])
    inside = col[None, :] < length[:, None]
    allowed = np.where(col[None, :] == 0, _NAME_FIRST[name], _NAME_REST[name])
    return np.asarray(np.where(inside, allowed, name == 0).all(axis=1), dtype=np.bool_)
