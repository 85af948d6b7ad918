"""Monte Carlo check of the chain: fail and repair the nodes and disks of a placed cluster.

Every node fails at ``node_rate`` (exponential times) and comes back
``node_repair`` later; every disk of every node likewise at ``disk_rate`` /
``disk_repair``. A shard is lost while its node or its disk is. The keys' rows
come from the real placement; each shard sits on one disk of its node (by its
(key, index), as a daemon with several LMDB disks would spread them). An
unreadability event is a key's lost-shard count rising from m to m + 1; the
result counts them per key per unit time after a warm-up, which the chain's
:meth:`~kvcache.sim.markov.StripeChain.loss_rate` predicts.

Time is a float the event loop advances; randomness is the generator passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.errors import ArgumentError

__all__ = ["FailureModel", "MonteCarloResult", "simulate_failures"]


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureModel:
    """Failure and repair of nodes and disks (rates per unit time; repairs take a fixed
    time in that unit)."""

    node_rate: float
    node_repair: float
    disk_rate: float = 0.0
    disk_repair: float = 0.0
    disks_per_node: int = 1

    def __post_init__(self) -> None:
        if self.node_rate < 0 or self.disk_rate < 0 or self.node_repair < 0:
            raise ArgumentError("failure rates and repair times must be >= 0")
        if self.disk_repair < 0 or self.disks_per_node < 1:
            raise ArgumentError("disk repair must be >= 0 and disks_per_node >= 1")
        if self.node_rate + self.disk_rate <= 0:
            raise ArgumentError("at least one failure rate must be > 0")

    @property
    def shard_rate(self) -> float:
        """A shard's failure rate: its node's plus its disk's."""
        return self.node_rate + self.disk_rate

    @property
    def shard_repair_rate(self) -> float:
        """1 / the mean time a failed shard stays lost (the chain's μ)."""
        mean = (self.node_rate * self.node_repair + self.disk_rate * self.disk_repair) / (
            self.shard_rate
        )
        return 1.0 / mean


@dataclass(frozen=True, slots=True, kw_only=True)
class MonteCarloResult:
    """Unreadability events counted over the simulated time."""

    keys: int
    horizon: float
    events: int
    #: events / (keys x horizon): the chain's loss_rate, measured.
    loss_rate: float
    #: Relative standard error of loss_rate, from batch means: keys share nodes, so one
    #: coincidence of outages makes many events at once and 1/√events would understate it.
    rel_error: float


def _outages(
    rng: np.random.Generator, count: int, rate: float, repair: float, end: float
) -> list[tuple[float, int, int]]:
    """(time, unit, +1 fail / -1 back) for ``count`` units alternating up (Exp(rate))
    and down (``repair``) over [0, end)."""
    events: list[tuple[float, int, int]] = []
    if rate <= 0:
        return events
    for unit in range(count):
        t = float(rng.exponential(1.0 / rate))
        while t < end:
            events.append((t, unit, 1))
            events.append((t + repair, unit, -1))
            t += repair + float(rng.exponential(1.0 / rate))
    return events


def simulate_failures(
    rows: npt.NDArray[np.int64],
    nodes: int,
    *,
    k: int,
    model: FailureModel,
    horizon: float,
    rng: np.random.Generator,
    warmup: float | None = None,
) -> MonteCarloResult:
    """Count unreadability events of the keys placed as ``rows`` (keys, n) over ``nodes``
    nodes, between ``warmup`` (default: ten of the longer repair time) and ``horizon``."""
    keys, n = rows.shape
    if not 1 <= k <= n:
        raise ArgumentError(f"k must lie in 1..{n}, got {k}")
    if horizon <= 0:
        raise ArgumentError(f"horizon must be > 0, got {horizon}")
    m = n - k
    d = model.disks_per_node
    start = 10.0 * max(model.node_repair, model.disk_repair) if warmup is None else warmup
    if start >= horizon:
        raise ArgumentError(f"warm-up {start} must end before the horizon {horizon}")
    # Shards per (node, disk) unit, as CSR lists of key ids.
    disk = (np.arange(keys)[:, None] * 7919 + np.arange(n)[None, :] * 104729) % d
    unit = (rows * d + disk).reshape(-1)
    key_of = np.repeat(np.arange(keys), n)
    by_unit = np.argsort(unit, kind="stable")
    bounds = np.searchsorted(unit[by_unit], np.arange(nodes * d + 1))
    members = key_of[by_unit]
    node_events = _outages(rng, nodes, model.node_rate, model.node_repair, horizon)
    disk_events = _outages(rng, nodes * d, model.disk_rate, model.disk_repair, horizon)
    # One list: node outages touch all d units of the node.
    merged = [(t, 0, u, s) for t, u, s in node_events] + [(t, 1, u, s) for t, u, s in disk_events]
    merged.sort()
    down_units = np.zeros(nodes * d, np.int64)
    lost = np.zeros(keys, np.int64)
    batches = 10
    per_batch = np.zeros(batches, np.int64)
    span = horizon - start
    for t, kind, u, step in merged:
        if t >= horizon:
            break
        units = range(u * d, u * d + d) if kind == 0 else (u,)
        for x in units:
            before = down_units[x]
            down_units[x] = before + step
            if (before == 0) != (down_units[x] == 0):
                ks = members[bounds[x] : bounds[x + 1]]
                if step > 0:
                    lost[ks] += 1
                    if t >= start:
                        b = min(batches - 1, int((t - start) / span * batches))
                        per_batch[b] += int(np.count_nonzero(lost[ks] == m + 1))
                else:
                    lost[ks] -= 1
    events = int(per_batch.sum())
    sd = float(np.std(per_batch, ddof=1)) / math.sqrt(batches)
    mean = events / batches
    return MonteCarloResult(
        keys=keys,
        horizon=span,
        events=events,
        loss_rate=events / (keys * span),
        rel_error=sd / mean if events else float("inf"),
    )
