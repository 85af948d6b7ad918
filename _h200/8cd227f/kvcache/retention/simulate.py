"""What a retention policy would do to a workload: hit rate and capacity, without a cluster.

Replays a request trace against an idealised cluster that keeps every block
until its class's TTL runs out (sliding on hits, the longer expiry winning when
classes share a block) and has no capacity limit. The hit rate is the tokens of
each request's leading run of live blocks over all input tokens; capacity is
the number of live blocks (and their bytes with the 10 + 2 overhead) seen just
before each request. Pure: time is the trace's own.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

from kvcache.retention.policy import RetentionPolicy
from kvcache.workload import TRACE_BLOCK_TOKENS, Request

__all__ = ["SimulationResult", "simulate"]


@dataclass(frozen=True, slots=True)
class SimulationResult:
    """Outcome of replaying a trace under one policy."""

    requests: int
    input_tokens: int
    hit_tokens: int
    peak_blocks: int
    mean_blocks: float
    expirations: int

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
    heap: list[tuple[float, int]] = []
    requests_seen = input_tokens = hit_tokens = peak = expirations = 0
    live_sum = 0
    for req in requests:
        now = req.timestamp_ms / 1000.0
        while heap and heap[0][0] <= now:
            when, block = heapq.heappop(heap)
            if expiry.get(block) == when:
                del expiry[block]
                expirations += 1
        live = len(expiry)
        peak = max(peak, live)
        live_sum += live
        full = req.hash_ids[: req.full_blocks]
        hit = 0
        for block in full:
            if block not in expiry:
                break
            hit += 1
        ttl = policy.ttl_s(req.traffic_class)
        for block in full:  # hits slide, misses are written: every full block lives on
            candidate = now + ttl
            if candidate > expiry.get(block, float("-inf")):
                expiry[block] = candidate
                heapq.heappush(heap, (candidate, block))
        requests_seen += 1
        input_tokens += req.input_length
        hit_tokens += min(hit * TRACE_BLOCK_TOKENS, req.input_length)
    return SimulationResult(
        requests=requests_seen,
        input_tokens=input_tokens,
        hit_tokens=hit_tokens,
        peak_blocks=peak,
        mean_blocks=live_sum / max(1, requests_seen),
        expirations=expirations,
    )
