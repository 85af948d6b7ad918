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
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from kvcache.errors import ConfigError

__all__ = [
    "AVAILABLE",
    "ENV",
    "LIBRARY",
    "LIBRARY_ENV",
    "Segments",
    "addresses_of",
    "recv_scatter",
    "send_gather",
    "xxh3_64_many",
    "xxh3_128_many",
]

log = logging.getLogger(__name__)

ENV = "KVCACHE_NATIVE"
LIBRARY_ENV = "KVCACHE_NATIVE_LIBRARY"
#: The built library: next to this module, unless KVCACHE_NATIVE_LIBRARY names another.
LIBRARY = Path(os.environ.get(LIBRARY_ENV) or Path(__file__).with_name("libkvfast.so"))
_ABI_VERSION = 1

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
    for name in ("kv_xxh3_64_many", "kv_xxh3_128_many"):
        fn = getattr(lib, name)
        fn.argtypes = [ptr, ptr, size, ptr]
        fn.restype = None
    for name in ("kv_recv_scatter", "kv_send_gather"):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_int, ptr, ptr, size, ptr]
        fn.restype = ctypes.c_int64
    return lib


_LIB = _load()
#: True when the native helpers are loaded (else the callers' Python fallbacks run).
AVAILABLE: bool = _LIB is not None


def addresses_of(array: npt.NDArray[Any]) -> int:
    """The address of ``array``'s first byte (it must stay alive while the address is used)."""
    return int(array.ctypes.data)


def buffer_address(buf: Any) -> int:
    """The address of a writable or read-only contiguous buffer's first byte."""
    return addresses_of(np.frombuffer(buf, np.uint8))


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


@dataclass(slots=True)
class Segments:
    """A message section as (address, length) pairs, with the progress of sending or
    receiving it, and what keeps the buffers alive.

    ``state`` is (segment, offset within it, peer closed): the native calls advance it.
    """

    addrs: U64Array
    lens: U64Array
    keepalive: Any
    state: U64Array

    @classmethod
    def of(cls, addrs: U64Array, lens: U64Array, keepalive: Any) -> Segments:
        """Segments of nonzero length (zero-length ones are dropped)."""
        addrs = np.ascontiguousarray(addrs, np.uint64).reshape(-1)
        lens = np.ascontiguousarray(lens, np.uint64).reshape(-1)
        keep = lens > 0
        if not keep.all():
            addrs, lens = addrs[keep], lens[keep]
        return cls(addrs, lens, keepalive, np.zeros(3, np.uint64))

    @property
    def nbytes(self) -> int:
        return int(self.lens.sum())

    @property
    def done(self) -> bool:
        return int(self.state[0]) >= len(self.lens)

    @property
    def closed(self) -> bool:
        return bool(self.state[2])

    def views(self) -> list[memoryview]:
        """The remaining segments as memoryviews (the Python path, e.g. under TLS); each
        view keeps the buffers alive."""
        start, offset = int(self.state[0]), int(self.state[1])
        out: list[memoryview] = []
        for j, (a, n) in enumerate(
            zip(self.addrs[start:].tolist(), self.lens[start:].tolist(), strict=True)
        ):
            skip = offset if j == 0 else 0
            buf = (ctypes.c_char * (n - skip)).from_address(a + skip)
            buf.keepalive = self.keepalive  # type: ignore[attr-defined]  # lives with the view
            out.append(memoryview(buf).cast("B"))
        return out

    def advance(self, nbytes: int) -> None:
        """Mark ``nbytes`` more as done (after a Python-path send or receive)."""
        i, off = int(self.state[0]), int(self.state[1])
        lens = self.lens
        while nbytes and i < len(lens):
            left = int(lens[i]) - off
            if nbytes < left:
                off += nbytes
                nbytes = 0
                break
            nbytes -= left
            i, off = i + 1, 0
        self.state[0], self.state[1] = i, off


def recv_scatter(fd: int, seg: Segments) -> int:
    """Receive from non-blocking socket ``fd`` into ``seg`` until it is full or the socket
    has nothing more; the bytes received (``seg.closed`` tells whether the peer closed).
    Raises ``BlockingIOError`` when nothing at all could be read, ``OSError`` on errors."""
    assert _LIB is not None
    got = int(
        _LIB.kv_recv_scatter(
            fd,
            addresses_of(seg.addrs),
            addresses_of(seg.lens),
            len(seg.lens),
            addresses_of(seg.state),
        )
    )
    if got < 0:
        raise OSError(-got, os.strerror(-got)) if -got not in _BLOCKING else BlockingIOError()
    return got


def send_gather(fd: int, seg: Segments) -> int:
    """Send ``seg`` on non-blocking socket ``fd`` until done or the socket buffer is full;
    the bytes sent. Raises ``BlockingIOError`` when nothing could be sent."""
    assert _LIB is not None
    sent = int(
        _LIB.kv_send_gather(
            fd,
            addresses_of(seg.addrs),
            addresses_of(seg.lens),
            len(seg.lens),
            addresses_of(seg.state),
        )
    )
    if sent < 0:
        raise OSError(-sent, os.strerror(-sent)) if -sent not in _BLOCKING else BlockingIOError()
    return sent


_BLOCKING = frozenset({errno.EAGAIN, errno.EWOULDBLOCK})
