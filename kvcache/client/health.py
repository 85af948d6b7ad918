"""Node health and latency tracking: pure bookkeeping with an injected clock.

A node that fails or times out is marked down and skipped until ``retry_s``
have passed; the next request after that is its probe. Latency samples feed
the default hedging deadline.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

__all__ = ["LatencyTracker", "NodeHealth"]

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class NodeHealth:
    """Which nodes are believed down, and until when they are skipped."""

    def __init__(self, *, retry_s: float, clock: Clock, probe_every_s: float = 1.0) -> None:
        self._retry_s = retry_s
        self._clock = clock
        self._probe_every_s = probe_every_s
        self._down_until: dict[str, float] = {}
        self._down_since: dict[str, float] = {}
        self._probed_at: dict[str, float] = {}

    def is_up(self, node: str) -> bool:
        """False while ``node`` is marked down and its retry time has not come."""
        until = self._down_until.get(node)
        return until is None or self._clock() >= until

    def mark_down(self, node: str, reason: str) -> None:
        """Skip ``node`` for the retry interval."""
        if node not in self._down_until:
            log.warning("node %s marked down: %s", node, reason)
            self._down_since[node] = self._clock()
        self._down_until[node] = self._clock() + self._retry_s

    def may_probe(self, node: str) -> bool:
        """Whether a down node may be asked early (when a call is short of nodes without it);
        at most once per ``probe_every_s``, so a dead node costs one connect wait a second."""
        now = self._clock()
        if now - self._probed_at.get(node, float("-inf")) < self._probe_every_s:
            return False
        self._probed_at[node] = now
        return True

    def mark_up(self, node: str) -> None:
        """``node`` answered: use it again."""
        self._down_since.pop(node, None)
        if self._down_until.pop(node, None) is not None:
            log.info("node %s is back", node)

    def down_for(self, node: str) -> float | None:
        """Seconds since ``node`` was first marked down, if it has not answered since;
        None if it is not marked down."""
        since = self._down_since.get(node)
        return None if since is None else self._clock() - since

    def down_nodes(self) -> list[str]:
        """Nodes currently skipped."""
        return sorted(n for n in self._down_until if not self.is_up(n))

    def skipped(self) -> set[str]:
        """:meth:`down_nodes` as a set, from one clock reading: what a call's masks need,
        in steps per node marked down (usually none), not per node of the cluster."""
        if not self._down_until:
            return set()
        now = self._clock()
        return {n for n, until in self._down_until.items() if now < until}

    def down_since(self) -> dict[str, float]:
        """Seconds each node marked down (and not heard from since) has been down, from one
        clock reading; empty while every node answers."""
        if not self._down_since:
            return {}
        now = self._clock()
        return {n: now - since for n, since in self._down_since.items()}


class LatencyTracker:
    """Recent completion times of one kind of request, for hedging deadlines."""

    def __init__(self, *, window: int = 256, floor_s: float = 0.002, ceiling_s: float = 0.25):
        self._samples: collections.deque[float] = collections.deque(maxlen=window)
        self._floor = floor_s
        self._ceiling = ceiling_s

    def record(self, seconds: float) -> None:
        """Add one observed latency."""
        self._samples.append(seconds)

    def hedge_after(self) -> float:
        """Seconds to wait before hedging: twice the recent p90, within [floor, ceiling]."""
        if len(self._samples) < 8:
            return self._ceiling / 5
        ordered = sorted(self._samples)
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        return min(self._ceiling, max(self._floor, 2.0 * p90))
