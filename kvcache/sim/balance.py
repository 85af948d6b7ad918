"""Balance: how evenly placement spreads shards over nodes, told apart from sampling noise.

A simulator can place a sample of keys, not the 10⁹-10¹⁰ shards a node of the
reference deployment holds. With K keys of ``width`` shards over N nodes a
perfectly fair placement still gives node counts ~ Binomial(K, width/N): mean
λ = K·width/N, variance λ(1 - width/N), and a max / mean of about
1 + z_N / √λ (z_N ≈ 3.9 for N = 10,000). At λ = 24 that is 1.8, whatever the
placement does. So the statistics are:

* the measured max / mean at the sample's λ, beside the same figure for a fair
  placement of the same sample (``null_max_over_mean``, drawn from the binomial);
* the placement's own spread of expected shares, σ_s (the relative standard
  deviation of the nodes' shares, with the binomial variance taken out), with an
  upper bound at about 95 %;
* the max / mean projected to ``target_per_node`` shards per node from that bound:
  1 + z_N · √(σ_up² + (1 - width/N)/λ_target).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.cluster import ClusterMap
from kvcache.errors import ArgumentError
from kvcache.keys import BlockKey
from kvcache.placement import Placement

__all__ = ["BalanceStats", "balance_stats", "holders_of", "measure_balance"]

#: Keys placed per call of the real placement (its cache holds 2¹⁷ keys).
_BATCH = 8192


@dataclass(frozen=True, slots=True, kw_only=True)
class BalanceStats:
    """Shards per node of one placed sample, and what they say about the placement."""

    nodes: int
    keys: int
    width: int
    #: Mean shards per node in the sample (λ).
    mean: float
    max: int
    min: int
    max_over_mean: float
    #: Variance / mean of the counts; a fair placement gives 1 - width/N.
    dispersion: float
    #: The same max / mean for a fair placement of this sample: mean and 95th percentile.
    null_max_over_mean: float
    null_max_over_mean_p95: float
    #: Relative spread of the nodes' expected shares beyond sampling (0 when none is seen),
    #: and its upper bound at about 95 %.
    structural_spread: float
    structural_spread_upper: float
    #: Shards per node the projection is for, and the projected max / mean there.
    target_per_node: float
    projected_max_over_mean: float


def holders_of(
    cluster: ClusterMap, keys: Sequence[BlockKey], *, width: int
) -> npt.NDArray[np.int64]:
    """The real placement's holders of ``keys`` (node indices into the map's placeable
    nodes, in map order), shape (keys, width)."""
    placement = Placement(cluster, width=width, spill=0)
    if not keys:
        return np.zeros((0, width), np.int64)
    parts = [placement.holders(keys[i : i + _BATCH]) for i in range(0, len(keys), _BATCH)]
    return np.concatenate(parts).astype(np.int64)


def balance_stats(
    counts: npt.NDArray[np.int64],
    *,
    keys: int,
    width: int,
    rng: np.random.Generator,
    target_per_node: float,
    null_draws: int = 64,
) -> BalanceStats:
    """The statistics of shard ``counts`` per node from ``keys`` keys of ``width`` shards."""
    nodes = len(counts)
    if nodes < 2 or keys < 1:
        raise ArgumentError(f"balance needs >= 2 nodes and >= 1 key, got {nodes} and {keys}")
    if int(counts.sum()) != keys * width:
        raise ArgumentError(f"counts sum to {int(counts.sum())}, not keys x width = {keys * width}")
    mean = keys * width / nodes
    q = min(width, nodes) / nodes
    var = float(np.var(counts, ddof=1))
    fair_var = mean * (1.0 - q)
    # Null: every node's count ~ Binomial(keys, q).
    draws = rng.binomial(keys, q, size=(null_draws, nodes))
    null_ratio = draws.max(axis=1) / mean
    z = float(np.mean((draws.max(axis=1) - mean) / np.sqrt(max(fair_var, 1e-12))))
    excess = (var - fair_var) / mean**2
    se = fair_var * np.sqrt(2.0 / (nodes - 1)) / mean**2
    upper = max(0.0, excess + 2.0 * se)
    spread = float(np.sqrt(max(0.0, excess)))
    projected = 1.0 + z * float(np.sqrt(upper + (1.0 - q) / target_per_node))
    return BalanceStats(
        nodes=nodes,
        keys=keys,
        width=width,
        mean=mean,
        max=int(counts.max()),
        min=int(counts.min()),
        max_over_mean=float(counts.max() / mean),
        dispersion=var / mean,
        null_max_over_mean=float(null_ratio.mean()),
        null_max_over_mean_p95=float(np.quantile(null_ratio, 0.95)),
        structural_spread=spread,
        structural_spread_upper=float(np.sqrt(upper)),
        target_per_node=target_per_node,
        projected_max_over_mean=projected,
    )


def measure_balance(
    cluster: ClusterMap,
    keys: Sequence[BlockKey],
    *,
    width: int,
    rng: np.random.Generator,
    target_per_node: float,
) -> tuple[BalanceStats, npt.NDArray[np.int64]]:
    """Place ``keys`` with the real placement and return their balance and the holders."""
    rows = holders_of(cluster, keys, width=width)
    nodes = len(cluster.placeable)
    counts = np.bincount(rows.reshape(-1), minlength=nodes).astype(np.int64)
    stats = balance_stats(
        counts, keys=len(keys), width=width, rng=rng, target_per_node=target_per_node
    )
    return stats, rows
