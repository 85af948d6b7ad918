"""Capacity planning: how much disk a trace needs so that no class is evicted before its TTL.

Pure, on the simulator (:mod:`kvcache.retention.simulate`, the daemons' own rules):

1. replay the trace without a capacity limit and take the most live blocks
   just after any request's writes;
2. the planned capacity is the smallest that keeps that under the daemons'
   high watermark, confirmed by replaying at it (0 evictions before TTL, or
   the capacity is raised until it is);
3. replay again at fractions of it (50 % and 75 % by default) and report the
   hit rate lost and the blocks evicted before their TTL, per class.

Bytes: a block is ``k + m`` shard records of ``HEADER_BYTES + shard_len`` on as many
nodes (one each when the cluster has ``k + m`` nodes); the per-node figure is
what a daemon's ``capacity`` must be.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcache.errors import ConfigError
from kvcache.retention.policy import RetentionPolicy
from kvcache.retention.simulate import SimulationResult, simulate
from kvcache.shard import HEADER_BYTES, shard_len_for
from kvcache.workload import Request

__all__ = ["CapacityPlan", "PlanPoint", "plan_capacity", "record_bytes"]


def record_bytes(block_bytes: int, *, k: int = 10) -> int:
    """Bytes one stored shard record of a ``block_bytes`` block takes (header + shard)."""
    return HEADER_BYTES + shard_len_for(block_bytes, k)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanPoint:
    """The trace replayed at ``fraction`` of the planned capacity."""

    fraction: float
    capacity_blocks: int
    result: SimulationResult

    def lost_pp(self, full: SimulationResult) -> float:
        """Hit rate lost against the planned capacity, in percentage points."""
        return 100 * (full.hit_rate - self.result.hit_rate)


@dataclass(frozen=True, slots=True, kw_only=True)
class CapacityPlan:
    """The planned capacity and what less of it would cost."""

    capacity_blocks: int
    block_bytes: int
    k: int
    m: int
    nodes: int
    full: SimulationResult
    points: tuple[PlanPoint, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes across the cluster, with the k + m overhead and the records' headers."""
        return self.capacity_blocks * (self.k + self.m) * record_bytes(self.block_bytes, k=self.k)

    @property
    def node_bytes(self) -> int:
        """Each daemon's ``capacity`` (blocks' shards spread evenly over ``nodes``)."""
        return self.node_bytes_for(self.capacity_blocks)

    def node_bytes_for(self, blocks: int) -> int:
        """A daemon's ``capacity`` for ``blocks`` blocks: a whole number of shard records
        when every block has a shard on every node, so the daemons' watermarks (bytes,
        rounded down) fall on the simulator's (blocks, rounded down)."""
        return math.ceil(blocks * (self.k + self.m) * record_bytes(self.block_bytes, k=self.k)
                         / self.nodes)  # fmt: skip

    def capacity_for(self, fraction: float) -> int:
        """A daemon's capacity in bytes at ``fraction`` of the plan (the point's blocks)."""
        return self.node_bytes_for(max(1, int(self.capacity_blocks * fraction)))


def plan_capacity(
    requests: Sequence[Request],
    policy: RetentionPolicy,
    *,
    block_bytes: int,
    k: int = 10,
    m: int = 2,
    nodes: int = 12,
    high_watermark: float = 0.9,
    low_watermark: float = 0.8,
    touch_resolution_s: float = 60.0,
    fractions: Sequence[float] = (0.75, 0.5),
    tie_key: Callable[[int], bytes] | None = None,
) -> CapacityPlan:
    """Plan the capacity of ``requests`` under ``policy`` (see the module docstring);
    ``tie_key`` as :func:`~kvcache.retention.simulate.simulate` takes it."""
    if not 0 < low_watermark <= high_watermark <= 1:
        raise ConfigError(
            f"watermarks must satisfy 0 < low <= high <= 1, got low={low_watermark!r}, "
            f"high={high_watermark!r}"
        )
    if block_bytes < 1 or nodes < 1 or k < 1 or m < 0:
        raise ConfigError(
            f"block_bytes, nodes and k must be >= 1 and m >= 0, got {block_bytes}, {nodes}, "
            f"{k}, {m}"
        )

    def at(capacity: int) -> SimulationResult:
        return simulate(
            requests,
            policy,
            capacity_blocks=capacity,
            touch_resolution_s=touch_resolution_s,
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            tie_key=tie_key,
        )

    unbounded = simulate(requests, policy, touch_resolution_s=touch_resolution_s,
                         tie_key=tie_key)  # fmt: skip
    blocks = max(1, math.ceil(unbounded.peak_written_blocks / high_watermark))
    while int(blocks * high_watermark) < unbounded.peak_written_blocks:
        blocks += 1  # int() rounds the watermark down, as the daemons do
    full = at(blocks)
    for _ in range(64):  # the peak alone should do; never loop unbounded
        if full.evicted_before_ttl == 0:
            break
        blocks = math.ceil(blocks * 1.01) + 1
        full = at(blocks)
    points = tuple(
        PlanPoint(
            fraction=f,
            capacity_blocks=max(1, int(blocks * f)),
            result=at(max(1, int(blocks * f))),
        )
        for f in fractions
    )
    return CapacityPlan(
        capacity_blocks=blocks, block_bytes=block_bytes, k=k, m=m, nodes=nodes, full=full,
        points=points,
    )  # fmt: skip
