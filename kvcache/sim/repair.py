"""Repair after losing a node or a failure domain: the real planner's work, and its time.

:func:`plan_loss` takes a placed sample, removes the lost nodes from the map
(as their etcd leases running out does), lists what the survivors hold of every
key the lost nodes held — exactly what the repairer's LIST merge would hand it
— and runs :func:`kvcache.repair.plan_blocks` against the new write targets
(:func:`kvcache.placement.write_targets_many`). From the plan it counts, per
shard lost, the shards the repairer reads (k per block rebuilt, as
:class:`kvcache.repair.Repairer` reads them) and writes (the lost shards, plus
shards the map change displaced), and how many distinct nodes serve the reads
and take the writes.

:func:`repair_time` scales that to a real node's data: the bytes to move are
(reads + writes) per lost shard × the shards lost, spread over the surviving
nodes, each moving at most ``per_node_gbps`` of repair traffic and no more than
its NIC leaves after foreground traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.errors import ArgumentError
from kvcache.keys import BlockKey
from kvcache.placement import max_redirect, write_targets_many
from kvcache.repair.listing import Held
from kvcache.repair.plan import plan_blocks
from kvcache.sim.movement import rows_without
from kvcache.sim.topology import Layout

__all__ = ["RepairCost", "RepairTime", "plan_loss", "repair_time"]

#: One stored block's payload (128 tokens x 224 bytes per token, ``kvcache.layout``).
BLOCK_BYTES = 114_688


@dataclass(frozen=True, slots=True, kw_only=True)
class RepairCost:
    """The repair planner's work after a loss, over a sample of keys."""

    nodes: int
    lost_nodes: int
    width: int
    k: int
    #: Sampled shards on the lost nodes.
    lost_shards: int
    blocks_repaired: int
    #: Blocks left with fewer than k shards: unreadable until stored again (the planner's
    #: unrecoverable ones, and those with no shard left, which no node lists).
    unrecoverable: int
    #: Shards read and written by the plan.
    reads: int
    writes: int
    #: Distinct surviving nodes that serve reads / take writes.
    source_nodes: int
    target_nodes: int
    #: Most shards one node serves plus takes, over the mean of the nodes that take part.
    busiest_over_mean: float

    @property
    def traffic_per_lost_shard(self) -> float:
        """Shards read plus written per shard lost (k + 1 when each block lost one)."""
        return (self.reads + self.writes) / self.lost_shards if self.lost_shards else 0.0


def plan_loss(
    layout: Layout,
    keys: Sequence[BlockKey],
    rows: npt.NDArray[np.int64],
    *,
    k: int,
    lost: frozenset[int],
) -> RepairCost:
    """Run the real repair planner for the keys of ``rows`` after the nodes in ``lost``
    left the map (their shards gone)."""
    width = rows.shape[1]
    if not 1 <= k <= width:
        raise ArgumentError(f"k must lie in 1..{width}, got {k}")
    lost_arr = np.fromiter(lost, np.int64, len(lost))
    hit = np.flatnonzero(np.isin(rows, lost_arr).any(axis=1))
    sub_keys = [keys[i] for i in hit.tolist()]
    before = rows[hit]
    after = rows_without(layout, sub_keys, before, width=width, gone=lost)
    live = np.ones(layout.nodes, bool)
    live[lost_arr] = False
    domain_of = np.arange(layout.nodes, dtype=np.int64) // max(1, layout.domain_size)
    targets, _ = write_targets_many(
        after, live, domain_of, width=width, limit=max_redirect(n=width, min_write=k)
    )
    held = [
        (
            bytes(key),
            [
                Held(node=int(node), index=i, stripe=1, payload_len=BLOCK_BYTES, expiry_ms=0)
                for i, node in enumerate(row.tolist())
                if live[node]
            ],
        )
        for key, row in zip(sub_keys, before, strict=True)
    ]
    plan = plan_blocks(held, targets, k=k, writable=live)
    load = np.zeros(layout.nodes, np.int64)
    reads = writes = 0
    sources: set[int] = set()
    takers: set[int] = set()
    for block in plan.repairs:
        # The repairer reads k shards, data shards (low indices) first.
        for _, node in block.sources[:k]:
            load[node] += 1
            sources.add(node)
        reads += min(k, len(block.sources))
        for _, node, _ in block.writes:
            load[node] += 1
            takers.add(node)
        writes += len(block.writes)
    busy = load[load > 0]
    return RepairCost(
        nodes=layout.nodes,
        lost_nodes=len(lost),
        width=width,
        k=k,
        lost_shards=int(np.isin(before, lost_arr).sum()),
        blocks_repaired=len(plan.repairs),
        unrecoverable=len(plan.unrecoverable) + sum(1 for _, shards in held if not shards),
        reads=reads,
        writes=writes,
        source_nodes=len(sources),
        target_nodes=len(takers),
        busiest_over_mean=float(busy.max() / busy.mean()) if len(busy) else 0.0,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class RepairTime:
    """Time to restore full redundancy after a loss, at real scale."""

    #: Bytes of shards lost (the lost nodes' data).
    lost_bytes: float
    #: Bytes read plus written by the repair.
    traffic_bytes: float
    #: Repair GB/s each surviving node moves (the lesser of its cap and its NIC's room).
    per_node_gbps: float
    seconds: float
    #: Share of a surviving node's NIC the repair takes while it runs.
    nic_share: float


def repair_time(
    cost: RepairCost,
    *,
    node_bytes: float,
    per_node_gbps: float,
    nic_gbps: float,
    foreground_gbps: float = 0.0,
    detect_s: float = 0.0,
) -> RepairTime:
    """Seconds to rebuild ``cost.lost_nodes`` nodes of ``node_bytes`` each: the plan's
    traffic per lost shard over the surviving nodes, each moving at most
    ``per_node_gbps`` and at most what its ``nic_gbps`` leaves after ``foreground_gbps``,
    plus ``detect_s`` before the repairer starts (the lease TTL and
    ``repair_down_after_s``)."""
    if node_bytes < 0 or per_node_gbps <= 0 or nic_gbps <= 0 or foreground_gbps < 0:
        raise ArgumentError("node bytes, bandwidths and foreground must be positive")
    room = nic_gbps - foreground_gbps
    if room <= 0:
        raise ArgumentError(
            f"foreground {foreground_gbps} GB/s fills the {nic_gbps} GB/s NIC: no room to repair"
        )
    rate = min(per_node_gbps, room)
    lost = node_bytes * cost.lost_nodes
    traffic = lost * cost.traffic_per_lost_shard
    survivors = cost.nodes - cost.lost_nodes
    # The busiest node sets the pace; at real scale (10⁵+ shards per node) its excess
    # over the mean is the placement's structural spread, ~1 (see balance).
    seconds = traffic / (survivors * rate * 1e9) + detect_s
    return RepairTime(
        lost_bytes=lost,
        traffic_bytes=traffic,
        per_node_gbps=rate,
        seconds=seconds,
        nic_share=(rate + foreground_gbps) / nic_gbps,
    )
