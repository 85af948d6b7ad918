"""A simulator of 1,000-10,000-node clusters: the real placement and repair planner, no I/O.

* :mod:`.topology`: synthetic cluster maps (nodes, failure domains) and sampled keys;
* :mod:`.balance`: shards per node, max / mean, against the sampling noise of a
  perfectly even placement;
* :mod:`.movement`: shards moved on a join or a leave, against the ideal 1/N;
* :mod:`.repair`: the repairer's plan (:func:`kvcache.repair.plan_blocks`) after losing a
  node or a failure domain, and the time to restore full redundancy at a given
  per-node repair bandwidth;
* :mod:`.markov`: the birth-death chain on a stripe's failed shards (unreadable
  blocks per year);
* :mod:`.montecarlo`: the same question answered by failing and repairing the nodes
  and disks of a placed cluster, to check the chain.

Everything here is pure: randomness comes from a seeded ``numpy`` generator passed in,
time is a number the caller advances. ``kvcache sim`` (:mod:`.cli`) and
``bench/sim.py`` drive it.
"""

from kvcache.sim.balance import BalanceStats, balance_stats, measure_balance
from kvcache.sim.markov import StripeChain, expm
from kvcache.sim.montecarlo import FailureModel, MonteCarloResult, simulate_failures
from kvcache.sim.movement import MoveStats, measure_join, measure_leave, moved_slots
from kvcache.sim.repair import RepairCost, RepairTime, plan_loss, repair_time
from kvcache.sim.topology import Layout, sample_keys, synthetic_map

__all__ = [
    "BalanceStats",
    "FailureModel",
    "Layout",
    "MonteCarloResult",
    "MoveStats",
    "RepairCost",
    "RepairTime",
    "StripeChain",
    "balance_stats",
    "expm",
    "measure_balance",
    "measure_join",
    "measure_leave",
    "moved_slots",
    "plan_loss",
    "repair_time",
    "sample_keys",
    "simulate_failures",
    "synthetic_map",
]
