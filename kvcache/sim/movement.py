"""Data moved on a join and on a leave, against the ideal 1/N.

A shard moves when its (key, index) slot names another node after the map
change. The ideal, for any placement: a join moves the new node's fair share,
1/(N+1) of all shards; a leave moves the leaving node's shards, 1/N. The
per-position rendezvous rule (:mod:`kvcache.placement`) moves those plus a few
*displaced* shards: when the new node takes position p of a key, the node it
beat may then take a later position from its owner.

Rows that do not contain the joining (leaving) node are the same under both
maps — each position's pick is the best eligible node, and a node that never
wins changes no pick — so a leave re-places only the keys the node held. A
joining node can take a key only if at some position p its score beats the
score of the key's old pick at p (below every old pick, it wins nothing, by
induction over the positions); :func:`join_candidates` finds those keys with
O(width) scores per key (:meth:`kvcache.placement.Placement.pair_scores`), and
only they are placed again. That makes many joins on one placed sample cheap:
at 10,000 nodes one join takes 12 of every 10,000 keys' shards, so a sample
needs many joins to see a few thousand moved shards. ``tests/test_sim.py``
checks both shortcuts against placing every key again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.errors import ArgumentError
from kvcache.keys import BlockKey
from kvcache.placement import Placement
from kvcache.sim.balance import holders_of
from kvcache.sim.topology import Layout, synthetic_map

__all__ = [
    "MoveStats",
    "join_candidates",
    "measure_join",
    "measure_leave",
    "moved_slots",
    "rows_without",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class MoveStats:
    """Shards moved by one map change, over a sample of keys."""

    change: str
    nodes_before: int
    keys: int
    width: int
    moved: int
    #: Slots the joining node takes, or the leaving node held.
    node_slots: int
    #: moved / (keys x width): the fraction of all shards that moved.
    moved_fraction: float
    #: 1/(N+1) for a join, 1/N for a leave.
    ideal_fraction: float
    #: moved_fraction / ideal_fraction.
    ratio_to_ideal: float
    #: moved / node_slots: shards moved per shard the node takes (gives up).
    moved_per_node_slot: float


def moved_slots(before: npt.NDArray[np.int64], after: npt.NDArray[np.int64]) -> int:
    """How many (key, index) slots name another node in ``after`` than in ``before``
    (both node ids as integers, same shape)."""
    if before.shape != after.shape:
        raise ArgumentError(f"row shapes differ: {before.shape} and {after.shape}")
    return int(np.count_nonzero(before != after))


def _stats(
    change: str, nodes: int, keys: int, width: int, moved: int, node_slots: int, ideal: float
) -> MoveStats:
    fraction = moved / (keys * width) if keys else 0.0
    return MoveStats(
        change=change,
        nodes_before=nodes,
        keys=keys,
        width=width,
        moved=moved,
        node_slots=node_slots,
        moved_fraction=fraction,
        ideal_fraction=ideal,
        ratio_to_ideal=fraction / ideal,
        moved_per_node_slot=moved / node_slots if node_slots else float("nan"),
    )


def join_candidates(
    layout: Layout, keys: Sequence[BlockKey], rows: npt.NDArray[np.int64], *, joiner: int = 0
) -> npt.NDArray[np.bool_]:
    """Which keys the joining node ``node_id(nodes + joiner)`` may take: those where it
    outscores the old pick at some position (a superset of the keys it takes)."""
    cluster = synthetic_map(layout, extra=1, first_extra=joiner)
    placement = Placement(cluster, width=rows.shape[1], spill=0)
    new = np.full(len(keys), layout.nodes, np.int64)  # the joiner comes last in the map
    hit = np.zeros(len(keys), bool)
    # Shard i sits at the group's position (i + r) mod width: back to positions.
    width = rows.shape[1]
    back = (np.arange(width)[None, :] - placement.rotations(keys)[:, None]) % width
    at = np.take_along_axis(rows, back, axis=1)
    for p in range(width):
        hit |= placement.pair_scores(keys, new, p) > placement.pair_scores(keys, at[:, p], p)
    return hit


def measure_join(
    layout: Layout,
    keys: Sequence[BlockKey],
    rows: npt.NDArray[np.int64],
    *,
    width: int,
    joins: int = 1,
    full: bool = False,
) -> MoveStats:
    """``joins`` different nodes join ``layout`` one at a time (each alone: the map is
    ``layout`` plus that node), whose holders of ``keys`` are ``rows``; counts add up
    over the joins. Only :func:`join_candidates` are placed again (``full``: every key)."""
    if joins < 1:
        raise ArgumentError(f"joins must be >= 1, got {joins}")
    moved = slots = 0
    for joiner in range(joins):
        picked = (
            np.arange(len(keys))
            if full
            else np.flatnonzero(join_candidates(layout, keys, rows, joiner=joiner))
        )
        if not len(picked):
            continue
        cluster = synthetic_map(layout, extra=1, first_extra=joiner, epoch=2)
        after = holders_of(cluster, [keys[i] for i in picked.tolist()], width=width)
        moved += moved_slots(rows[picked], after)
        slots += int(np.count_nonzero(after == layout.nodes))
    return _stats(
        "join", layout.nodes, len(keys) * joins, width, moved, slots, 1.0 / (layout.nodes + 1)
    )


def rows_without(
    layout: Layout,
    keys: Sequence[BlockKey],
    rows: npt.NDArray[np.int64],
    *,
    width: int,
    gone: frozenset[int],
    full: bool = False,
) -> npt.NDArray[np.int64]:
    """The holders of ``keys`` once the nodes in ``gone`` are out of the map, as node
    indices of the original map: only the keys a gone node held are placed again
    (``full``: every key)."""
    if any(not 0 <= g < layout.nodes for g in gone):
        raise ArgumentError(f"nodes {sorted(gone)} are not all in a layout of {layout.nodes}")
    after = rows.copy()
    hit = np.isin(rows, np.fromiter(gone, np.int64, len(gone))).any(axis=1)
    touched = np.arange(len(keys)) if full else np.flatnonzero(hit)
    if len(touched):
        new = holders_of(
            synthetic_map(layout, out=gone, epoch=2),
            [keys[i] for i in touched.tolist()],
            width=width,
        )
        # The new map's placeable nodes skip the gone ones: map their indices back.
        kept = np.setdiff1d(np.arange(layout.nodes), np.fromiter(gone, np.int64, len(gone)))
        after[touched] = kept[new]
    return after


def measure_leave(
    layout: Layout,
    keys: Sequence[BlockKey],
    rows: npt.NDArray[np.int64],
    *,
    width: int,
    node: int,
    full: bool = False,
) -> tuple[MoveStats, npt.NDArray[np.int64]]:
    """Node ``node`` leaves (state out): the keys it held are placed again (``full``:
    every key, for the test that this is the same). Returns the stats and the rows
    after, as node indices of the original map."""
    after = rows_without(layout, keys, rows, width=width, gone=frozenset({node}), full=full)
    stats = _stats(
        "leave",
        layout.nodes,
        len(keys),
        width,
        moved_slots(rows, after),
        int(np.count_nonzero(rows == node)),
        1.0 / layout.nodes,
    )
    return stats, after
