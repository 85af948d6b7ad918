"""Fetch or recompute, and prefix lookups in flight: the scheduler half's timing decisions.

:class:`FetchPlanner` predicts whether loading a hit beats recomputing it, from running
estimates of the load bandwidth and the engine's prefill rate; :class:`PendingMatches`
turns a slow lookup into vLLM's "ask again next step" and, past a deadline, a miss. Pure:
the clock and the short wait for a fresh lookup are injected, so tests step time instead
of sleeping.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from concurrent.futures import Future

__all__ = ["MIN_PREFILL_STEP_TOKENS", "FetchPlanner", "PendingMatches", "wait_for"]


def wait_for(future: Future[int], seconds: float) -> None:
    """Wait up to ``seconds`` for ``future`` (the default wait of :class:`PendingMatches`)."""
    with contextlib.suppress(TimeoutError):
        future.exception(timeout=seconds)


#: Steps computing fewer tokens than this are decode-sized and say little about prefill speed.
MIN_PREFILL_STEP_TOKENS = 256


class FetchPlanner:
    """Fetch or recompute: is loading a hit predicted to beat recomputing it?

    Load time is modelled as ``overhead_s + bytes / bandwidth`` and recompute
    time as ``tokens / prefill rate``, each rate a running (exponentially
    weighted) estimate: the bandwidth from this connector's finished loads,
    the prefill rate from the tokens the engine computes per step. A hit is
    offered when ``load time * margin <= recompute time``. Both times grow
    linearly with the hit, so the answer is all of it or nothing: the fixed
    overhead only matters for short hits. Until both rates are known (or
    given as starting estimates), every hit is offered.
    """

    def __init__(
        self,
        *,
        margin: float,
        load_gbps: float | None = None,
        prefill_tokens_per_s: float | None = None,
        overhead_s: float = 0.002,
        weight: float = 0.2,
        min_step_tokens: int = MIN_PREFILL_STEP_TOKENS,
    ) -> None:
        self.margin = margin
        self.load_gbps = load_gbps
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.overhead_s = overhead_s
        self._weight = weight
        self._min_step_tokens = min_step_tokens
        self.fetched = 0
        self.recomputed = 0

    def record_load(self, nbytes: int, seconds: float) -> None:
        """A finished load of ``nbytes`` took ``seconds`` (match to data in place)."""
        if nbytes <= 0 or seconds <= 0:
            return
        gbps = nbytes / seconds / 1e9
        self.load_gbps = _ewma(self.load_gbps, gbps, self._weight)

    def record_step(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` in a step of ``seconds``; decode-sized steps
        (fewer than ``min_step_tokens``) say little about prefill and are skipped."""
        if tokens < self._min_step_tokens or seconds <= 0:
            return
        self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, tokens / seconds, self._weight)

    def predicted(self, tokens: int, bytes_per_token: int) -> tuple[float, float] | None:
        """(load seconds, recompute seconds) of a ``tokens`` hit, or None when unknown."""
        if not self.load_gbps or not self.prefill_tokens_per_s:
            return None
        load_s = self.overhead_s + tokens * bytes_per_token / (self.load_gbps * 1e9)
        return load_s, tokens / self.prefill_tokens_per_s

    def fetch(self, tokens: int, bytes_per_token: int) -> bool:
        """Whether to offer a hit of ``tokens`` (counted in ``fetched`` / ``recomputed``)."""
        times = self.predicted(tokens, bytes_per_token)
        ok = times is None or self.margin == 0 or times[0] * self.margin <= times[1]
        if ok:
            self.fetched += 1
        else:
            self.recomputed += 1
        return ok


def _ewma(current: float | None, sample: float, weight: float) -> float:
    if current is None or not math.isfinite(current):
        return sample
    return (1 - weight) * current + weight * sample


class PendingMatches:
    """Prefix lookups in flight, one per waiting request: vLLM's "ask again" hook.

    ``poll`` starts a lookup the first time a request is asked about and waits
    up to ``wait_s`` for it. If it is not back, the answer is ``None`` (vLLM
    skips the request this step and asks again); once ``deadline_s`` has
    passed since the start the request counts as a miss, so a slow or dead
    store delays a request by at most that long and never stalls the engine.
    """

    def __init__(
        self,
        *,
        wait_s: float,
        deadline_s: float,
        clock: Callable[[], float],
        wait: Callable[[Future[int], float], None] = wait_for,
    ) -> None:
        self.wait_s = wait_s
        self.deadline_s = deadline_s
        self._clock = clock
        self._wait = wait
        self._inflight: dict[str, tuple[Future[int], float]] = {}
        self.errors = 0
        self.timeouts = 0
        self.deferred = 0

    def __len__(self) -> int:
        return len(self._inflight)

    def poll(self, req_id: str, start: Callable[[], Future[int]]) -> int | None:
        """Hit blocks for ``req_id``, or None for "not known yet, ask again"."""
        entry = self._inflight.get(req_id)
        fresh = entry is None
        if entry is None:
            entry = self._inflight[req_id] = (start(), self._clock())
        future, started = entry
        if fresh and self.wait_s > 0 and not future.done():
            self._wait(future, self.wait_s)
        if future.done():
            try:
                return future.result()
            except Exception:  # the lookup failed: a miss, never a stalled engine
                self.errors += 1
                self._inflight[req_id] = (_done(0), started)
                return 0
        if self._clock() - started >= self.deadline_s:
            self.timeouts += 1
            future.cancel()
            self._inflight[req_id] = (_done(0), started)
            return 0
        self.deferred += 1
        return None

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s lookup (it was scheduled, finished or aborted)."""
        entry = self._inflight.pop(req_id, None)
        if entry is not None:
            entry[0].cancel()


def _done(value: int) -> Future[int]:
    fut: Future[int] = Future()
    fut.set_result(value)
    return fut
