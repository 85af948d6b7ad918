"""Per-batch native helpers of the data path: batched hashing and scatter/gather socket I/O.

Why: at 112 KiB blocks one GB is ~8,700 blocks and ~100,000 shard transfers, and the
Python data path paid per shard for each of them: an ``xxhash`` call per shard body and
header, a ``memoryview`` per section sent or received, and the bookkeeping of partial
``sendmsg`` / ``recvmsg_into`` calls over lists of views. Measured with py-spy (GIL
holder only) on a 12-daemon loopback cluster, that per-shard Python was about 70 % of a
store's client time and 35-40 % of a load's (``docs/architecture.md``, "Native helpers").
These functions do the same work once per batch, in C, with the GIL released: the caller
describes the buffers as arrays of addresses and lengths (computed with numpy over the
batch) instead of building one Python object per shard.

``libkvfast.so`` is built from ``kvfast.c`` by ``scripts/build-native.sh`` (README's setup
command runs it), with xxHash compiled in, and is loaded through ctypes. Without it every
caller falls back to the pure-Python path, which gives the same bytes
(``KVCACHE_NATIVE_LIBRARY`` names the library elsewhere):
:data:`AVAILABLE` says which path runs. ``KVCACHE_NATIVE=0`` turns the library off (the
benchmarks' A/B), and ``KVCACHE_NATIVE=require`` makes a missing library an error (CI).

Every function here trusts its addresses: callers compute them from numpy arrays and
buffers they hold for the duration of the call. The hashes are bit-identical to the
``xxhash`` package's (a property test holds that).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import xxhash

from kvcache.errors import ConfigError

__all__ = [
    "AVAILABLE",
    "BURST_DTYPE",
    "Burst",
    "ENV",
    "HASH_KERNEL",
    "LIBRARY",
    "LIBRARY_ENV",
    "Segments",
    "accept_items",
    "addresses_of",
    "chain_keys",
    "check_put",
    "ec_run_many",
    "encode_hashed",
    "get_burst",
    "get_keys",
    "get_quiet",
    "landing_segments",
    "recv_hashed",
    "recv_scatter",
    "send_gather",
    "xxh3_128_many",
    "xxh3_64_many",
]

log = logging.getLogger(__name__)

ENV = "KVCACHE_NATIVE"
LIBRARY_ENV = "KVCACHE_NATIVE_LIBRARY"
#: The built library: next to this module, unless KVCACHE_NATIVE_LIBRARY names another.
LIBRARY = Path(os.environ.get(LIBRARY_ENV) or Path(__file__).with_name("libkvfast.so"))
_ABI_VERSION = 17

U64Array = npt.NDArray[np.uint64]


def _load() -> Any:
    mode = os.environ.get(ENV, "auto").strip().lower()
    if mode in ("0", "off", "no", "false"):
        return None
    try:
        lib = ctypes.CDLL(str(LIBRARY))
        if lib.kv_abi_version() != _ABI_VERSION:
            raise OSError(f"{LIBRARY} is ABI {lib.kv_abi_version()}, expected {_ABI_VERSION}")
    except OSError as exc:
        if mode == "require":
            raise ConfigError(
                f"{ENV}=require but the native helpers did not load ({exc}); "
                "build them with `bash scripts/build-native.sh`"
            ) from exc
        log.info("native helpers not loaded (%s): using the Python data path", exc)
        return None
    ptr, size = ctypes.c_void_p, ctypes.c_size_t
    lib.kv_burst_ex_size.restype = size
    for name in ("kv_xxh3_64_many", "kv_xxh3_128_many"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, size, ptr]
        fn.restype = None
    lib.kv_chain_keys.argtypes = [ptr, ptr, size, ptr, size, size, size, size, ptr, ptr]
    lib.kv_chain_keys.restype = None
    lib.kv_hash_kernel.restype = ctypes.c_char_p
    lib.kv_landing_segments.argtypes = [ptr, ptr, ptr, ptr, ptr, size, ptr, ptr, ptr]
    lib.kv_landing_segments.restype = size
    u64 = ctypes.c_uint64
    lib.kv_accept_items.argtypes = [ptr, ptr, ptr, ptr, size, *[ptr] * 9]
    lib.kv_accept_items.restype = size
    lib.kv_accept_get_reply.argtypes = [ptr, size, *[ptr] * 11]
    lib.kv_accept_get_reply.restype = size
    lib.kv_land_get_reply.argtypes = [ptr, size, *[ptr] * 9]
    lib.kv_land_get_reply.restype = size
    lib.kv_add_at.argtypes = [ptr, ptr, size, ctypes.c_int64]
    lib.kv_get_burst.argtypes = [
        ptr, size, ptr, ctypes.c_int64, u64, u64, ptr, u64, ctypes.c_int, u64,
    ]  # fmt: skip
    lib.kv_get_burst.restype = ctypes.c_int64
    lib.kv_add_at.restype = None
    lib.kv_ec_run_many.argtypes = [u64, ctypes.c_int, ctypes.c_int, size, ptr, ptr, size, ptr]
    lib.kv_ec_run_many.restype = None
    lib.kv_encode_hashed.argtypes = [
        u64, ctypes.c_int, ctypes.c_int, ctypes.c_int, u64, size, ptr, ptr, u64, ptr, ptr
    ]  # fmt: skip
    lib.kv_encode_hashed.restype = None
    lib.kv_recv_hashed.argtypes = [
        ctypes.c_int, ptr, u64, u64, ptr, u64, ctypes.c_double, ptr, ptr
    ]  # fmt: skip
    lib.kv_recv_hashed.restype = ctypes.c_int
    lib.kv_get_keys.argtypes = [ptr, ptr, size, ptr]
    lib.kv_get_keys.restype = None
    lib.kv_get_quiet.argtypes = [ptr, ptr, size, ptr, size, u64, ptr, ptr, ptr]
    lib.kv_get_quiet.restype = ctypes.c_int64
    lib.kv_check_put.argtypes = [ptr, ptr, size, ptr, u64, ptr, ptr, ptr, ptr, ptr]
    lib.kv_check_put.restype = ctypes.c_int64
    for name in ("kv_recv_scatter", "kv_send_gather"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_int, ptr, ptr, size, ptr]
        fn.restype = ctypes.c_int64
    return lib


_LIB = _load()
#: True when the native helpers are loaded (else the callers' Python fallbacks run).
AVAILABLE: bool = _LIB is not None
#: The hash kernel in use: "avx512", "avx2" or "sse2" (native), or "python".
HASH_KERNEL: str = _LIB.kv_hash_kernel().decode() if _LIB is not None else "python"


def addresses_of(array: npt.NDArray[Any]) -> int:
    """The address of ``array``'s first byte (it must stay alive while the address is used).

    ~1.4 µs for a writable array against ~7 µs for ``array.ctypes.data`` on a loaded 2-core
    VM; the data path asks for several per batch."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array.data))
    except (TypeError, ValueError, BufferError):  # read-only, empty or not contiguous
        return int(array.ctypes.data)


def buffer_address(buf: Any) -> int:
    """The address of a writable or read-only contiguous buffer's first byte."""
    return addresses_of(np.frombuffer(buf, np.uint8))


#: What :func:`recv_hashed` reports besides an errno: every byte arrived, the peer closed the
#: stream first, the deadline passed first.
RECV_DONE, RECV_CLOSED, RECV_DEADLINE = 0, 1, 2


def recv_hashed(
    fd: int,
    buf: Any,
    *,
    piece: int,
    deadline: float,
    prefix: bytes | None,
) -> tuple[int, int, bytes]:
    """Receive ``len(buf)`` bytes from the blocking socket ``fd`` into the writable buffer
    ``buf``, ``piece`` bytes at a time, hashing each piece as it lands (``kv_recv_hashed``).

    With ``prefix`` (None: no hash), the digest is the canonical XXH3-128 of ``prefix``
    then the received bytes (``xxhash.xxh3_128(prefix)`` fed them). ``deadline`` is on
    ``time.monotonic``'s clock. Returns (status, bytes received, digest): status is
    :data:`RECV_DONE`, :data:`RECV_CLOSED`, :data:`RECV_DEADLINE` or -errno (-EAGAIN:
    the socket's SO_RCVTIMEO passed); the digest is b"" unless every byte arrived.
    The Python-level caller loops instead where the library is absent.
    """
    assert _LIB is not None
    view = memoryview(buf).cast("B")
    size = view.nbytes
    got = ctypes.c_uint64(0)
    digest = ctypes.create_string_buffer(16) if prefix is not None else None
    status = _LIB.kv_recv_hashed(
        fd,
        buffer_address(view) if size else None,
        size,
        piece,
        prefix,
        len(prefix) if prefix is not None else 0,
        deadline,
        digest,
        ctypes.byref(got),
    )
    done = status == RECV_DONE and digest is not None
    return int(status), int(got.value), digest.raw if done and digest is not None else b""


def xxh3_64_many(addrs: U64Array, lens: U64Array | np.uint64 | int) -> U64Array:
    """XXH3-64 of each buffer ``(addrs[i], lens[i])``."""
    addrs = np.ascontiguousarray(addrs, np.uint64)
    lens = np.ascontiguousarray(np.broadcast_to(lens, addrs.shape), np.uint64)
    out = np.empty(addrs.shape, np.uint64)
    if not addrs.size:
        return out
    if _LIB is None:
        digest = xxhash.xxh3_64_intdigest
        for i, (a, n) in enumerate(
            zip(addrs.reshape(-1).tolist(), lens.reshape(-1).tolist(), strict=True)
        ):
            out.reshape(-1)[i] = digest(ctypes.string_at(a, n))
        return out
    _LIB.kv_xxh3_64_many(addresses_of(addrs), addresses_of(lens), addrs.size, addresses_of(out))
    return out


def xxh3_128_many(addrs: U64Array, lens: U64Array | np.uint64 | int) -> npt.NDArray[np.void]:
    """Canonical XXH3-128 digests (as ``xxhash.xxh3_128_digest``) of each buffer, as V16."""
    addrs = np.ascontiguousarray(addrs, np.uint64)
    lens = np.ascontiguousarray(np.broadcast_to(lens, addrs.shape), np.uint64)
    out = np.empty(addrs.shape, "V16")
    if not addrs.size:
        return out
    if _LIB is None:
        digest = xxhash.xxh3_128_digest
        flat = out.reshape(-1)
        for i, (a, n) in enumerate(
            zip(addrs.reshape(-1).tolist(), lens.reshape(-1).tolist(), strict=True)
        ):
            flat[i] = digest(ctypes.string_at(a, n))
        return out
    _LIB.kv_xxh3_128_many(addresses_of(addrs), addresses_of(lens), addrs.size, addresses_of(out))
    return out


def chain_keys(
    seed: bytes, tag: bytes, raw: bytes, step: int, count: int, group: int, tag_bytes: int
) -> list[bytes]:
    """``count`` chained keys in one native call, as :func:`kvcache.keys.block_keys` makes
    them a call a block without the helpers: ``h`` i is the canonical XXH3-128 digest of
    ``tag`` + key i-1 + the ``step`` bytes of block i of ``raw`` (key -1: ``seed``); key i
    is ``h`` i with, where i is not a multiple of ``group``, its first ``tag_bytes`` bytes
    taken from key i-1 (the placement tag a group shares)."""
    if len(seed) != 16 or step <= 0 or len(raw) < step * count or group < 1:
        raise ValueError(f"chain_keys: {len(seed)}-byte seed, {count} blocks of {step} bytes "
                         f"in {len(raw)} bytes, groups of {group}")  # fmt: skip
    if not 0 <= tag_bytes <= 16:
        raise ValueError(f"chain_keys: a placement tag of {tag_bytes} bytes (0..16)")
    if not count:
        return []
    if _LIB is None:
        digest = xxhash.xxh3_128_digest
        keys, parent = [], seed
        for i, start in enumerate(range(0, step * count, step)):
            own = digest(tag + parent + raw[start : start + step])
            parent = own if i % group == 0 else parent[:tag_bytes] + own[tag_bytes:]
            keys.append(parent)
        return keys
    scratch = ctypes.create_string_buffer(len(tag) + 16 + step)
    out = ctypes.create_string_buffer(16 * count)
    _LIB.kv_chain_keys(seed, tag, len(tag), raw, step, count, group, tag_bytes, scratch, out)
    whole = out.raw
    return [whole[i : i + 16] for i in range(0, 16 * count, 16)]


class Segments:
    """A message section as (address, length) pairs, with the progress of sending or
    receiving it, and what keeps the buffers alive.

    One uint64 table holds the addresses (``[0, cap)``), the lengths (``[cap, 2 cap)``)
    and the state (segment, offset within it, peer closed), so the native calls get three
    pointers into one buffer whose address is taken once.
    """

    __slots__ = ("_at", "cap", "count", "keepalive", "nbytes", "table")

    def __init__(
        self,
        table: U64Array,
        cap: int,
        count: int,
        keepalive: Any,
        *,
        at: int | None = None,
        nbytes: int | None = None,
    ) -> None:
        self.table = table
        self.cap = cap
        self.count = count
        self.keepalive = keepalive
        self._at = _address_of_writable(table) if at is None else at
        self.nbytes = int(table[cap : cap + count].sum()) if nbytes is None else nbytes

    @classmethod
    def empty(cls, cap: int) -> tuple[U64Array, int]:
        """A zeroed table with room for ``cap`` segments, and its cap (for builders)."""
        return np.zeros(2 * cap + 3, np.uint64), cap

    @classmethod
    def of(cls, addrs: Any, lens: Any, keepalive: Any) -> Segments:
        """Segments of nonzero length (zero-length ones are dropped)."""
        addrs = np.asarray(addrs, np.uint64).reshape(-1)
        lens = np.asarray(lens, np.uint64).reshape(-1)
        keep = lens > 0
        if not keep.all():
            addrs, lens = addrs[keep], lens[keep]
        count = len(lens)
        table = np.empty(2 * count + 3, np.uint64)
        table[:count] = addrs
        table[count : 2 * count] = lens
        table[2 * count :] = 0
        return cls(table, count, count, keepalive)

    @property
    def addrs(self) -> U64Array:
        return self.table[: self.count]

    @property
    def lens(self) -> U64Array:
        return self.table[self.cap : self.cap + self.count]

    @property
    def state(self) -> U64Array:
        return self.table[2 * self.cap :]

    @property
    def pointers(self) -> tuple[int, int, int]:
        """Addresses of the addresses, the lengths and the state, for the native calls."""
        at = self._at
        return at, at + 8 * self.cap, at + 16 * self.cap

    @property
    def done(self) -> bool:
        return int(self.table[2 * self.cap]) >= self.count

    @property
    def closed(self) -> bool:
        return bool(self.table[2 * self.cap + 2])

    def views(self) -> list[memoryview]:
        """The remaining segments as memoryviews (the Python path, e.g. under TLS); each
        view keeps the buffers alive."""
        state = self.state
        start, offset = int(state[0]), int(state[1])
        out: list[memoryview] = []
        for j, (a, n) in enumerate(
            zip(self.addrs[start:].tolist(), self.lens[start:].tolist(), strict=True)
        ):
            skip = offset if j == 0 else 0
            buf = (ctypes.c_char * (n - skip)).from_address(a + skip)
            buf.keepalive = self.keepalive  # lives with the view
            out.append(memoryview(buf).cast("B"))
        return out

    def advance(self, nbytes: int) -> None:
        """Mark ``nbytes`` more as done (after a Python-path send or receive)."""
        state = self.state
        i, off = int(state[0]), int(state[1])
        lens = self.lens
        while nbytes and i < len(lens):
            left = int(lens[i]) - off
            if nbytes < left:
                off += nbytes
                nbytes = 0
                break
            nbytes -= left
            i, off = i + 1, 0
        state[0], state[1] = i, off


def _address_of_writable(array: npt.NDArray[Any]) -> int:
    # ~1.4 µs against ~7 µs for ``array.ctypes.data`` on a loaded 2-core VM.
    return ctypes.addressof(ctypes.c_char.from_buffer(array.data))


def recv_scatter(fd: int, seg: Segments) -> int:
    """Receive from non-blocking socket ``fd`` into ``seg`` until it is full or the socket
    has nothing more; the bytes received (``seg.closed`` tells whether the peer closed).
    Raises ``BlockingIOError`` when nothing at all could be read, ``OSError`` on errors."""
    assert _LIB is not None
    addrs, lens, state = seg.pointers
    got = int(_LIB.kv_recv_scatter(fd, addrs, lens, seg.count, state))
    if got < 0:
        raise BlockingIOError() if -got in _BLOCKING else OSError(-got, os.strerror(-got))
    return got


def send_gather(fd: int, seg: Segments) -> int:
    """Send ``seg`` on non-blocking socket ``fd`` until done or the socket buffer is full;
    the bytes sent. Raises ``BlockingIOError`` when nothing could be sent."""
    assert _LIB is not None
    addrs, lens, state = seg.pointers
    sent = int(_LIB.kv_send_gather(fd, addrs, lens, seg.count, state))
    if sent < 0:
        raise BlockingIOError() if -sent in _BLOCKING else OSError(-sent, os.strerror(-sent))
    return sent


def _at(array: npt.NDArray[Any]) -> int:
    """The address of a C-contiguous array, writable or not."""
    return _address_of_writable(array) if array.flags.writeable else addresses_of(array)


def accept_items(
    blocks: npt.NDArray[np.int64],
    indices: npt.NDArray[np.int64],
    statuses: npt.NDArray[np.uint8],
    lengths: npt.NDArray[np.int64],
    tables_at: tuple[int, ...],
) -> npt.NDArray[np.bool_]:
    """Per item of a landed GET reply, is it exactly the shard asked for
    (``kv_accept_items`` in kvfast.c); marks got / rejected / not-found in place.
    ``tables_at``: the addresses of (sealed, unknown, got, rejected, not_found,
    header_rows, identities, geometry), C-contiguous arrays the caller keeps alive."""
    assert _LIB is not None
    count = len(blocks)
    accepted = np.empty(count, bool)
    if not count:
        return accepted
    # Bound to names: an address outlives nothing, and a converted copy (a field of a
    # structured reply, say) would be freed, and its memory reused, before the call.
    blocks = np.ascontiguousarray(blocks, np.int64)
    indices = np.ascontiguousarray(indices, np.int64)
    statuses = np.ascontiguousarray(statuses, np.uint8)
    lengths = np.ascontiguousarray(lengths, np.int64)
    _LIB.kv_accept_items(
        _at(blocks),
        _at(indices),
        _at(statuses),
        _at(lengths),
        count,
        *tables_at,
        _address_of_writable(accepted),
    )
    return accepted


#: ``sizeof(size_t)`` all ones: what the native calls return for "take the general path".
_SIZE_MAX = 2 ** (8 * ctypes.sizeof(ctypes.c_size_t)) - 1


def accept_get_reply(
    items_at: int,
    count: int,
    blocks_at: int,
    indices_at: int,
    tables_at: tuple[int, ...],
    accepted_at: int,
) -> None:
    """:func:`accept_items` over a GET reply's own items (C-contiguous 8-byte records at
    ``items_at``, ``count`` of them, one per shard asked), ``blocks_at`` / ``indices_at``
    the addresses of the asked shards' C-contiguous int64 block and index arrays; the
    verdicts go to the ``count`` bytes at ``accepted_at`` (a :class:`GetLanding`'s)."""
    assert _LIB is not None
    if count:
        _LIB.kv_accept_get_reply(items_at, count, blocks_at, indices_at, *tables_at, accepted_at)


#: One exchange of :func:`get_burst` (``kv_burst_ex`` in kvfast.c): inputs, then progress.
BURST_DTYPE = np.dtype(
    [
        ("fd", "<i8"),
        ("req_addr", "<u8", (2,)),
        ("req_len", "<u8", (2,)),
        ("expect_id", "<u8"),
        ("count", "<u8"),
        ("blocks_at", "<u8"),
        ("indices_at", "<u8"),
        ("header_at", "<u8"),
        ("items_at", "<u8"),
        ("table_at", "<u8"),
        ("cap", "<u8"),
        ("sent", "<u8"),
        ("got", "<u8"),
        ("used", "<u8"),
        ("state", "<i8"),
        ("error", "<i8"),
        # DONE: the reply items' flag bytes OR-ed (kvcache.wire.GET_REFRESHED).
        ("item_flags", "<u8"),
        # A plain exchange (table_at 0): bytes per reply item; the count its reply announced.
        ("reply_item", "<u8"),
        ("reply_count", "<u8"),
        # The request's data section: a Segments table (address), its cap and its count.
        ("data_at", "<u8"),
        ("data_cap", "<u8"),
        ("data_count", "<u8"),
    ]
)
if _LIB is not None and _LIB.kv_burst_ex_size() != BURST_DTYPE.itemsize:
    raise ConfigError(
        f"{LIBRARY}'s burst exchange is {_LIB.kv_burst_ex_size()} bytes, kvcache.native's "
        f"{BURST_DTYPE.itemsize}: rebuild it with `bash scripts/build-native.sh`"
    )


class Burst:
    """States of a :func:`get_burst` exchange."""

    SEND, HEAD, ITEMS, DATA, DONE = 0, 1, 2, 3, 4
    #: The reply's header is in and is not the expected one: the Python transport reads on.
    STOP_HEADER = 5
    #: Header and items are in, no native landing: the Python transport lands the data.
    STOP_LANDING = 6
    FAILED = -1


def get_burst(
    exchanges: npt.NDArray[np.void],
    target_at: int,
    timeout_s: float,
    max_data: int,
    *,
    first_block: int = 0,
    need: npt.NDArray[np.uint8] | None = None,
    wake_fd: int = -1,
    min_left: int = 0,
) -> int:
    """Run ``exchanges`` (:data:`BURST_DTYPE`, filled in by the caller, every buffer alive for
    the call) until each is done, stopped or failed, or ``timeout_s`` passed: GETs sent and
    their replies received, landed and read whole, in the assembly whose tables'
    addresses are at ``target_at`` (``LoadAssembly.burst_target``). A done reply is also
    accepted (its verdicts after its landing buffer's counts) and its blocks no longer
    counted as being written. ``need``: return as soon as each block ``first_block + j`` has
    ``need[j]`` shards accepted (the load can go on without the rest). ``wake_fd``: return
    as soon as it is readable (the transport's wake socket). ``min_left``: once no more than
    that many are under way, wait for them a quarter of the time taken so far (at least
    200 µs), then return (the caller's round decides whether it needs them).

    A plain exchange (``table_at`` 0, ``target_at`` 0 for a burst of them: a HAS, say)
    is sent and its reply read, not landed: a reply of the request's op with at most
    ``count`` items of ``reply_item`` bytes (into ``items_at``) and no data section; its
    ``reply_count`` says how many came. An exchange with ``data_at`` (a :class:`Segments`
    table's address, with its ``cap`` and ``count``: a PUT's data section) sends those
    segments after its header and items, advancing the table's own state. Returns how many are still under way; each one's
    ``state`` says where it stands (:class:`Burst`)."""
    assert _LIB is not None
    if not len(exchanges):
        return 0
    left = int(
        _LIB.kv_get_burst(
            _address_of_writable(exchanges),
            len(exchanges),
            target_at,
            max(0, math.ceil(timeout_s * 1000)),  # whole ms, rounded up: never cut short
            max_data,
            first_block,
            None if need is None else addresses_of(need),
            0 if need is None else len(need),
            wake_fd,
            min_left,
        )
    )
    if left < 0:
        raise OSError(-left, os.strerror(-left))
    return left


def add_at(table_at: int, idx_at: int, count: int, delta: int) -> None:
    """``table[idx[j]] += delta`` for the ``count`` C-contiguous int64 indices at
    ``idx_at``, into the int64 table at ``table_at`` (``np.add.at`` without its per-call
    cost)."""
    assert _LIB is not None
    if count:
        _LIB.kv_add_at(table_at, idx_at, count, delta)


def encode_hashed(
    job: tuple[int, int, int],
    k: int,
    rows: U64Array,
    length: int,
    payloads: U64Array,
    payload_len: int,
) -> tuple[npt.NDArray[np.void], U64Array]:
    """Encode a batch of blocks and hash them, one block at a time: block i's payload (the
    ``payload_len`` bytes at ``payloads[i]``) hashed with XXH3-128, its parity written by
    ``job`` (``kvcache.erasure.EncodeJob``: ``ec_encode_data``, its tables, the parity rows)
    from the k data rows whose addresses are ``rows[i, :k]`` into the rows after them, then
    each of its rows (``length`` bytes) hashed with XXH3-64. Returns the payload digests
    (canonical, V16, as :func:`xxh3_128_many`) and the rows' hashes, shaped as ``rows``.

    Why: the three as passes over a whole batch read each byte from memory three times;
    block by block, the encode and the row hashes read what the payload's hash brought into
    the core's cache (``bench/native.py``: 1.8x faster than the three passes for 64 blocks
    of 112 KiB not in the caches, on the 2-core VM). Needs the native library (check
    :data:`AVAILABLE`)."""
    if _LIB is None:
        raise RuntimeError("encode_hashed needs the native library")
    function, tables, outputs = job
    if not 0 <= length <= 2**31 - 1:
        raise ValueError(f"ec_encode_data takes rows of at most 2**31 - 1 bytes, got {length}")
    table = np.ascontiguousarray(rows, np.uint64)
    bases = np.ascontiguousarray(payloads, np.uint64)
    count = table.shape[0]
    if table.ndim != 2 or table.shape[1] != k + outputs or bases.shape != (count,):
        raise ValueError(
            f"rows must be (blocks, {k + outputs}) and payloads (blocks,), got "
            f"{table.shape} and {bases.shape}"
        )
    digests = np.empty(count, "V16")
    hashes = np.empty(table.shape, np.uint64)
    if count:
        _LIB.kv_encode_hashed(
            function, length, k, outputs, tables, count, _at(table), _at(bases), payload_len,
            _at(digests), _at(hashes),
        )  # fmt: skip
    return digests, hashes


def ec_run_many(
    encode: int,
    length: int,
    k: int,
    tables: U64Array,
    io: U64Array,
    outputs: npt.NDArray[np.int32],
) -> None:
    """ISA-L's ``ec_encode_data`` (at address ``encode``) over a batch of blocks, each with
    its own tables (``tables[i]``, an address): block i reads the k rows whose addresses
    are ``io[i, :k]`` and writes ``outputs[i]`` rows at the addresses after them. One
    native call for a batch whose blocks need different decode tables; without the
    library, one ctypes call per block."""
    count = len(tables)
    if not count:
        return
    table = np.ascontiguousarray(io, np.uint64)
    outs = np.ascontiguousarray(outputs, np.int32)
    tabs = np.ascontiguousarray(tables, np.uint64)
    if _LIB is not None:
        _LIB.kv_ec_run_many(
            encode, length, k, count, _at(tabs), _at(table), table.shape[1], _at(outs)
        )
        return
    fn = ctypes.CFUNCTYPE(
        None, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p,
    )(encode)  # fmt: skip
    base, stride = _at(table), table.shape[1] * 8
    for i in range(count):
        if outs[i] > 0:
            row = base + i * stride
            fn(length, k, int(outs[i]), int(tabs[i]), row, row + k * 8)


class GetLanding(NamedTuple):
    """A GET reply landed by :func:`land_get_reply`: its segments, the blocks it writes (and
    their address), and where its verdicts go (:func:`accept_get_reply`), all in one buffer
    whose address was taken once."""

    segments: Segments
    writes: npt.NDArray[np.int64]
    writes_at: int
    accepted: npt.NDArray[np.bool_]
    accepted_at: int


def land_get_reply(
    items_at: int,
    count: int,
    blocks_at: int,
    indices_at: int,
    sealed_at: int,
    writing_at: int,
    geometry_at: int,
    keepalive: Any,
) -> GetLanding | None:
    """Where a GET reply's data section lands and the blocks it writes (each counted in
    the int64 ``writing`` table), from the reply's own items at ``items_at``
    (``kv_land_get_reply``); None, with nothing counted, when a record must go to scratch
    (the general path)."""
    assert _LIB is not None
    buf, cap = landing_buffer(count)
    at = _address_of_writable(buf)
    writes_at = at + 8 * (2 * cap + 3)
    used = int(
        _LIB.kv_land_get_reply(
            items_at,
            count,
            blocks_at,
            indices_at,
            sealed_at,
            writing_at,
            geometry_at,
            at,
            at + 8 * cap,
            writes_at,
            writes_at + 8 * count,
        )
    )
    if used == _SIZE_MAX:
        return None
    return landing_of(buf, cap, used, count, keepalive, at=at)


def landing_buffer(count: int) -> tuple[U64Array, int]:
    """The one buffer of a :class:`GetLanding` for a reply of ``count`` items, and its
    segment capacity: the segment table (2 cap + 3 words, its state zeroed), the blocks
    written (count), the (writes, bytes) counts (2), then a byte per item for the verdicts
    (``kv_land_get_reply`` and ``kv_get_burst`` fill it in)."""
    cap = 3 * count
    words = 2 * cap + 3 + count + 2
    buf = np.empty(words + (count + 7) // 8, np.uint64)
    buf[2 * cap : 2 * cap + 3] = 0
    return buf, cap


def landing_of(
    buf: U64Array, cap: int, used: int, count: int, keepalive: Any, *, at: int | None = None
) -> GetLanding:
    """The :class:`GetLanding` a :func:`landing_buffer` holds once landed (``used``
    segments)."""
    at = _address_of_writable(buf) if at is None else at
    words = 2 * cap + 3 + count + 2
    counts = buf[2 * cap + 3 + count : words]
    w, nbytes = int(counts[0]), int(counts[1])
    writes = buf[2 * cap + 3 : 2 * cap + 3 + w].view(np.int64)
    accepted = buf[words:].view(np.bool_)[:count]
    segments = Segments(buf[: 2 * cap + 3], cap, used, keepalive, at=at, nbytes=nbytes)
    return GetLanding(segments, writes, at + 8 * (2 * cap + 3), accepted, at + 8 * words)


def landing_segments(
    blocks: npt.NDArray[np.int64],
    indices: npt.NDArray[np.int64],
    statuses: npt.NDArray[np.uint8],
    lengths: npt.NDArray[np.int64],
    live: npt.NDArray[np.bool_],
    geometry: U64Array,
    keepalive: Any,
) -> Segments:
    """The segments a GET reply's records land in (see ``kv_landing_segments`` in
    kvfast.c for the rules and ``geometry``); the native library must be loaded."""
    assert _LIB is not None
    count = len(blocks)
    table, cap = Segments.empty(3 * count)
    at = _address_of_writable(table)
    arrays = [np.ascontiguousarray(a) for a in (blocks, indices, statuses, lengths, live)]
    used = _LIB.kv_landing_segments(
        *(_at(a) for a in arrays),
        count,
        addresses_of(geometry),
        at,
        at + 8 * cap,
    )
    seg = Segments(table, cap, int(used), keepalive)
    return seg


#: Bytes of a storage key (tenant 8, block key 16, shard index u16 big-endian) and of a
#: GET request item: the layouts kv_get_keys and kv_get_quiet read (kvfast.c).
STORE_KEY_LEN = 26
GET_ITEM_LEN = 32
PUT_ITEM_LEN = 32
#: Bytes of one getmulti answer row of a daemon's index: a block's key (24), its row (32).
INDEX_HIT_LEN = 56


def _bytes_of(buf: Any) -> Any:
    """What ctypes takes as the address of read-only ``buf``: the bytes object itself when
    ``buf`` is one or a whole view of one (py-lmdb's answers), else its address."""
    if type(buf) is memoryview and type(buf.obj) is bytes and buf.nbytes == len(buf.obj):
        return buf.obj
    if type(buf) is bytes:
        return buf
    return buffer_address(buf)


def get_keys(tenant: bytes, items: npt.NDArray[np.void]) -> bytes:
    """The storage keys of ``tenant``'s GET request ``items`` (C-contiguous records of the
    wire's GET item), as one buffer of 26-byte rows (``kv_get_keys``)."""
    assert _LIB is not None and len(tenant) == 8 and items.dtype.itemsize == GET_ITEM_LEN
    n = len(items)
    keys = np.empty(n * STORE_KEY_LEN, np.uint8)
    if n:
        _LIB.kv_get_keys(tenant, _at(items), n, _address_of_writable(keys))
    return keys.tobytes()


def get_quiet(
    items: npt.NDArray[np.void],
    keys: bytes,
    found: Any,
    quiet_above: int,
    reply: npt.NDArray[np.void],
) -> tuple[U64Array, int] | None:
    """The daemon's quiet GET over a getmulti answer ``found`` of the index (see
    ``kv_get_quiet``): None unless it holds exactly the asked shards, all live past
    ``quiet_above`` and of the wanted stripes; else the runs of adjacent records, one
    (segment, start, end) row each, and their total bytes, with each ``reply`` item's
    length set (``reply``: zeroed GET reply records, C-contiguous)."""
    assert _LIB is not None
    n = len(items)
    if not n or len(found) != n * INDEX_HIT_LEN:
        return None
    runs = np.empty((n, 3), np.uint64)
    total = np.zeros(1, np.uint64)
    count = int(
        _LIB.kv_get_quiet(
            _at(items),
            keys,
            n,
            _bytes_of(found),
            len(found),
            max(quiet_above, 0),  # never below 0 in practice; 0 sends expiry 0 the slow way
            _address_of_writable(reply),
            _address_of_writable(runs),
            _address_of_writable(total),
        )
    )
    if count < 0:
        return None
    return runs[:count], int(total[0])


class PutChecks(NamedTuple):
    """:func:`check_put`'s answer: the status of every item, and for the items that passed
    (``passed`` of them, in request order) their item positions, their storage keys as one buffer
    of 26-byte rows, their (offset, length, stripe id, expected stripe, header check)
    columns and their class fields (S16)."""

    status: npt.NDArray[np.uint8]
    passed: int
    positions: npt.NDArray[np.uint64]
    keys: bytes
    columns: npt.NDArray[np.uint64]
    names: npt.NDArray[np.bytes_]


def check_put(tenant: bytes, items: npt.NDArray[np.void], data: Any) -> PutChecks | None:
    """A daemon's checks of a PUT request (``kv_check_put``): the verdicts of
    ``kvcache.server.records.check_put`` in one call, hashing each record while it is in
    cache. ``items``: C-contiguous records of the wire's PUT item. None when the items'
    lengths do not add up to the data's."""
    assert _LIB is not None
    n = len(items)
    status = np.empty(n, np.uint8)
    positions = np.empty(n, np.uint64)
    keys = ctypes.create_string_buffer(n * STORE_KEY_LEN)
    columns = np.empty((n, 5), np.uint64)
    names = np.empty(n, "S16")
    size = memoryview(data).nbytes
    count = int(
        _LIB.kv_check_put(
            tenant,
            _at(items),
            n,
            buffer_address(data) if size else None,
            size,
            _address_of_writable(status),
            _address_of_writable(positions),
            keys,
            _address_of_writable(columns),
            _address_of_writable(names),
        )
    )
    if count < 0:
        return None
    return PutChecks(
        status, count, positions[:count], keys.raw[: count * STORE_KEY_LEN], columns[:count],
        names[:count],
    )  # fmt: skip


_BLOCKING = frozenset({errno.EAGAIN, errno.EWOULDBLOCK})
