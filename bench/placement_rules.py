"""Data moved on one node join under seven placement rules with failure domains (issue 21).

`kvcache sim` measures the real placement (:mod:`kvcache.placement`): with 1,000 nodes in
25 racks of 40 a join moves 1.57x the ideal 1/(N+1), against <= 1.2 asked. This benchmark
asks whether another rule would do better, on one set of random scores shared by all
rules (a numpy model of each rule, not the real code; ``per-position`` is the real rule's
model, and its figure here matches the simulator's):

- ``per-position``: each shard position takes the best-scoring node among the racks the
  key does not use yet (the shipped rule);
- ``two-level``: each position takes a rack by rendezvous over the free racks, weighted
  by their node counts, then the best node inside it (CRUSH's shape);
- ``set-then-index``: the 12 best nodes with distinct racks by one score per node, then
  shard indices handed out position by position within that set;
- ``rack-arcs``: racks spread over 12 arcs of a per-key ring, each position choosing
  among the nodes of its arc's racks (the next arc's when its own has none free). It
  ignores rack sizes; the ``rack join`` column shows what that costs: the first node
  of a new rack takes a whole rack's share;
- ``rank-then-label``: the 12 racks whose best node scores highest, each node its rack's
  best; then the racks, best first, each take their favourite shard index not taken yet
  (a join moves a rack into the set: the racks ranked below it may each move);
- ``home-labels``: each rack has one favourite index per key; an index takes the best
  rack of those whose favourite it is, an index no rack favours the best rack left (no
  index is ever contested, but a rack alone with its favourite takes it whatever its
  size: the new rack's first node again);
- ``two-home-labels``: each rack may take its two favourite indices; each index, in
  turn, the best rack among those not used yet, by that index's scores (fewer contests
  than ``per-position``, whose every index may take every rack).

Prints one table: moved / ideal per rule and seed, and the node-load spread (max / mean
shards per node before the join). Usage: ``python bench/placement_rules.py [--keys N]
[--seeds S] [--nodes N] [--racks R]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

WIDTH = 12

Scores = npt.NDArray[np.float64]
Rows = npt.NDArray[np.int64]


def per_position(node_scores: Scores, rack_scores: Scores, rack_of: Rows, racks: int) -> Rows:
    keys, _nodes = node_scores.shape[1:]
    out = np.zeros((keys, WIDTH), np.int64)
    used = np.zeros((keys, racks), bool)
    every = np.arange(keys)
    for p in range(WIDTH):
        pick = np.argmax(np.where(used[:, rack_of], -1.0, node_scores[p]), axis=1)
        out[:, p] = pick
        used[every, rack_of[pick]] = True
    return out


def two_level(node_scores: Scores, rack_scores: Scores, rack_of: Rows, racks: int) -> Rows:
    keys = node_scores.shape[1]
    weight = np.bincount(rack_of, minlength=racks).astype(np.float64)
    out = np.zeros((keys, WIDTH), np.int64)
    used = np.zeros((keys, racks), bool)
    every = np.arange(keys)
    for p in range(WIDTH):
        score = np.where(weight > 0, -weight / np.log(rack_scores[p][:, :racks]), -np.inf)
        rack = np.argmax(np.where(used, -np.inf, score), axis=1)
        used[every, rack] = True
        inside = rack_of[None, :] == rack[:, None]
        out[:, p] = np.argmax(np.where(inside, node_scores[p], -1.0), axis=1)
    return out


def set_then_index(node_scores: Scores, rack_scores: Scores, rack_of: Rows, racks: int) -> Rows:
    keys = node_scores.shape[1]
    members = per_position(np.broadcast_to(node_scores[0], node_scores.shape), rack_scores,
                           rack_of, racks)  # fmt: skip
    out = np.zeros((keys, WIDTH), np.int64)
    free = np.ones((keys, WIDTH), bool)
    every = np.arange(keys)
    for p in range(WIDTH):
        score = np.take_along_axis(node_scores[p], members, axis=1)
        j = np.argmax(np.where(free, score, -1.0), axis=1)
        out[:, p] = members[every, j]
        free[every, j] = False
    return out


def rack_arcs(node_scores: Scores, rack_scores: Scores, rack_of: Rows, racks: int) -> Rows:
    keys = node_scores.shape[1]
    arc = np.minimum((rack_scores[0][:, :racks] * WIDTH).astype(np.int64), WIDTH - 1)
    out = np.zeros((keys, WIDTH), np.int64)
    used = np.zeros((keys, racks), bool)
    every = np.arange(keys)
    for p in range(WIDTH):
        distance = np.where(used, WIDTH + 1, (arc - p) % WIDTH)
        nearest = distance == distance.min(axis=1, keepdims=True)
        pick = np.argmax(np.where(nearest[:, rack_of], node_scores[p], -1.0), axis=1)
        out[:, p] = pick
        used[every, rack_of[pick]] = True
    return out


def _rack_best(scores: Scores, rack_of: Rows, racks: int) -> tuple[Scores, Rows]:
    """Per key and rack: the best node score in the rack and that node (-1.0 and 0 for an
    empty rack)."""
    keys = scores.shape[0]
    best = np.full((keys, racks), -1.0)
    node = np.zeros((keys, racks), np.int64)
    for r in range(racks):
        members = np.flatnonzero(rack_of == r)
        if len(members):
            j = scores[:, members].argmax(axis=1)
            best[:, r] = scores[np.arange(keys), members[j]]
            node[:, r] = members[j]
    return best, node


def _preferences(rack_scores: Scores, racks: int) -> Scores:
    """Per key, rack and shard index: how much the rack wants the index, (keys, racks, W)."""
    return np.moveaxis(rack_scores[:, :, :racks], 0, 2)


def rank_then_label(node_scores: Scores, rack_scores: Scores, rack_of: Rows, racks: int) -> Rows:
    keys = node_scores.shape[1]
    best, node = _rack_best(node_scores[0], rack_of, racks)
    ranked = np.argsort(-best, axis=1)[:, :WIDTH]
    prefs = _preferences(rack_scores, racks)
    out = np.zeros((keys, WIDTH), np.int64)
    taken = np.zeros((keys, WIDTH), bool)
    every = np.arange(keys)
    for rank in range(WIDTH):
        rack = ranked[:, rank]
        label = np.argmax(np.where(taken, -1.0, prefs[every, rack]), axis=1)
        taken[every, label] = True
        out[every, label] = node[every, rack]
    return out


def _by_labels(
    node_scores: Scores, rack_of: Rows, racks: int, candidate: npt.NDArray[np.bool_], shared: bool
) -> Rows:
    """Each index in turn takes the best rack among its ``candidate`` racks not used yet
    (by its own node scores, or position 0's when ``shared``); an index with none, the
    best rack left."""
    keys = node_scores.shape[1]
    out = np.full((keys, WIDTH), -1, np.int64)
    used = np.zeros((keys, racks), bool)
    every = np.arange(keys)
    tops = [_rack_best(node_scores[0 if shared else p], rack_of, racks) for p in range(WIDTH)]
    for p in range(WIDTH):
        best, node = tops[p]
        score = np.where(candidate[:, :, p] & ~used, best, -2.0)
        rack = score.argmax(axis=1)
        ok = score[every, rack] > -1.5
        out[ok, p] = node[every[ok], rack[ok]]
        used[every[ok], rack[ok]] = True
    for p in range(WIDTH):
        empty = np.flatnonzero(out[:, p] < 0)
        if len(empty):
            best, node = tops[p]
            rack = np.where(used[empty], -2.0, best[empty]).argmax(axis=1)
            out[empty, p] = node[empty, rack]
            used[empty, rack] = True
    return out


def home_labels(node_scores: Scores, rack_scores: Scores, rack_of: Rows, racks: int) -> Rows:
    prefs = _preferences(rack_scores, racks)
    home = prefs.argmax(axis=2)
    candidate = home[:, :, None] == np.arange(WIDTH)[None, None, :]
    return _by_labels(node_scores, rack_of, racks, candidate, shared=True)


def two_home_labels(node_scores: Scores, rack_scores: Scores, rack_of: Rows, racks: int) -> Rows:
    prefs = _preferences(rack_scores, racks)
    top2 = np.argsort(-prefs, axis=2)[:, :, :2]
    labels = np.arange(WIDTH)[None, None, :]
    candidate = (top2[:, :, :1] == labels) | (top2[:, :, 1:] == labels)
    return _by_labels(node_scores, rack_of, racks, candidate, shared=False)


RULES: dict[str, Callable[[Scores, Scores, Rows, int], Rows]] = {
    "per-position": per_position,
    "two-level": two_level,
    "set-then-index": set_then_index,
    "rack-arcs": rack_arcs,
    "rank-then-label": rank_then_label,
    "home-labels": home_labels,
    "two-home-labels": two_home_labels,
}


def measure(
    rule: str, *, keys: int, nodes: int, racks: int, seed: int
) -> tuple[float, float, float]:
    """(moved / ideal on a join into rack 0, the same on a join as a new rack's first node,
    max / mean shards per node before)."""
    rng = np.random.default_rng(seed)
    place = RULES[rule]
    node_scores = rng.random((WIDTH, keys, nodes + 1))
    rack_scores = rng.random((WIDTH, keys, racks + 1))
    rack_of = np.arange(nodes, dtype=np.int64) % racks
    before = place(node_scores[:, :, :nodes], rack_scores, rack_of, racks)
    ideal = keys * WIDTH / (nodes + 1)
    joined = place(node_scores, rack_scores, np.append(rack_of, 0), racks)
    new_rack = place(node_scores, rack_scores, np.append(rack_of, racks), racks + 1)
    load = np.bincount(before.ravel(), minlength=nodes)
    return (
        float((before != joined).sum() / ideal),
        float((before != new_rack).sum() / ideal),
        float(load.max() / load.mean()),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=8000)
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--racks", type=int, default=25)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    print(f"{args.nodes} nodes in {args.racks} racks, {args.keys} keys, width {WIDTH}; "
          f"ideal = keys x width / (nodes + 1) = {args.keys * WIDTH / (args.nodes + 1):.0f} "
          "shards")  # fmt: skip
    print(
        "| rule | node join: moved / ideal, per seed | rack join (its first node) | max / mean load |"
    )
    print("|---|---|---|---|")
    for rule in RULES:
        runs = [
            measure(rule, keys=args.keys, nodes=args.nodes, racks=args.racks, seed=s)
            for s in range(1, args.seeds + 1)
        ]
        joins = ", ".join(f"{r[0]:.2f}" for r in runs)
        rack_joins = ", ".join(f"{r[1]:.2f}" for r in runs)
        spread = ", ".join(f"{r[2]:.2f}" for r in runs)
        print(f"| `{rule}` | {joins} | {rack_joins} | {spread} |")


if __name__ == "__main__":
    main()
