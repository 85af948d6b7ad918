"""What a daemon stores and under which keys, and the batch checks of PUT records.

Storage layout (store format ``kvcache-store-v6``, LMDB named databases)::

    index      tenant 8 | key 16 (DUPSORT, DUPFIXED)  → one 32-byte row per shard held of the key:
               index u16 | class id u16 | size u32 | expiry_s u32 | stripe u64 | written_s u32
               | segment u32 | offset u32                          (all big-endian, :data:`ROW`)
    expiry     tenant 8 | class 16 | expiry_ms u64 BE          → key 16 | index u16 BE  (DUPSORT, DUPFIXED)
    meta       b"format"; b"usage:" + tenant 8 + class 16 → bytes u64 | shards u64; b"policy";
               b"seg:" + segment u32 BE → end u64 | live bytes u64 | live records u64;
               b"classes" → the stored class names, in id order, one per line (:class:`ClassTable`)

One block key's shards on a node are the sorted duplicates of ONE index key, so
a HAS of many keys is one C-level ``getmulti`` (every row of every key in one
buffer), and a GET of one node's shards is the same lookup: no cursor walk per
key, no second database per shard (v4 kept the location and the retention row
under two 26-byte keys in two databases).

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
from kvcache.errors import ProtocolError, StorageError
from kvcache.shard import HEADER_BYTES, HEADER_DTYPE, header_verdicts
from kvcache.wire import ITEM_DTYPES, NO_RETAIN, Op, Retain, Status, data_offsets

__all__ = [
    "BLOCK_LEN",
    "CLASSES_KEY",
    "FORMAT",
    "HIT_DTYPE",
    "HIT_LEN",
    "KEY_LEN",
    "PARTITION_LEN",
    "EXPIRY_UNIT_MS",
    "ROW",
    "ROW_DTYPE",
    "ROW_LEN",
    "SEGMENT_EXPIRY_PREFIX",
    "SEGMENT_PREFIX",
    "CheckedPut",
    "ClassTable",
    "Row",
    "check_put",
    "class_field",
    "expiry_entry",
    "fresh_rows",
    "get_key_rows",
    "partition",
    "quiet_get",
    "quiet_get_numpy",
    "record_runs",
    "row_location",
    "written_s",
    "row_expiry_ms",
    "split_expiry_entry",
    "split_partition",
    "split_rows",
    "split_store_key",
    "store_key_rows",
    "store_keys",
    "usage_key",
]

FORMAT = b"kvcache-store-v6"
TENANT_LEN = 8
#: Storage key: tenant (8) + block key (16) + shard index (u16 big-endian).
KEY_LEN = TENANT_LEN + 18
#: Key of the ``index`` database: tenant (8) + block key (16); the shard index leads the row.
BLOCK_LEN = TENANT_LEN + 16
CLASS_LEN = 16
#: Expiry-index partition: tenant (8) + traffic class name, NUL-padded (16).
PARTITION_LEN = TENANT_LEN + CLASS_LEN
USAGE_PREFIX = b"usage:"
#: Meta rows of the segment files' end and live bytes (kvcache.server.segments).
SEGMENT_PREFIX = b"seg:"
#: Meta rows of the latest expiry (ms, u64 big-endian) appended to each segment; a segment
#: without one (written before they were kept) counts as unknown (ShardStore._goes_first).
SEGMENT_EXPIRY_PREFIX = b"segx:"
#: Meta row of the class table (:class:`ClassTable`).
CLASSES_KEY = b"classes"

_FIELDS: Mapping[str, Any] = HEADER_DTYPE.fields or {}
_KEY_AT: int = _FIELDS["block_key"][1]
_NAME_AT: int = _FIELDS["traffic_class"][1]
_CHECKED_LEN = HEADER_BYTES - 4

#: A row keeps its expiry in whole seconds: every expiry is one
#: (:data:`kvcache.retention.decide.EXPIRY_QUANTUM_MS`), and 4 bytes hold them to 2106.
EXPIRY_UNIT_MS = 1000
_ROW = struct.Struct(">HHIIQIII")


class _RowStruct:
    """One shard's row in the ``index`` database, as a ``struct``: shard index (the
    duplicates' sort key), class id, record size, expiry (milliseconds here, whole seconds
    on disk), stripe, written (seconds, rounded up), segment, offset."""

    __slots__ = ()
    size = _ROW.size

    @staticmethod
    def pack(
        index: int, cid: int, size: int, expiry_ms: int, stripe: int, written: int, seg: int,
        off: int,
    ) -> bytes:  # fmt: skip
        """The row's bytes; an expiry between whole seconds is rounded up (never shortened)."""
        expiry_s = int(_expiry_seconds(np.array([-(-expiry_ms // EXPIRY_UNIT_MS)]))[0])
        return _ROW.pack(index, cid, size, expiry_s, stripe, written, seg, off)

    @staticmethod
    def unpack(raw: bytes | memoryview) -> tuple[int, int, int, int, int, int, int, int]:
        """(index, class id, size, expiry_ms, stripe, written_s, segment, offset)."""
        index, cid, size, expiry_s, stripe, written, seg, off = _ROW.unpack(raw)
        return index, cid, size, expiry_s * EXPIRY_UNIT_MS, stripe, written, seg, off

    @staticmethod
    def unpack_from(
        raw: bytes | memoryview, offset: int = 0
    ) -> tuple[int, int, int, int, int, int, int, int]:
        """:meth:`unpack` of the row at ``offset``."""
        index, cid, size, expiry_s, stripe, written, seg, off = _ROW.unpack_from(raw, offset)
        return index, cid, size, expiry_s * EXPIRY_UNIT_MS, stripe, written, seg, off


def _expiry_seconds(seconds: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Expiries in whole seconds, checked to fit a row's u32 (until 2106): a clock that far
    off is a failed write (StorageError), never a row that wraps and reads as expired."""
    if len(seconds) and (int(seconds.min()) < 0 or int(seconds.max()) > 0xFFFF_FFFF):
        raise StorageError(
            f"an expiry of {int(seconds.max())} s is beyond what a row keeps (2^32 s): is "
            "the daemon's clock right?",
            kind="storage",
        )
    return seconds


ROW = _RowStruct()
ROW_LEN = _ROW.size
#: The same 32-byte row as a numpy record; ``expiry`` is in seconds (:func:`row_expiry_ms`).
ROW_DTYPE = np.dtype(
    [("index", ">u2"), ("cls", ">u2"), ("size", ">u4"), ("expiry", ">u4"), ("stripe", ">u8"),
     ("written", ">u4"), ("seg", ">u4"), ("off", ">u4")]
)  # fmt: skip
assert ROW_DTYPE.itemsize == ROW_LEN


def row_expiry_ms(rows: npt.NDArray[np.void]) -> npt.NDArray[np.int64]:
    """The expiries (ms) of rows of :data:`ROW_DTYPE`."""
    return rows["expiry"].astype(np.int64) * EXPIRY_UNIT_MS


_LOC = struct.Struct(">IIII")
_U64 = struct.Struct(">Q")
#: Class ids are u16; a table never holds more.
MAX_CLASSES = 1 << 16


class ClassTable:
    """Stored class names by id: a row names its class with 2 bytes, not the name.

    Ids are handed out in memory (:meth:`id_of`) and persisted by :meth:`persist`, which
    every write transaction that may have packed a new id calls before it commits: a
    committed row never names an id its transaction did not commit. Names are never
    removed (a node sees a handful: the policy's classes, their pinned ``+`` twins, and
    those of older policies).
    """

    __slots__ = ("_ids", "_persisted", "names")

    def __init__(self, names: list[str] | None = None) -> None:
        self.names: list[str] = list(names or [])
        self._ids = {name: i for i, name in enumerate(self.names)}
        self._persisted = len(self.names)

    @classmethod
    def unpack(cls, raw: bytes | None) -> ClassTable:
        """The table of a ``classes`` meta row (None: an empty table)."""
        return cls(bytes(raw).decode("ascii").split("\n") if raw else [])

    def pack(self) -> bytes:
        """The meta row's value."""
        return "\n".join(self.names).encode("ascii")

    def find(self, name: str) -> int | None:
        """The id of ``name``, None if it has none (nothing stored under it)."""
        return self._ids.get(name)

    def id_of(self, name: str) -> int:
        """The id of ``name``, a new one if it has none yet."""
        found = self._ids.get(name)
        if found is not None:
            return found
        if len(self.names) >= MAX_CLASSES:  # pragma: no cover - 65,536 class names
            raise ValueError("too many stored class names")
        self._ids[name] = len(self.names)
        self.names.append(name)
        return len(self.names) - 1

    @property
    def dirty(self) -> bool:
        """Whether ids were handed out since the table was last persisted."""
        return len(self.names) > self._persisted

    def persisted(self) -> None:
        """The transaction that wrote :meth:`pack` committed."""
        self._persisted = len(self.names)


@dataclass(frozen=True, slots=True)
class Row:
    """One shard's index row: where its record is, and its retention.

    ``written_ms`` is when this daemon stored the shard (its own clock), which decides
    whether another writer may replace it (docs/spec/wire.md, PUT); it is kept in whole
    seconds, rounded up, so a shard never looks older than it is. ``size`` is the
    record's length (header + body), what capacity and quotas count.
    """

    index: int
    expiry_ms: int
    size: int
    stripe: int
    written_ms: int
    traffic_class: str
    seg: int
    off: int

    def pack(self, classes: ClassTable) -> bytes:
        """The row's bytes (a new class name gets an id in ``classes``)."""
        return ROW.pack(
            self.index, classes.id_of(self.traffic_class), self.size, self.expiry_ms,
            self.stripe, written_s(self.written_ms), self.seg, self.off,
        )  # fmt: skip

    @classmethod
    def unpack(cls, raw: bytes | memoryview, classes: ClassTable) -> Row:
        """Parse a row written by :meth:`pack` (our own disk: trusted layout)."""
        index, cid, size, expiry, stripe, written, seg, off = ROW.unpack_from(raw)
        return cls(index, expiry, size, stripe, written * 1000, classes.names[cid], seg, off)

    @property
    def location(self) -> bytes:
        """The record's location as :data:`kvcache.server.segments.LOCATION` bytes."""
        return _LOC.pack(self.seg, self.off, self.size, 0)


#: The resolution of a row's written time: a shard may look up to this much younger than
#: it is, so another writer may replace it up to this long after ``replace_after_s``.
WRITTEN_RESOLUTION_MS = 1000


def written_s(written_ms: int) -> int:
    """A row's written time: milliseconds rounded UP to whole seconds (a shard may look
    younger than it is, never older: the racing-writer rule's wait is never cut short)."""
    return -(-written_ms // WRITTEN_RESOLUTION_MS)


def row_location(raw: bytes | memoryview) -> bytes:
    """The LOCATION bytes of a packed row (segment, offset, length; no header check)."""
    _i, _c, size, _e, _s, _w, seg, off = ROW.unpack_from(raw)
    return _LOC.pack(seg, off, size, 0)


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
    *,
    class_ids: npt.NDArray[np.integer],
    sizes: npt.NDArray[np.integer],
    expiry_ms: npt.NDArray[np.integer],
    stripes: npt.NDArray[np.uint64],
    written_ms: int,
    seg: int,
    offsets: npt.NDArray[np.integer],
) -> list[bytes]:
    """Index rows of shards written at once (of any tenants and classes), built as columns:
    the batch twin of :meth:`Row.pack` (a property test holds them byte-identical). Every
    record is in segment ``seg``, at ``offsets``."""
    n = len(skeys)
    if not n:
        return []
    keys = np.frombuffer(b"".join(skeys), np.uint8).reshape(n, KEY_LEN)
    rows = np.empty(n, ROW_DTYPE)
    rows["index"] = (keys[:, -2].astype(np.uint16) << 8) | keys[:, -1]
    rows["cls"] = class_ids
    rows["size"] = sizes
    rows["expiry"] = _expiry_seconds(-(-np.asarray(expiry_ms, np.int64) // EXPIRY_UNIT_MS))
    rows["stripe"] = stripes
    rows["written"] = written_s(written_ms)
    rows["seg"] = seg
    rows["off"] = offsets
    out: list[bytes] = rows.view(f"V{ROW_LEN}").tolist()
    return out


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


#: One element of a ``getmulti(..., keyfixed=True)`` answer of the index: key and row.
HIT_DTYPE = np.dtype([("key", f"V{BLOCK_LEN}"), ("row", ROW_DTYPE)])
HIT_LEN = BLOCK_LEN + ROW_LEN
#: A GET request's items, as the native helpers read them.
_GET_ITEM = ITEM_DTYPES[(Op.GET, False)]
assert (
    KEY_LEN,
    _GET_ITEM.itemsize,
    HIT_LEN,
) == (native.STORE_KEY_LEN, native.GET_ITEM_LEN, native.INDEX_HIT_LEN)

#: Runs of records, one (segment, start, end) row each (see :func:`record_runs`).
Runs = npt.NDArray[np.uint64]


def _native_get(items: npt.NDArray[np.void]) -> bool:
    return native.AVAILABLE and items.dtype == _GET_ITEM and items.flags.c_contiguous


def get_key_rows(tenant: bytes, items: npt.NDArray[np.void]) -> bytes:
    """:func:`store_key_rows` of a GET request's items (in one native call when it can)."""
    if _native_get(items):
        return native.get_keys(tenant, items)
    return store_key_rows(tenant, items["key"], items["index"])


def record_runs(
    seg: npt.NDArray[np.integer], off: npt.NDArray[np.integer], length: npt.NDArray[np.integer]
) -> Runs:
    """The runs of records that follow each other in one segment, in order: records j
    (segment ``seg[j]``, bytes [off[j], off[j] + length[j])) as (segment, start, end) rows."""
    n = len(seg)
    seg = np.asarray(seg, np.uint64)
    off = np.asarray(off, np.uint64)
    end = off + np.asarray(length, np.uint64)
    starts = np.ones(n, bool)
    starts[1:] = (seg[1:] != seg[:-1]) | (off[1:] != end[:-1])
    first = np.flatnonzero(starts)
    last = np.append(first[1:], n) - 1
    return np.stack([seg[first], off[first], end[last]], axis=1)


def quiet_get(
    items: npt.NDArray[np.void],
    raw_keys: bytes,
    found: Any,
    quiet_above: int,
    reply: npt.NDArray[np.void],
) -> tuple[Runs, int] | None:
    """A daemon's quiet GET, the common one: if the getmulti answer ``found`` (rows of
    :data:`HIT_DTYPE`) holds exactly the asked shards (storage keys ``raw_keys``, one per
    item), one row each and in order, all expiring after ``quiet_above`` and of the
    stripes ``items`` want (0: any), then the runs of their records and the bytes of them
    all, with each ``reply`` item's length set; else None, with ``reply`` untouched.
    One native call when the helpers are loaded, else numpy columns."""
    if _native_get(items):
        return native.get_quiet(items, raw_keys, found, quiet_above, reply)
    return quiet_get_numpy(items, raw_keys, found, quiet_above, reply)


def quiet_get_numpy(
    items: npt.NDArray[np.void],
    raw_keys: bytes,
    found: Any,
    quiet_above: int,
    reply: npt.NDArray[np.void],
) -> tuple[Runs, int] | None:
    """:func:`quiet_get` without the native helpers."""
    n = len(items)
    if not n or len(found) != n * HIT_LEN:
        return None
    raw = np.frombuffer(found, np.uint8).reshape(n, HIT_LEN)
    if not np.array_equal(raw[:, :KEY_LEN], np.frombuffer(raw_keys, np.uint8).reshape(n, KEY_LEN)):
        return None  # not the asked shards, one each, in order
    rows = raw.view(HIT_DTYPE).reshape(n)["row"]
    if int(rows["expiry"].min()) * EXPIRY_UNIT_MS <= quiet_above:
        return None
    stripes = items["stripe"]
    if stripes.any() and ((stripes != 0) & (stripes != rows["stripe"])).any():
        return None
    sizes = rows["size"]
    reply["length"] = sizes
    return record_runs(rows["seg"], rows["off"], sizes), int(sizes.sum())


def store_key_rows(
    tenant: bytes, keys: npt.NDArray[np.void], indices: npt.NDArray[np.integer]
) -> bytes:
    """Storage keys of one tenant for parallel arrays of 16-byte block keys and shard
    indices, as one buffer of ``KEY_LEN``-byte rows (the GET path compares it whole)."""
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
    return packed.tobytes()


def split_rows(raw: bytes, width: int, prefix: int | None = None) -> list[bytes]:
    """The ``width``-byte rows of ``raw`` (only their first ``prefix`` bytes if given)."""
    take = width if prefix is None else prefix
    return [raw[i : i + take] for i in range(0, len(raw), width)]


def store_keys(
    tenant: bytes, keys: npt.NDArray[np.void], indices: npt.NDArray[np.integer]
) -> list[bytes]:
    """Storage keys of one tenant for parallel arrays of 16-byte block keys and shard indices."""
    return split_rows(store_key_rows(tenant, keys, indices), KEY_LEN)


def split_store_key(key: bytes | memoryview) -> tuple[TenantId, bytes, int]:
    """(tenant, block key, shard index) of a storage key."""
    raw = bytes(key)
    return TenantId(raw[:TENANT_LEN]), raw[TENANT_LEN:-2], int.from_bytes(raw[-2:], "big")


_PUT_ITEM = ITEM_DTYPES[(Op.PUT, False)]
assert _PUT_ITEM.itemsize == native.PUT_ITEM_LEN


def check_put(tenant: bytes, items: npt.NDArray[np.void], data: memoryview) -> CheckedPut:
    """Check every record of a PUT batch; never raises on bad records, only marks them.
    One native call when the helpers are loaded (:func:`check_put_numpy` otherwise)."""
    if not (
        native.AVAILABLE
        and len(items)
        and items.dtype == _PUT_ITEM
        and items.flags.c_contiguous
        and type(tenant) is bytes
        and len(tenant) == TENANT_LEN
    ):
        return check_put_numpy(tenant, items, data)
    checks = native.check_put(tenant, items, data)
    if checks is None:
        total = int(items["length"].astype(np.int64).sum())
        raise ProtocolError(f"item lengths add up to {total}, data is {len(data)} bytes")
    if not checks.passed:
        return CheckedPut(checks.status, [], [], [], [], [], [], [])
    view = memoryview(data)
    offset, length, stripe, expect, check = checks.columns.T.tolist()
    names: dict[bytes, str] = {}
    return CheckedPut(
        checks.status,
        checks.positions.tolist(),
        split_rows(checks.keys, KEY_LEN),
        [view[a : a + n] for a, n in zip(offset, length, strict=True)],
        [names.get(b) or names.setdefault(b, b.decode("ascii")) for b in checks.names.tolist()],
        stripe,
        expect,
        check,
    )


def check_put_numpy(tenant: bytes, items: npt.NDArray[np.void], data: memoryview) -> CheckedPut:
    """:func:`check_put` without the native helpers."""
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
