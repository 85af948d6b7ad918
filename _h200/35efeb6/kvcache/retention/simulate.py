"""What a retention policy would do to a workload: hit rate and capacity, without a cluster.

Replays a request trace against an idealised cluster that keeps every block
until its class's TTL runs out (sliding on hits, the longer expiry winning when
classes share a block) and has no capacity limit. The hit rate is the tokens of
each request's leading run of live blocks over all input tokens; capacity is
the number of live blocks (and their bytes with the 10 + 2 overhead) seen just
before each request. Both are also kept per traffic class: a request's hit
counts for its own class, a live block for the class whose TTL holds it (the
one that set its current expiry). Pure: time is the trace's own.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvcache.retention.policy import RetentionPolicy
from kvcache.workload import TRACE_BLOCK_TOKENS, Request

__all__ = ["ClassResult", "SimulationResult", "simulate"]


@dataclass(frozen=True, slots=True)
class ClassResult:
    """One traffic class's share of a simulation: its requests' hits, the blocks it holds."""

    input_tokens: int
    hit_tokens: int
    peak_blocks: int
    mean_blocks: float

    @property
    def hit_rate(self) -> float:
        """Fraction of this class's input tokens served from the cache."""
        return self.hit_tokens / max(1, self.input_tokens)

    def stored_bytes(
        self, block_bytes: int, *, k: int = 10, m: int = 2, peak: bool = True
    ) -> float:
        """Bytes of the blocks this class holds, with the k + m overhead."""
        blocks = self.peak_blocks if peak else self.mean_blocks
        return blocks * block_bytes * (k + m) / k


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """Outcome of replaying a trace under one policy."""

    requests: int
    input_tokens: int
    hit_tokens: int
    peak_blocks: int
    mean_blocks: float
    expirations: int
    #: The same figures per traffic class.
    classes: Mapping[str, ClassResult] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Fraction of input tokens served from the cache."""
        return self.hit_tokens / max(1, self.input_tokens)

    def stored_bytes(
        self, block_bytes: int, *, k: int = 10, m: int = 2, peak: bool = True
    ) -> float:
        """Bytes on the storage nodes (payload × (k + m) / k) at the peak or on average."""
        blocks = self.peak_blocks if peak else self.mean_blocks
        return blocks * block_bytes * (k + m) / k


def simulate(requests: Iterable[Request], policy: RetentionPolicy) -> SimulationResult:
    """Replay ``requests`` (in arrival order) under ``policy``."""
    expiry: dict[int, float] = {}
    owner: dict[int, str] = {}  # the class whose TTL set each live block's expiry
    heap: list[tuple[float, int]] = []
    requests_seen = input_tokens = hit_tokens = peak = expirations = 0
    live_sum = 0
    live_by: dict[str, int] = {}
    peak_by: dict[str, int] = {}
    sum_by: dict[str, int] = {}
    tokens_by: dict[str, int] = {}
    hits_by: dict[str, int] = {}
    for req in requests:
        now = req.timestamp_ms / 1000.0
        while heap and heap[0][0] <= now:
            when, block = heapq.heappop(heap)
            if expiry.get(block) == when:
                del expiry[block]
                live_by[owner.pop(block)] -= 1
                expirations += 1
        live = len(expiry)
        peak = max(peak, live)
        live_sum += live
        for name, n in live_by.items():
            peak_by[name] = max(peak_by.get(name, 0), n)
            sum_by[name] = sum_by.get(name, 0) + n
        full = req.hash_ids[: req.full_blocks]
        hit = 0
        for block in full:
            if block not in expiry:
                break
            hit += 1
        cls = req.traffic_class
        ttl = policy.ttl_s(cls)
        for block in full:  # hits slide, misses are written: every full block lives on
            candidate = now + ttl
            if candidate > expiry.get(block, float("-inf")):
                if block in owner:
                    live_by[owner[block]] -= 1
                expiry[block] = candidate
                owner[block] = cls
                live_by[cls] = live_by.get(cls, 0) + 1
                heapq.heappush(heap, (candidate, block))
        requests_seen += 1
        input_tokens += req.input_length
        served = min(hit * TRACE_BLOCK_TOKENS, req.input_length)
        hit_tokens += served
        tokens_by[cls] = tokens_by.get(cls, 0) + req.input_length
        hits_by[cls] = hits_by.get(cls, 0) + served
    n = max(1, requests_seen)
    return SimulationResult(
        requests=requests_seen,
        input_tokens=input_tokens,
        hit_tokens=hit_tokens,
        peak_blocks=peak,
        mean_blocks=live_sum / n,
        expirations=expirations,
        classes={
            name: ClassResult(
                input_tokens=tokens_by.get(name, 0),
                hit_tokens=hits_by.get(name, 0),
                peak_blocks=peak_by.get(name, 0),
                mean_blocks=sum_by.get(name, 0) / n,
            )
            for name in sorted(set(tokens_by) | set(live_by))
        },
    )
