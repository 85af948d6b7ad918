"""The daemon's native data plane: the socket loop's selector, and the lookups it answers in C.

Why: in a 12-daemon loopback cluster on the 2-core VM, a daemon spent about 740 µs of CPU
per 59-shard GET request, of which the kernel's work (receive the request, ``sendfile`` the
records) was a fifth; the rest was Python: the selector, reading and parsing the request, the
handler, the store's lookup, the reply's sections and the sends (``perf``: 43 % of all
samples in the daemons' user space against 11 % in their kernel time; per-phase thread
time in ``docs/benchmarks.md``, eighth pass of issue 17). With 13 processes taking turns on
2 cores every one of those Python steps runs with cold caches. The two requests that are
plain reads of the index, the quiet GET (every asked shard a live hit of the wanted stripe,
no expiry slide due, or a plain miss) and HAS, need none of it. Misses count: a load whose
holder is down asks the node that stands in for it, which usually lacks the shard; handed
to Python, those GETs cost the 10 surviving daemons of a 12-node cluster 1.09 CPU-s per GB
loaded, against 0.21 healthy (``bench/profile_load.py --kill 2``).

So ``libkvserve.so`` (``kvcache/native/kvserve.c``) runs the loop's ``epoll``: every
descriptor of the loop is registered with it. The ones the Python loop owns (listener, wake
pipe, handshakes, TLS connections, a connection whose request Python answers) only have
their readiness reported back, through :class:`PlaneSelector`, which the loop uses as its
selector. An authenticated plain-TCP connection that is idle is *adopted*
(:meth:`NativePlane.adopt`): its requests are read in C, a quiet GET or a HAS is answered
there (index rows through a read-only LMDB handle of the engine's own, records with
``sendfile``), and any other request is *handed back* whole: the connection is the Python
loop's again, with the bytes the engine had buffered, and Python answers it as before. The
engine decides nothing Python would decide otherwise; it skips Python where the answer is a
read. Its counters (requests, bytes, latency, hits and misses per class) are folded into the daemon's
:class:`~kvcache.server.metrics.Metrics`.

The engine is used where it applies: native helpers loaded (``KVCACHE_NATIVE`` not 0),
``native_plane`` on in the config, and a daemon clock that is wall time plus an offset (a
test's frozen clock keeps the Python path, which reads that clock for every request).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import selectors
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvcache import native
from kvcache.errors import ConfigError, KVCacheError
from kvcache.server.metrics import LATENCY_BUCKETS_S

__all__ = [
    "AVAILABLE",
    "LIBRARY",
    "NativeEvent",
    "NativePlane",
    "PlaneLimits",
    "PlaneSelector",
    "class_field",
]

log = logging.getLogger(__name__)

LIBRARY_ENV = "KVCACHE_SERVE_LIBRARY"
LIBRARY = Path(os.environ.get(LIBRARY_ENV) or Path(native.__file__).with_name("libkvserve.so"))
_ABI_VERSION = 4

#: What a step reports for a descriptor (kvserve.c).
EV_FOREIGN, EV_HANDOFF, EV_CLOSED = 1, 2, 3
#: Why the engine closed a native connection: the Python loop's reason text and the error
#: kind it counts (None: not an error).
CLOSE_REASONS: Mapping[int, tuple[str, str | None]] = {
    1: ("closed by peer", None),
    2: ("receive failed", None),
    3: ("send failed", None),
    4: ("send timeout", "send_timeout"),
    5: ("request timeout", "request_timeout"),
    6: ("slow request", "slow_request"),
    7: ("out of memory", "internal"),
    8: ("closed by peer in the middle of a request", "truncated"),
}
#: Why a request went to Python (the engine's ``handed`` counters), by index.
HANDOFF_REASONS = ("op", "class", "disabled", "get_not_quiet", "has", "segment")
MAX_CLASSES = 256
_EPOLLIN, _EPOLLOUT = 0x001, 0x004
#: kvs_watch: the loop's wake pipe, handled before any native request of the same wake-up.
_PRIORITY = 0x40000000
#: kvs_step's flags.
_ANSWER, _PENDING = 1, 2
_NBUCKETS = len(LATENCY_BUCKETS_S) + 1

_OPSTATS = np.dtype(
    [
        ("requests", "<u8"),
        ("items_ok", "<u8"),
        ("items_missed", "<u8"),
        ("bytes_in", "<u8"),
        ("bytes_out", "<u8"),
        ("buckets", "<u8", (_NBUCKETS,)),
        ("latency_sum", "<f8"),
    ]
)
#: kvserve.c's kvs_stats.
STATS_DTYPE = np.dtype(
    [
        ("seq", "<u8"),
        ("handed", "<u8", (len(HANDOFF_REASONS),)),
        ("closed_timeouts", "<u8"),
        ("has", _OPSTATS),
        ("get", _OPSTATS, (MAX_CLASSES,)),
    ]
)
_EVENT_DTYPE = np.dtype([("fd", "<i4"), ("kind", "<i4"), ("aux", "<u4"), ("pad", "<u4")])


class NativeEvent(NamedTuple):
    """Something a step leaves to the Python loop: a hand-off or a close (``aux``: why)."""

    fd: int
    kind: int
    aux: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PlaneLimits:
    """The bounds the engine applies to its connections: the daemon's own."""

    max_items: int
    max_reply_bytes: int
    send_timeout_s: float
    request_timeout_s: float
    request_grace_s: float
    min_request_rate: float


def _load() -> Any:
    mode = os.environ.get(native.ENV, "auto").strip().lower()
    if mode in ("0", "off", "no", "false"):
        return None
    try:
        lib = ctypes.CDLL(str(LIBRARY))
        if lib.kvs_abi_version() != _ABI_VERSION:
            raise OSError(f"{LIBRARY} is ABI {lib.kvs_abi_version()}, expected {_ABI_VERSION}")
    except OSError as exc:
        if mode == "require":
            raise ConfigError(
                f"{native.ENV}=require but the daemon's data plane did not load ({exc}); "
                "build it with `bash scripts/build-native.sh`"
            ) from exc
        log.info("native data plane not loaded (%s): the daemon answers every request in "
                 "Python", exc)  # fmt: skip
        return None
    ptr, size, i32, u32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint32
    dbl, u64 = ctypes.c_double, ctypes.c_uint64
    lib.kvs_new.argtypes = [ctypes.c_char_p, u64, ctypes.c_char_p, u32, u64, dbl, dbl, dbl, dbl,
                            ptr, ctypes.c_char_p, size]  # fmt: skip
    lib.kvs_new.restype = ptr
    lib.kvs_free.argtypes = [ptr]
    lib.kvs_free.restype = None
    lib.kvs_watch.argtypes = [ptr, i32, u32]
    lib.kvs_watch.restype = i32
    lib.kvs_adopt.argtypes = [ptr, i32, ptr, ptr, size, dbl, u64]
    lib.kvs_adopt.restype = i32
    lib.kvs_take.argtypes = [
        ptr,
        i32,
        ctypes.POINTER(ptr),
        ctypes.POINTER(dbl),
        ctypes.POINTER(u64),
    ]
    lib.kvs_take.restype = size
    lib.kvs_forget.argtypes = [ptr, i32]
    lib.kvs_forget.restype = None
    lib.kvs_is_native.argtypes = [ptr, i32]
    lib.kvs_is_native.restype = i32
    lib.kvs_step.argtypes = [ptr, i32, dbl, i32]
    lib.kvs_step.restype = ctypes.c_long
    lib.kvs_events.argtypes = [ptr]
    lib.kvs_events.restype = ptr
    lib.kvs_class_clear.argtypes = [ptr]
    lib.kvs_class_clear.restype = None
    lib.kvs_class_set.argtypes = [ptr, ptr, ctypes.c_int64, i32]
    lib.kvs_class_set.restype = i32
    lib.kvs_forget_segment.argtypes = [ptr, u32]
    lib.kvs_forget_segment.restype = i32
    lib.kvs_stats_read.argtypes = [ptr, ptr]
    lib.kvs_stats_read.restype = None
    lib.kvs_error.argtypes = [ptr]
    lib.kvs_error.restype = ctypes.c_char_p
    if lib.kvs_stats_size() != STATS_DTYPE.itemsize or lib.kvs_event_size() != 16:
        raise ConfigError(f"{LIBRARY}: its structures do not match this module; rebuild it")
    return lib


_LIB = _load()
#: True when the daemon's native data plane is loaded.
AVAILABLE: bool = _LIB is not None


def class_field(name: str) -> bytes:
    """The 16-byte traffic-class field of a wire header naming ``name`` ("" for none), as
    :func:`kvcache.wire.pack_header` writes it."""
    if not name:
        return bytes(16)
    raw = name.encode("ascii")
    return bytes([len(raw)]) + raw.ljust(15, b"\x00")


class NativePlane:
    """One engine (``kvs_engine``) over one daemon's index and segment files.

    Owned by the loop thread; only :meth:`stats` may be called from other threads.
    """

    def __init__(
        self, *, lmdb_dir: Path, map_size: int, segment_dir: Path, limits: PlaneLimits
    ) -> None:
        if _LIB is None:
            raise KVCacheError("the native data plane is not loaded")
        error = ctypes.create_string_buffer(256)
        bounds = (ctypes.c_double * len(LATENCY_BUCKETS_S))(*LATENCY_BUCKETS_S)
        handle = _LIB.kvs_new(
            str(lmdb_dir).encode(),
            map_size,
            str(segment_dir).encode(),
            limits.max_items,
            limits.max_reply_bytes,
            limits.send_timeout_s,
            limits.request_timeout_s,
            limits.request_grace_s,
            float(limits.min_request_rate),
            ctypes.cast(bounds, ctypes.c_void_p),
            error,
            len(error),
        )
        if not handle:
            raise KVCacheError(f"native data plane: {error.value.decode(errors='replace')}")
        self._handle: int | None = handle
        self._closed_stats: npt.NDArray[np.void] | None = None
        #: Held by stats() (any thread) and close() (the loop's): never a freed engine.
        self._lock = threading.Lock()

    def _h(self) -> int:
        if self._handle is None:
            raise KVCacheError("native data plane closed")
        return self._handle

    def watch(self, fd: int, read: bool, write: bool, *, priority: bool = False) -> None:
        """The Python loop waits for ``fd`` to be readable / writable (neither: no longer);
        ``priority``: its readiness comes before any native request of the same wake-up (the
        loop's wake pipe: a clock or policy change applies to every request after it)."""
        events = (_EPOLLIN if read else 0) | (_EPOLLOUT if write else 0)
        if events and priority:
            events |= _PRIORITY
        rc = _LIB.kvs_watch(self._h(), fd, events)
        if rc < 0:
            raise OSError(-rc, f"native data plane: cannot watch fd {fd}: {os.strerror(-rc)}")

    def adopt(
        self,
        fd: int,
        tenant: bytes,
        prefix: bytes | bytearray | memoryview,
        *,
        started: float = 0.0,
        received: int = 0,
    ) -> bool:
        """Hand connection ``fd`` (authenticated ``tenant``, idle) to the engine, with the bytes
        already received past its last request (a request that began arriving at
        ``started``, monotonic, with ``received`` bytes so far); False if the engine cannot
        take it (the connection is then the Python loop's, as it was)."""
        buf = (ctypes.c_char * len(prefix)).from_buffer_copy(prefix) if len(prefix) else None
        rc = _LIB.kvs_adopt(self._h(), fd, tenant, buf, len(prefix), started, received)
        if rc < 0:
            log.warning("native data plane did not adopt fd %d: %s", fd, os.strerror(-rc))
            return False
        return True

    def take(self, fd: int) -> tuple[bytes, float, int]:
        """After a hand-off of ``fd``: the bytes the engine had received (the request Python
        answers comes first), when that request began arriving (monotonic) and its bytes
        so far. The connection is the Python loop's again, unwatched."""
        data = ctypes.c_void_p()
        started = ctypes.c_double()
        received = ctypes.c_uint64()
        n = _LIB.kvs_take(
            self._h(), fd, ctypes.byref(data), ctypes.byref(started), ctypes.byref(received)
        )
        raw = ctypes.string_at(data.value, n) if n and data.value else b""
        return raw, started.value, received.value

    def forget(self, fd: int) -> None:
        """The Python loop closes ``fd``: the engine drops whatever it holds of it."""
        if self._handle is not None:
            _LIB.kvs_forget(self._handle, fd)

    def is_native(self, fd: int) -> bool:
        """Whether the engine owns connection ``fd`` now."""
        return bool(_LIB.kvs_is_native(self._h(), fd))

    def step(
        self, timeout_s: float | None, *, offset_s: float, answer: bool, pending: bool
    ) -> list[tuple[int, int, int]]:
        """Wait up to ``timeout_s`` (None: until something happens), answering what native
        connections ask; (fd, kind, aux) of each event for the Python loop. ``answer``: the
        engine may answer requests now (else it hands each one over); ``pending``: hits
        wait to be written (a HAS meeting a row past its expiry goes to Python)."""
        timeout_ms = -1 if timeout_s is None else max(0, int(timeout_s * 1000 + 0.999))
        flags = (_ANSWER if answer else 0) | (_PENDING if pending else 0)
        n = _LIB.kvs_step(self._h(), timeout_ms, offset_s, flags)
        if n < 0:
            raise OSError(_LIB.kvs_error(self._h()).decode(errors="replace"))
        if not n:
            return []
        at = _LIB.kvs_events(self._h())
        raw = np.frombuffer((ctypes.c_char * (16 * n)).from_address(at), _EVENT_DTYPE)
        return list(zip(raw["fd"].tolist(), raw["kind"].tolist(), raw["aux"].tolist(),
                        strict=True))  # fmt: skip

    def clear_classes(self) -> None:
        """Forget every class given (the policy changed)."""
        _LIB.kvs_class_clear(self._h())

    def set_class(self, field: bytes, delta_ms: int, slot: int) -> bool:
        """Answer GETs whose header's class field is ``field``: a hit is quiet when its expiry
        lies past now + ``delta_ms``; counted under ``slot``. False when the table is full."""
        if len(field) != 16:
            raise ValueError("a class field is 16 bytes")
        return bool(_LIB.kvs_class_set(self._h(), field, delta_ms, slot) == 0)

    def forget_segment(self, seg: int) -> bool:
        """The store dropped segment ``seg``; True while a reply in flight still sends from it
        (then its file must not be reused)."""
        if self._handle is None:
            return False
        return bool(_LIB.kvs_forget_segment(self._handle, seg))

    def stats(self) -> npt.NDArray[np.void]:
        """A consistent copy of the engine's cumulative counters (any thread)."""
        with self._lock:
            if self._handle is None:
                assert self._closed_stats is not None
                return self._closed_stats.copy()
            out = np.zeros(1, STATS_DTYPE)
            _LIB.kvs_stats_read(self._handle, native.addresses_of(out))
            return out

    def close(self) -> None:
        """Free the engine (idempotent); its counters stay readable."""
        with self._lock:
            if self._handle is None:
                return
            out = np.zeros(1, STATS_DTYPE)
            _LIB.kvs_stats_read(self._handle, native.addresses_of(out))
            self._closed_stats = out
            handle, self._handle = self._handle, None
            _LIB.kvs_free(handle)


class PlaneSelector(selectors.BaseSelector):
    """A selector over :class:`NativePlane`: what the socket loop registers is watched by the
    engine's epoll; :meth:`select` runs one engine step and returns the ready keys, and keeps
    the step's native events (hand-offs, closes) for :meth:`native_events`.

    ``settings`` is asked before each step for (clock offset, may answer, hits pending).
    """

    def __init__(
        self, plane: NativePlane, settings: Callable[[], tuple[float, bool, bool]]
    ) -> None:
        self.plane = plane
        self._settings = settings
        self._keys: dict[int, selectors.SelectorKey] = {}
        self._native: list[NativeEvent] = []
        self._priority: int | None = None

    def prioritize(self, fileobj: Any) -> None:
        """``fileobj`` (the loop's wake pipe) comes before native requests when it is ready
        (register it after this)."""
        self._priority = _fileno(fileobj)

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = _fileno(fileobj)
        if fd in self._keys:
            raise KeyError(f"{fileobj!r} (fd {fd}) is already registered")
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._watch(fd, events)
        self._keys[fd] = key
        return key

    def _watch(self, fd: int, events: int) -> None:
        self.plane.watch(
            fd,
            bool(events & selectors.EVENT_READ),
            bool(events & selectors.EVENT_WRITE),
            priority=fd == self._priority,
        )

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = _fileno(fileobj)
        key = self._keys.pop(fd)
        with contextlib.suppress(OSError):  # closed already: the kernel dropped it
            self.plane.watch(fd, False, False)
        return key

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = _fileno(fileobj)
        old = self._keys[fd]
        if events != old.events:
            self._watch(fd, events)
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        offset, answer, pending = self._settings()
        ready: list[tuple[selectors.SelectorKey, int]] = []
        stepped = self.plane.step(timeout, offset_s=offset, answer=answer, pending=pending)
        for fd, kind, aux in stepped:
            if kind != EV_FOREIGN:
                self._native.append(NativeEvent(fd, kind, aux))
                continue
            key = self._keys.get(fd)
            if key is None:
                continue
            events = 0
            if aux & ~_EPOLLIN:
                events |= selectors.EVENT_WRITE
            if aux & ~_EPOLLOUT:
                events |= selectors.EVENT_READ
            if events & key.events:
                ready.append((key, events & key.events))
        return ready

    def forget_key(self, fd: int) -> selectors.SelectorKey | None:
        """Drop ``fd``'s key without touching its epoll registration (the engine adopts the
        connection and takes the registration over); the key it had, if any."""
        return self._keys.pop(fd, None)

    def restore_key(self, key: selectors.SelectorKey) -> None:
        """Put back a key :meth:`forget_key` dropped (the engine did not adopt it)."""
        self._keys[key.fd] = key

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys[_fileno(fileobj)]

    def native_events(self) -> list[NativeEvent]:
        """The hand-offs and closes of native connections since the last call."""
        out, self._native = self._native, []
        return out

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._keys

    def close(self) -> None:
        self._keys.clear()
        self.plane.close()


def _fileno(fileobj: Any) -> int:
    fd = fileobj if isinstance(fileobj, int) else int(fileobj.fileno())
    if fd < 0:
        raise ValueError(f"invalid file descriptor {fd}")
    return fd
