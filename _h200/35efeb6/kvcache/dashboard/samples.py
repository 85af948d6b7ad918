"""What one poll of the cluster found, flattened into counters, and a short history of it.

A :class:`NodePoll` is one node's ``/stats`` answer (or why there was none).
:func:`flat_counters` turns the monotonic parts of ``/stats`` into one flat
mapping (``"hits:get:chat"``, ``"lat:get:3"``, ``"errors:checksum"``, ...), so
rates over a window are one subtraction per key, whatever the key means.
:class:`History` keeps a cluster sample every ``spacing_s`` for ``keep_s``: the
"last minutes" the status page draws. Pure: times are passed in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcache.cluster import NodeInfo
from kvcache.dashboard.quantiles import counter_delta

__all__ = ["ClusterSample", "History", "NodePoll", "flat_counters", "window_delta"]

Counters = Mapping[str, float]


@dataclass(frozen=True, slots=True, kw_only=True)
class NodePoll:
    """One node's ``/stats`` at time ``at`` (wall seconds), or the error that stood in for it."""

    node: NodeInfo
    at: float
    stats: Mapping[str, Any] | None = None
    error: str = ""
    #: How long the node took to answer (seconds).
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the node answered with its stats."""
        return self.stats is not None


@dataclass(frozen=True, slots=True)
class ClusterSample:
    """The flat counters of every node that answered one poll."""

    at: float
    nodes: Mapping[str, Counters] = field(default_factory=dict)

    @classmethod
    def of(cls, at: float, polls: list[NodePoll]) -> ClusterSample:
        """The sample of one poll's answers."""
        return cls(at, {p.node.id: flat_counters(p.stats) for p in polls if p.stats is not None})


def _numbers(prefix: str, table: object) -> Iterator[tuple[str, float]]:
    if isinstance(table, Mapping):
        for key, value in table.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                yield f"{prefix}:{key}", float(value)


def flat_counters(stats: Mapping[str, Any]) -> dict[str, float]:
    """The counters of one ``/stats`` answer as ``{"kind:...": value}``; malformed parts
    are left out (a node of another version must not break the page)."""
    out: dict[str, float] = {}
    for name in ("requests", "bytes_in", "bytes_out", "errors", "gc"):
        out.update(_numbers(name, stats.get(name)))
    for name in ("hits", "misses"):
        table = stats.get(name)
        if isinstance(table, Mapping):
            for kind, per_class in table.items():
                out.update(_numbers(f"{name}:{kind}", per_class))
    items = stats.get("items")
    if isinstance(items, Mapping):
        for op, per_status in items.items():
            out.update(_numbers(f"items:{op}", per_status))
    latency = stats.get("latency")
    ops = latency.get("ops") if isinstance(latency, Mapping) else None
    if isinstance(ops, Mapping):
        for op, hist in ops.items():
            if not isinstance(hist, Mapping):
                continue
            buckets = hist.get("buckets")
            if isinstance(buckets, list):
                out.update(_numbers(f"lat:{op}", dict(enumerate(buckets))))
            out.update(
                _numbers(f"latn:{op}", {"count": hist.get("count"), "sum": hist.get("sum_s")})
            )
    return out


def window_delta(old: ClusterSample | None, new: ClusterSample) -> dict[str, float]:
    """Growth of every counter from ``old`` to ``new``, summed over the nodes present in
    both (a node's restart counts from zero). ``old`` None: growth since each node started."""
    out: dict[str, float] = {}
    for node, counters in new.nodes.items():
        if old is None:
            before: Counters = {}
        elif node in old.nodes:
            before = old.nodes[node]
        else:
            continue
        for key, value in counters.items():
            out[key] = out.get(key, 0.0) + counter_delta(before.get(key, 0.0), value)
    return out


class History:
    """Cluster samples at least ``spacing_s`` apart, for the last ``keep_s`` seconds."""

    def __init__(self, *, spacing_s: float = 10.0, keep_s: float = 600.0) -> None:
        if spacing_s <= 0 or keep_s < spacing_s:
            raise ValueError(f"need 0 < spacing_s <= keep_s, got {spacing_s}, {keep_s}")
        self.spacing_s = spacing_s
        self.keep_s = keep_s
        self._samples: deque[ClusterSample] = deque()

    def add(self, sample: ClusterSample) -> bool:
        """Keep ``sample`` if the last kept one is ``spacing_s`` older; drop expired ones."""
        while self._samples and self._samples[0].at < sample.at - self.keep_s:
            self._samples.popleft()
        if self._samples and sample.at - self._samples[-1].at < self.spacing_s:
            return False
        self._samples.append(sample)
        return True

    def samples(self) -> list[ClusterSample]:
        """The kept samples, oldest first."""
        return list(self._samples)

    def before(self, at: float, window_s: float) -> ClusterSample | None:
        """The newest kept sample at least ``window_s`` before ``at``; else the oldest one
        older than ``at`` (a shorter window); None when there is none."""
        older = [s for s in self._samples if s.at < at]
        if not older:
            return None
        far = [s for s in older if s.at <= at - window_s]
        return far[-1] if far else older[0]
