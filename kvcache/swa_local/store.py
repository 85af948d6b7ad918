"""A worker's SWA states in RAM: bounded bytes, LRU under the bound, a TTL. No I/O.

:class:`SwaStore` holds the sliding-window states this worker took, for
continuations on this worker and for peers (:mod:`kvcache.swa_local.server`).
Every decision is made here, with time passed in, so tests step a clock:

- **TTL from creation** (default 180 s). A state serves one continuation
  point; a conversation's next turn takes a new state at its own end, so a
  hit rarely makes an old state more useful, and a fixed life means the
  directory records the worker registers (with the same expiry) never need
  refreshing on a hit: holder and directory forget together, with no traffic.
  Putting the same key again starts a new life.
- **``max_bytes``**: a put that would pass it evicts the least recently used
  states first (a get counts as a use). A state larger than ``max_bytes`` is
  refused. Bytes held never exceed ``max_bytes``.
- **Exact keys**: a state is served only for its :class:`~.state.StateKey`
  (namespace, prefix block key, position); a continuation from another
  position is a miss.
- O(1) get and put: one dict in LRU order and one in creation (= expiry)
  order; expired states are dropped when met and swept from the old end.

Counters: ``hits``, ``misses``, ``expiries``, ``evictions``, ``puts``,
``refused``, and the gauges ``bytes_held``, ``states``, ``peak_bytes``.

Thread-safe (one lock around O(1) work): the engine's threads put and get,
the peer server's thread gets. States are immutable ``bytes``, so a reader
may send one after it was evicted.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvcache.errors import ArgumentError
from kvcache.swa_local.state import StateKey, state_digest

__all__ = ["DEFAULT_TTL_S", "StoredState", "SwaStore"]

#: The reference deployment keeps SWA state about three minutes.
DEFAULT_TTL_S = 180.0

_COUNTERS = ("hits", "misses", "expiries", "evictions", "puts", "refused")


@dataclass(frozen=True, slots=True)
class StoredState:
    """One held state: its bytes, their digest, and when it was taken and expires."""

    data: bytes
    digest: bytes
    created: float
    expiry: float

    @property
    def nbytes(self) -> int:
        """Size of the state in bytes."""
        return len(self.data)


class SwaStore:
    """SWA states held in this worker's RAM (see the module docstring)."""

    def __init__(
        self,
        *,
        max_bytes: int,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ArgumentError(f"max_bytes must be a positive int, got {max_bytes!r}")
        if not ttl_s > 0:
            raise ArgumentError(f"ttl_s must be > 0, got {ttl_s!r}")
        self.max_bytes = max_bytes
        self.ttl_s = float(ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[StateKey, StoredState] = collections.OrderedDict()
        self._born: collections.OrderedDict[StateKey, None] = collections.OrderedDict()
        self._bytes = 0
        self._peak = 0
        self._counters = dict.fromkeys(_COUNTERS, 0)

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def bytes_held(self) -> int:
        """Bytes of the states held now."""
        return self._bytes

    def now(self) -> float:
        """The store's clock."""
        return self._clock()

    # ------------------------------------------------------------------ operations

    def put(
        self,
        key: StateKey,
        data: bytes | bytearray | memoryview,
        *,
        digest: bytes | None = None,
    ) -> StoredState | None:
        """Hold ``data`` as the state ``key`` for ``ttl_s`` from now; None when it is larger
        than ``max_bytes`` (refused). ``digest`` spares hashing when the caller has it."""
        if not isinstance(key, StateKey):
            raise ArgumentError(f"key must be a StateKey, got {type(key).__name__}")
        blob = data if isinstance(data, bytes) else _state_bytes(data)
        now = self._clock()
        with self._lock:
            if len(blob) > self.max_bytes or not blob:
                self._counters["refused"] += 1
                return None
            self._remove(key)
            self._sweep(now)
            while self._bytes + len(blob) > self.max_bytes:
                victim, _ = next(iter(self._lru.items()))
                self._remove(victim)
                self._counters["evictions"] += 1
            state = StoredState(
                blob, digest if digest is not None else state_digest(blob), now, now + self.ttl_s
            )
            self._lru[key] = state
            self._born[key] = None
            self._bytes += len(blob)
            self._peak = max(self._peak, self._bytes)
            self._counters["puts"] += 1
            return state

    def get(self, key: StateKey) -> StoredState | None:
        """The state ``key`` if held and not expired (a hit refreshes its LRU rank), else None."""
        now = self._clock()
        with self._lock:
            state = self._lru.get(key)
            if state is not None and state.expiry <= now:
                self._remove(key)
                self._counters["expiries"] += 1
                state = None
            if state is None:
                self._counters["misses"] += 1
                return None
            self._lru.move_to_end(key)
            self._counters["hits"] += 1
            return state

    def remove(self, key: StateKey) -> bool:
        """Forget ``key``; whether it was held."""
        with self._lock:
            return self._remove(key)

    def expire(self) -> int:
        """Drop every expired state now; how many."""
        with self._lock:
            return self._sweep(self._clock(), limit=None)

    def live(self) -> list[tuple[StateKey, StoredState]]:
        """Every state held and not expired, least recently used first (not counted as use)."""
        now = self._clock()
        with self._lock:
            return [(k, s) for k, s in self._lru.items() if s.expiry > now]

    def stats(self) -> dict[str, int]:
        """Counters and gauges."""
        with self._lock:
            return {
                **self._counters,
                "bytes_held": self._bytes,
                "states": len(self._lru),
                "peak_bytes": self._peak,
                "max_bytes": self.max_bytes,
            }

    # ------------------------------------------------------------------ internals

    def _remove(self, key: StateKey) -> bool:
        state = self._lru.pop(key, None)
        if state is None:
            return False
        del self._born[key]
        self._bytes -= len(state.data)
        return True

    def _sweep(self, now: float, limit: int | None = 64) -> int:
        """Drop expired states from the oldest end (creation order is expiry order)."""
        dropped = 0
        while self._born and (limit is None or dropped < limit):
            key = next(iter(self._born))
            if self._lru[key].expiry > now:
                break
            self._remove(key)
            self._counters["expiries"] += 1
            dropped += 1
        return dropped


def _state_bytes(data: object) -> bytes:
    """A copy of a bytes-like ``data``; anything else (an int, which ``bytes()`` would turn
    into that many zeros, or a str) is an ArgumentError."""
    if isinstance(data, int | str):
        raise ArgumentError(f"a state must be bytes-like, got {type(data).__name__}")
    try:
        return memoryview(data).tobytes()  # type: ignore[arg-type]
    except TypeError:
        raise ArgumentError(f"a state must be bytes-like, got {type(data).__name__}") from None
