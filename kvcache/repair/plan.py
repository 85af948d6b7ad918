"""What each block lacks and where its shards go: the repairer's decisions. No I/O.

Input: for each key, what every node listed of it (:class:`~.listing.Held`),
and the key's write targets under the current map (shard ``i`` to
``targets[i]``, as a writer would place it, -1 where none). Output per key:

* **complete**: every target holds its shard of the block's stripe;
* **repair**: at least k distinct shards of the stripe exist somewhere
  (``sources``: one node per index, the target first when it holds it) and
  some targets lack theirs (``writes``: index, node, and the stripe the node
  holds there instead, which the PUT names in ``expect`` so the daemon may
  replace it);
* **unrecoverable**: fewer than k distinct shards of any stripe are left:
  nothing can rebuild it (the next store of the block rewrites it);
* **waiting**: nothing can be written now (a target is down, or -1: more
  holders down than writes may redirect past), yet some target lacks its
  shard: not complete, and nothing of it is pruned;
* ``strays``: shards of the stripe on nodes that are not their index's target
  (drained, out or spill nodes, holders under an old map), which may be
  deleted once the target holds a copy (only for complete blocks).

Copies whose header gives another payload length than most copies of the stripe
are not used (a damaged header must not decide the block's length), and their
indices are rewritten like missing ones.

The stripe chosen for a key is the one with the most distinct shard indices
(ties: the larger stripe id, so every run decides alike). Shards of other
stripes are left alone: a writer may be in the middle of storing one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvcache.repair.listing import Held

__all__ = ["BlockPlan", "Plan", "plan_blocks"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockPlan:
    """One block to repair."""

    key: bytes
    stripe: int
    payload_len: int
    #: (index, node) one readable copy per index held.
    sources: tuple[tuple[int, int], ...]
    #: (index, node, expect): the shards to write, and the stripe the node holds at that
    #: index instead (0: none).
    writes: tuple[tuple[int, int, int], ...]
    #: (index, node): copies of the stripe's shards off their targets.
    strays: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class Plan:
    """The decisions for a batch of keys."""

    repairs: list[BlockPlan] = field(default_factory=list)
    complete: int = 0
    unrecoverable: list[bytes] = field(default_factory=list)
    #: Shards not written because their target cannot take them now (-1 or unreachable).
    deferred: int = 0
    #: Blocks complete on their targets that still have copies elsewhere (prunable).
    stray_only: list[BlockPlan] = field(default_factory=list)
    #: Blocks with nothing to write now but short on their targets (a target down or -1):
    #: neither complete nor prunable.
    waiting: int = 0


def plan_blocks(
    held: Sequence[tuple[bytes, Sequence[Held]]],
    targets: npt.NDArray[np.int64],
    *,
    k: int,
    writable: npt.NDArray[np.bool_] | None = None,
) -> Plan:
    """Decide, for each (key, what nodes hold) of ``held``, what to do; ``targets`` is
    (keys, n) in the same order; ``writable[node]`` says a node may be written now."""
    plan = Plan()
    n = targets.shape[1] if targets.ndim == 2 else 0
    if len(held) != len(targets):
        raise ValueError(f"{len(held)} keys but {len(targets)} rows of targets")
    for (key, shards), row in zip(held, targets.tolist(), strict=True):
        if not shards:
            continue
        by_stripe: dict[int, dict[int, list[Held]]] = {}
        for h in shards:
            if 0 <= h.index < n:
                by_stripe.setdefault(h.stripe, {}).setdefault(h.index, []).append(h)
        if not by_stripe:
            plan.unrecoverable.append(key)
            continue
        stripe = max(by_stripe, key=lambda s: (len(by_stripe[s]), s))
        copies, payload_len = _agreeing(by_stripe[stripe])
        if len(copies) < k:
            plan.unrecoverable.append(key)
            continue
        other = {(h.node, h.index): h.stripe for h in shards if h.stripe != stripe}
        sources = []
        for index in sorted(copies):
            nodes = [h.node for h in copies[index]]
            sources.append((index, row[index] if row[index] in nodes else nodes[0]))
        writes = []
        deferred = 0
        for index, node in enumerate(row):
            if index in copies and node in [h.node for h in copies[index]]:
                continue
            if node < 0 or (writable is not None and not writable[node]):
                deferred += 1
                continue
            writes.append((index, node, other.get((node, index), 0)))
        plan.deferred += deferred
        # A copy is a stray only beside its index's target (never where the target is -1:
        # with more holders down than writes may redirect past, every position is -1).
        strays = tuple(
            (index, h.node)
            for index in sorted(copies)
            for h in copies[index]
            if row[index] >= 0 and h.node != row[index]
        )
        block = BlockPlan(
            key=key,
            stripe=stripe,
            payload_len=payload_len,
            sources=tuple(sources),
            writes=tuple(writes),
            strays=strays,
        )
        if writes:
            plan.repairs.append(block)
        elif deferred:
            # Short of a shard whose target cannot take it now: not complete, and its copies
            # elsewhere may be the only ones left, so none is pruned.
            plan.waiting += 1
        else:
            plan.complete += 1
            if strays:
                plan.stray_only.append(block)
    return plan


def _agreeing(copies: dict[int, list[Held]]) -> tuple[dict[int, list[Held]], int]:
    """The copies of a stripe whose headers agree on the payload length most of them give,
    and that length: one damaged header (a flipped bit in ``payload_len``) must not decide
    the block's length, nor be used as a source (it is rewritten like a missing copy)."""
    counts: dict[int, int] = {}
    for held in copies.values():
        for h in held:
            counts[h.payload_len] = counts.get(h.payload_len, 0) + 1
    length = max(counts, key=lambda n: (counts[n], -n))
    agreeing = {
        index: kept
        for index, held in copies.items()
        if (kept := [h for h in held if h.payload_len == length])
    }
    return agreeing, length
