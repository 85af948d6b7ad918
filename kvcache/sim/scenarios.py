"""The simulator's four questions as runs with one settings object; each returns flat
figures (name -> number) for ``kvcache sim`` and ``bench/sim.py``.

Defaults are the issue's reference figures or measured ones, cited where they are set:
a node of 100 TB of SSD (issue 21), the repair rate one ``kvcache repair`` process
reached (``bench/results/membership.json`` ``repair_gbps``, 0.169 GB/s), the repairer's
wait before treating a holder as gone (``repair_down_after_s``, 60 s), the deployment's
10 TiB/s read and 850 GiB/s write spread over the nodes as foreground traffic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvcache.errors import ArgumentError
from kvcache.keys import BlockKey, group_blocks_for
from kvcache.shard import HEADER_BYTES
from kvcache.sim.balance import balance_stats, holders_of
from kvcache.sim.markov import StripeChain
from kvcache.sim.montecarlo import FailureModel, simulate_failures
from kvcache.sim.movement import MoveStats, measure_join, measure_leave
from kvcache.sim.repair import BLOCK_BYTES, plan_loss, repair_time
from kvcache.sim.topology import Layout, sample_keys, synthetic_map

__all__ = [
    "SCHEMES",
    "Scheme",
    "Sample",
    "Samples",
    "SimSettings",
    "run_balance",
    "run_durability",
    "run_move",
    "run_repair",
]

Figures = dict[str, float]
_HOURS_PER_YEAR = 24 * 365.25


@dataclass(frozen=True, slots=True, kw_only=True)
class Scheme:
    """A redundancy scheme: ``n`` shards, any ``k`` readable."""

    name: str
    n: int
    k: int

    @property
    def shard_bytes(self) -> int:
        """Bytes one shard of a 112 KiB block takes (header included)."""
        return -(-BLOCK_BYTES // self.k) + HEADER_BYTES


SCHEMES = {
    "10+2": Scheme(name="10+2", n=12, k=10),
    "8+4": Scheme(name="8+4", n=12, k=8),
    "3x": Scheme(name="3x", n=3, k=1),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class SimSettings:
    """Everything a simulator run takes."""

    nodes: tuple[int, ...] = (1000, 10000)
    #: Nodes per failure domain for the "with domains" runs (a rack).
    domain_size: int = 40
    #: Sampled keys per run, per cluster size.
    keys: dict[int, int] = field(default_factory=lambda: {1000: 60_000, 10000: 10_000})
    seed: int = 21
    scheme: str = "10+2"
    #: Bytes of shards per node (issue 21: 100 TB of SSD per storage node).
    node_bytes: float = 100e12
    disks_per_node: int = 8
    #: Repair traffic one node moves per second, GB/s (membership.json repair_gbps).
    per_node_gbps: float = 0.169
    #: Each node's network bandwidth, GB/s (2 x 100 Gb/s ports).
    nic_gbps: float = 25.0
    #: Deployment-wide foreground read and write, GiB/s (issue 21).
    read_gibps: float = 10240.0
    write_gibps: float = 850.0
    #: Seconds before the repairer treats a lost holder as gone (repair_down_after_s).
    detect_s: float = 60.0
    node_mttf_years: float = 4.0
    disk_mttf_years: float = 4.0
    #: How long a block lives (kept for days: issue 21).
    lifetime_days: float = 3.0
    #: Nodes in the durability figure's cluster.
    durability_nodes: int = 1000
    #: Shards the join (leave) figures should see moved: joins (leaves) are added until
    #: about this many.
    moved_shards: int = 2000
    #: The accelerated Monte Carlo check: cluster, keys, horizon in repair times.
    mc_nodes: int = 100
    mc_keys: int = 4000
    mc_horizon_repairs: float = 300.0

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ArgumentError(f"scheme must be one of {sorted(SCHEMES)}, got {self.scheme!r}")
        if not self.nodes or min(self.nodes) < 13:
            raise ArgumentError(f"nodes must be >= 13 each, got {self.nodes}")
        if self.node_mttf_years <= 0 or self.disk_mttf_years <= 0:
            raise ArgumentError("MTTFs must be > 0 years")
        if self.disks_per_node < 1 or self.node_bytes <= 0 or self.lifetime_days < 0:
            raise ArgumentError("disks_per_node >= 1, node_bytes > 0, lifetime_days >= 0")
        for name in ("node_bytes", "per_node_gbps", "nic_gbps", "read_gibps", "write_gibps",
                     "detect_s", "node_mttf_years", "disk_mttf_years", "lifetime_days",
                     "mc_horizon_repairs"):  # fmt: skip
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ArgumentError(f"{name} must be a finite number >= 0, got {value!r}")
        if not self.per_node_gbps > 0 or not self.nic_gbps > 0:
            raise ArgumentError(
                f"per_node_gbps and nic_gbps must be > 0, got {self.per_node_gbps!r}, "
                f"{self.nic_gbps!r}"
            )

    def keys_for(self, nodes: int) -> int:
        """Sampled keys for a cluster of ``nodes`` (the nearest size given, scaled)."""
        if nodes in self.keys:
            return self.keys[nodes]
        size = min(self.keys, key=lambda s: abs(math.log(s / nodes)))
        return self.keys[size]

    def foreground_gbps(self, nodes: int, scheme: Scheme) -> float:
        """GB/s of foreground traffic per node: reads of k shards per block (the payload),
        writes of n shards per block (payload x n/k), spread evenly."""
        gib = 1024**3 / 1e9
        return (self.read_gibps + self.write_gibps * scheme.n / scheme.k) * gib / nodes

    def shards_per_node(self, scheme: Scheme) -> float:
        """Shards a full node holds."""
        return self.node_bytes / scheme.shard_bytes

    def groups_per_node(self, scheme: Scheme) -> float:
        """Placement groups a full node holds a shard of each block of: the units
        placement spreads (a group's blocks share their holders; a sampled key stands for
        a group, as only its placement tag places it)."""
        return self.shards_per_node(scheme) / group_blocks_for(BLOCK_BYTES)


def _layouts(settings: SimSettings) -> list[tuple[str, Layout]]:
    out = []
    for nodes in settings.nodes:
        out.append((f"{nodes}", Layout(nodes=nodes)))
        out.append((f"{nodes}_domains", Layout(nodes=nodes, domain_size=settings.domain_size)))
    return out


@dataclass(frozen=True, slots=True)
class Sample:
    """Sampled keys of one layout and their holders under the real placement."""

    keys: list[BlockKey]
    rows: npt.NDArray[np.int64]


#: Placed samples per (settings, layout), so one run places each layout once.
Samples = dict[tuple[int, int], Sample]


def _sample(settings: SimSettings, layout: Layout, samples: Samples | None) -> Sample:
    index = (layout.nodes, layout.domain_size)
    if samples is not None and index in samples:
        return samples[index]
    rng = np.random.default_rng([settings.seed, layout.nodes, layout.domain_size])
    keys = sample_keys(settings.keys_for(layout.nodes), rng)
    rows = holders_of(synthetic_map(layout), keys, width=SCHEMES[settings.scheme].n)
    sample = Sample(keys=keys, rows=rows)
    if samples is not None:
        samples[index] = sample
    return sample


def run_balance(
    settings: SimSettings, *, move: bool = False, samples: Samples | None = None
) -> Figures:
    """Balance at every cluster size, with and without domains (and with ``move``, the
    shards moved by a join and a leave, from the same placed sample)."""
    scheme = SCHEMES[settings.scheme]
    figures: Figures = {}
    for name, layout in _layouts(settings):
        sample = _sample(settings, layout, samples)
        keys, rows = sample.keys, sample.rows
        rng = np.random.default_rng([settings.seed, layout.nodes, layout.domain_size, 3])
        counts = np.bincount(rows.reshape(-1), minlength=layout.nodes).astype(np.int64)
        stats = balance_stats(
            counts,
            keys=len(keys),
            width=scheme.n,
            rng=rng,
            target_per_node=settings.groups_per_node(scheme),
        )
        p = f"balance_{name}"
        figures[f"{p}_keys"] = stats.keys
        figures[f"{p}_mean_per_node"] = stats.mean
        figures[f"{p}_max_over_mean"] = stats.max_over_mean
        figures[f"{p}_null_max_over_mean"] = stats.null_max_over_mean
        figures[f"{p}_null_max_over_mean_p95"] = stats.null_max_over_mean_p95
        figures[f"{p}_dispersion"] = stats.dispersion
        figures[f"{p}_structural_spread"] = stats.structural_spread
        figures[f"{p}_structural_spread_upper"] = stats.structural_spread_upper
        figures[f"{p}_projected_max_over_mean"] = stats.projected_max_over_mean
        if move:
            # Enough joins (leaves) that about 2,000 shards move: one join takes 12 of
            # every N keys' shards, so 10,000 nodes need many on one sample.
            per = len(keys) * scheme.n / layout.nodes
            count = max(1, min(layout.nodes, math.ceil(settings.moved_shards / per)))
            join = measure_join(layout, keys, rows, width=scheme.n, joins=count)
            moved = slots = 0
            for leaver in rng.choice(layout.nodes, size=count, replace=False).tolist():
                one, _ = measure_leave(layout, keys, rows, width=scheme.n, node=int(leaver))
                moved, slots = moved + one.moved, slots + one.node_slots
            leave = MoveStats(
                change="leave",
                nodes_before=layout.nodes,
                keys=len(keys) * count,
                width=scheme.n,
                moved=moved,
                node_slots=slots,
                moved_fraction=moved / (len(keys) * count * scheme.n),
                ideal_fraction=1.0 / layout.nodes,
                ratio_to_ideal=moved / (len(keys) * count * scheme.n) * layout.nodes,
                moved_per_node_slot=moved / slots if slots else float("nan"),
            )
            for m in (join, leave):
                q = f"move_{m.change}_{name}"
                figures[f"{q}_changes"] = count
                figures[f"{q}_moved_fraction"] = m.moved_fraction
                figures[f"{q}_ideal_fraction"] = m.ideal_fraction
                figures[f"{q}_ratio_to_ideal"] = m.ratio_to_ideal
                figures[f"{q}_moved_per_node_slot"] = m.moved_per_node_slot
                figures[f"{q}_node_slots"] = m.node_slots
    figures["balance_target_per_node"] = settings.groups_per_node(scheme)
    figures["balance_group_blocks"] = group_blocks_for(BLOCK_BYTES)
    return figures


def run_move(settings: SimSettings, *, samples: Samples | None = None) -> Figures:
    """Shards moved on a join and on a leave (with the balance figures of the sample)."""
    return run_balance(settings, move=True, samples=samples)


def run_repair(settings: SimSettings, *, samples: Samples | None = None) -> Figures:
    """Repair after losing one node and one failure domain, at every cluster size."""
    scheme = SCHEMES[settings.scheme]
    figures: Figures = {}
    for name, layout in _layouts(settings):
        sample = _sample(settings, layout, samples)
        keys, rows = sample.keys, sample.rows
        rack = frozenset(range(settings.domain_size))
        for what, lost in (("node", frozenset({0})), ("domain", rack)):
            cost = plan_loss(layout, keys, rows, k=scheme.k, lost=lost)
            fg = settings.foreground_gbps(layout.nodes, scheme)
            t = repair_time(
                cost,
                node_bytes=settings.node_bytes,
                per_node_gbps=settings.per_node_gbps,
                nic_gbps=settings.nic_gbps,
                foreground_gbps=fg,
                detect_s=settings.detect_s,
            )
            # The same repair if each node gave it all the room its NIC has left.
            fast = repair_time(
                cost,
                node_bytes=settings.node_bytes,
                per_node_gbps=settings.nic_gbps,
                nic_gbps=settings.nic_gbps,
                foreground_gbps=fg,
                detect_s=settings.detect_s,
            )
            q = f"repair_{what}_{name}"
            figures[f"{q}_hours_at_nic_room"] = fast.seconds / 3600
            figures[f"{q}_lost_shards_sampled"] = cost.lost_shards
            figures[f"{q}_unrecoverable_sampled"] = cost.unrecoverable
            figures[f"{q}_unrecoverable_fraction"] = cost.unrecoverable / max(
                1, cost.blocks_repaired + cost.unrecoverable
            )
            figures[f"{q}_traffic_per_lost_shard"] = cost.traffic_per_lost_shard
            figures[f"{q}_source_nodes"] = cost.source_nodes
            figures[f"{q}_target_nodes"] = cost.target_nodes
            figures[f"{q}_hours"] = t.seconds / 3600
            figures[f"{q}_nic_share"] = t.nic_share
            figures[f"{q}_foreground_gbps_per_node"] = fg
    figures["repair_per_node_gbps"] = settings.per_node_gbps
    return figures


def _repair_hours(settings: SimSettings, scheme: Scheme, nodes: int, part: float) -> float:
    """Hours to rebuild ``part`` of a node (1: the node; 1/disks: a disk) spread over the
    cluster: (k reads + 1 write) per lost shard (the planner's figure when each block
    lost one shard), each surviving node moving ``per_node_gbps``."""
    traffic = settings.node_bytes * part * (scheme.k + 1)
    return (traffic / ((nodes - 1) * settings.per_node_gbps * 1e9) + settings.detect_s) / 3600


def run_durability(settings: SimSettings) -> Figures:
    """Unreadable blocks per year for 10+2, 8+4 and 3-way replication: the chain at the
    realistic rates, and the chain against the Monte Carlo at accelerated ones."""
    figures: Figures = {}
    nodes = settings.durability_nodes
    for scheme in SCHEMES.values():
        node_h = _repair_hours(settings, scheme, nodes, 1.0)
        disk_h = _repair_hours(settings, scheme, nodes, 1.0 / settings.disks_per_node)
        model = FailureModel(
            node_rate=1.0 / (settings.node_mttf_years * _HOURS_PER_YEAR),
            node_repair=node_h,
            disk_rate=1.0 / (settings.disk_mttf_years * _HOURS_PER_YEAR),
            disk_repair=disk_h,
            disks_per_node=settings.disks_per_node,
        )
        chain = StripeChain(
            n=scheme.n,
            k=scheme.k,
            failure_rate=model.shard_rate,
            repair_rate=model.shard_repair_rate,
        )
        q = f"durability_{scheme.name.replace('+', 'p')}"
        figures[f"{q}_node_repair_hours"] = node_h
        figures[f"{q}_disk_repair_hours"] = disk_h
        figures[f"{q}_unreadable_per_year"] = chain.loss_rate() * _HOURS_PER_YEAR
        figures[f"{q}_unreadable_per_lifetime"] = chain.loss_probability(
            settings.lifetime_days * 24
        )
        figures[f"{q}_mttdl_years"] = chain.mean_time_to_loss() / _HOURS_PER_YEAR
        # Accelerated: failures every 20 repair times per node and 80 per disk.
        fast = FailureModel(
            node_rate=1.0 / 200.0,
            node_repair=10.0,
            disk_rate=1.0 / 800.0,
            disk_repair=10.0 / settings.disks_per_node,
            disks_per_node=settings.disks_per_node,
        )
        fast_chain = StripeChain(
            n=scheme.n, k=scheme.k, failure_rate=fast.shard_rate, repair_rate=fast.shard_repair_rate
        )
        rng = np.random.default_rng([settings.seed, scheme.n, scheme.k, 2])
        layout = Layout(nodes=settings.mc_nodes)
        rows = holders_of(synthetic_map(layout), sample_keys(settings.mc_keys, rng), width=scheme.n)
        mc = simulate_failures(
            rows,
            layout.nodes,
            k=scheme.k,
            model=fast,
            horizon=settings.mc_horizon_repairs * fast.node_repair,
            rng=rng,
        )
        figures[f"{q}_fast_markov_per_hour"] = fast_chain.loss_rate()
        figures[f"{q}_fast_mc_per_hour"] = mc.loss_rate
        figures[f"{q}_fast_mc_events"] = mc.events
        figures[f"{q}_fast_mc_over_markov"] = mc.loss_rate / fast_chain.loss_rate()
    return figures
