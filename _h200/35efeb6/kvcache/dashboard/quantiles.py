"""Percentiles from bucketed latency histograms, and counter deltas across daemon restarts.

The daemons count request latencies in fixed buckets (``/stats`` → ``latency``,
upper bounds in seconds, the last bucket open-ended), like a Prometheus
histogram. Histograms of several daemons add bucket by bucket; the histogram of
a time window is the difference of two snapshots. A percentile is then
estimated as Prometheus' ``histogram_quantile`` does: find the bucket holding
the rank and interpolate linearly inside it, so the estimate always lies within
the bucket that holds the true value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["add_buckets", "counter_delta", "histogram_quantile", "subtract_buckets"]


def counter_delta(old: float, new: float) -> float:
    """How much a counter grew from ``old`` to ``new``; a drop means the daemon restarted
    (counting from zero again), so the growth is ``new`` itself."""
    return new - old if new >= old else new


def add_buckets(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """Bucket-wise sum of two histograms with the same bounds."""
    if len(a) != len(b):
        raise ValueError(f"histograms differ in bucket count: {len(a)} != {len(b)}")
    return [x + y for x, y in zip(a, b, strict=True)]


def subtract_buckets(new: Sequence[int], old: Sequence[int]) -> list[int]:
    """The histogram of what was observed between two snapshots of one daemon
    (``new`` alone when any bucket went down: the daemon restarted)."""
    if len(new) != len(old):
        raise ValueError(f"histograms differ in bucket count: {len(new)} != {len(old)}")
    if any(n < o for n, o in zip(new, old, strict=True)):
        return list(new)
    return [n - o for n, o in zip(new, old, strict=True)]


def histogram_quantile(q: float, bounds: Sequence[float], buckets: Sequence[int]) -> float | None:
    """The ``q``-quantile (0..1) of a histogram, or None if it is empty.

    ``buckets[i]`` counts values in ``(bounds[i-1], bounds[i]]`` (from 0 for
    ``i = 0``); ``buckets[-1]``, one longer than ``bounds``, counts values past
    the last bound, whose estimate is that bound (as Prometheus reports it).
    """
    if not 0.0 <= q <= 1.0 or math.isnan(q):
        raise ValueError(f"quantile must be within 0..1, got {q}")
    if len(buckets) != len(bounds) + 1:
        raise ValueError(f"{len(bounds)} bounds need {len(bounds) + 1} buckets, got {len(buckets)}")
    total = sum(buckets)
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(buckets):
        if count and seen + count >= rank:
            if i == len(bounds):
                return float(bounds[-1])
            lower = 0.0 if i == 0 else float(bounds[i - 1])
            upper = float(bounds[i])
            return lower + (upper - lower) * max(0.0, rank - seen) / count
        seen += count
    return float(bounds[-1])  # pragma: no cover - rank <= total always lands in a bucket
