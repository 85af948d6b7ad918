"""Pure read-path logic: prefix matching from HAS answers and choosing which shards
to ask whom. No sockets here.

Arrays, not loops: a load of hundreds of blocks is planned with a handful of
numpy operations per node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.keys import BlockKey

__all__ = [
    "HeldShards",
    "MatchResult",
    "ReadPlan",
    "best_counts",
    "match_from_held",
    "plan_reads",
]

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class HeldShards:
    """One node's HAS answer: for request item ``ordinal``, it holds ``index`` of ``stripe``."""

    node: int
    ordinal: IntArray
    index: IntArray
    stripe: npt.NDArray[np.uint64]


@dataclass(frozen=True, slots=True)
class MatchResult:
    """Which leading blocks of a prompt are in the cluster, and where their shards are.

    ``holders[b, i]`` is the node (index into the client's node list) holding
    shard ``i`` of block ``b``'s chosen stripe, or -1. ``best_count[b]`` is the
    number of shards of the best stripe of block ``b`` found, for every block
    (hit or not).
    """

    keys: list[BlockKey]
    hit_blocks: int
    tokens_per_block: int
    stripe: npt.NDArray[np.uint64]
    holders: IntArray
    best_count: IntArray

    @classmethod
    def known(cls, keys: Sequence[BlockKey], *, n: int, tokens_per_block: int = 1) -> MatchResult:
        """Blocks the caller knows are stored (it wrote them, or an engine's scheduler
        matched them): a load of this asks placement's holders for any stripe, with no HAS
        round first, and settles on each block's stripe from the shards that arrive."""
        count = len(keys)
        return cls(
            keys=list(keys),
            hit_blocks=count,
            tokens_per_block=tokens_per_block,
            stripe=np.zeros(count, np.uint64),
            holders=np.full((count, n), -1, np.int64),
            best_count=np.full(count, n, np.int64),
        )

    @property
    def hit_tokens(self) -> int:
        """Tokens covered by the hit blocks."""
        return self.hit_blocks * self.tokens_per_block


def _stripe_groups(
    held: Sequence[HeldShards], count: int, n: int
) -> tuple[IntArray, IntArray, npt.NDArray[np.uint64], IntArray, IntArray, IntArray]:
    """Every distinct (block, stripe, index) answer, sorted, and its (block, stripe) group;
    stripes of another erasure layout left out."""
    parts = [h for h in held if len(h.ordinal)]
    if not parts or count == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, np.zeros(0, np.uint64), empty, empty, empty
    ordinal = np.concatenate([h.ordinal for h in parts])
    index = np.concatenate([h.index for h in parts])
    stripe = np.concatenate([h.stripe for h in parts])
    node = np.concatenate([np.full(len(h.ordinal), h.node, np.int64) for h in parts])
    in_range = (ordinal >= 0) & (ordinal < count)
    valid = in_range & (index >= 0) & (index < n)
    over = in_range & (index >= n)
    if over.any():
        # A stripe with a shard index of k + m or more was written with another erasure
        # layout (10 + 4 seen by a 10 + 2 client): its headers name other k and m, so this
        # client can never read it. It counts as absent, whatever its shards below k + m.
        foreign = set(zip(ordinal[over].tolist(), stripe[over].tolist(), strict=True))
        valid &= np.fromiter(
            ((o, s) not in foreign for o, s in zip(ordinal.tolist(), stripe.tolist(), strict=True)),
            bool,
            len(ordinal),
        )
    ordinal, index, stripe, node = ordinal[valid], index[valid], stripe[valid], node[valid]
    # Each node answers in (ordinal, index) order: a stable sort of the concatenated runs
    # on one combined key is a merge, far cheaper than a three-key lexsort. Blocks with
    # shards of two stripes (a race; rare) need the stripe in the key: then lexsort.
    order = np.argsort(ordinal * 256 + index, kind="stable")
    ordinal, index, stripe, node = ordinal[order], index[order], stripe[order], node[order]
    if len(ordinal) > 1 and ((ordinal[1:] == ordinal[:-1]) & (stripe[1:] != stripe[:-1])).any():
        order = np.lexsort((index, stripe, ordinal))
        ordinal, index, stripe, node = ordinal[order], index[order], stripe[order], node[order]
    dup = np.zeros(len(ordinal), bool)
    dup[1:] = (
        (ordinal[1:] == ordinal[:-1]) & (stripe[1:] == stripe[:-1]) & (index[1:] == index[:-1])
    )
    ordinal, index, stripe, node = ordinal[~dup], index[~dup], stripe[~dup], node[~dup]
    start = np.ones(len(ordinal), bool)
    start[1:] = (ordinal[1:] != ordinal[:-1]) | (stripe[1:] != stripe[:-1])
    group = np.cumsum(start) - 1
    return ordinal, index, stripe, node, group, np.flatnonzero(start)


def best_counts(held: Sequence[HeldShards], count: int, *, n: int) -> IntArray:
    """Per block: shards of its best-represented stripe among the answers."""
    ordinal, _index, _stripe, _node, group, starts = _stripe_groups(held, count, n)
    best = np.zeros(count, np.int64)
    if len(ordinal):
        np.maximum.at(best, ordinal[starts], np.bincount(group))
    return best


def match_from_held(
    keys: list[BlockKey],
    held: Sequence[HeldShards],
    *,
    k: int,
    n: int,
    tokens_per_block: int,
) -> MatchResult:
    """The longest run of blocks from the first with >= k shards of one stripe."""
    count = len(keys)
    ordinal, index, stripe, node, group, starts = _stripe_groups(held, count, n)
    if not len(ordinal):
        return MatchResult(
            keys, 0, tokens_per_block, np.zeros(0, np.uint64), np.zeros((0, n), np.int64),
            np.zeros(count, np.int64),
        )  # fmt: skip
    sizes = np.bincount(group)
    group_block = ordinal[starts]
    group_stripe = stripe[starts]
    best_count = np.zeros(count, np.int64)
    np.maximum.at(best_count, group_block, sizes)
    # First group reaching the best count wins per block (ties: lowest stripe id).
    is_best = sizes == best_count[group_block]
    chosen = np.full(count, -1, np.int64)
    best_groups = np.nonzero(is_best)[0]
    chosen[group_block[best_groups[::-1]]] = best_groups[::-1]
    enough = best_count >= k
    hit = count if enough.all() else int(np.argmin(enough))
    holders = np.full((hit, n), -1, np.int64)
    in_hit = (ordinal < hit) & (chosen[np.minimum(ordinal, count - 1)] == group)
    holders[ordinal[in_hit], index[in_hit]] = node[in_hit]
    chosen_stripe = np.zeros(hit, np.uint64)
    if hit:
        chosen_stripe[:] = group_stripe[chosen[:hit]]
    return MatchResult(keys, hit, tokens_per_block, chosen_stripe, holders, best_count)


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """Shards to ask first (``first``) and to ask once the hedge deadline passes (``later``).

    Each is a list of (node, blocks, indices) with one entry per node.
    """

    first: list[tuple[int, IntArray, IntArray]]
    later: list[tuple[int, IntArray, IntArray]]


def plan_reads(
    holders: IntArray,
    node_up: npt.NDArray[np.bool_],
    *,
    k: int,
    spare: int = 1,
    unlikely: npt.NDArray[np.bool_] | None = None,
    general: bool = False,
    first_block: int = 0,
) -> ReadPlan:
    """Ask k + ``spare`` shards per block: the data shards first, then rotating parity.

    Shards on nodes believed down go last, and before them the ``unlikely`` ones
    (same shape as ``holders``: a guessed holder, such as the stand-in for a down
    node, that the match did not see holding the shard); every shard not asked
    first is kept for the hedge. ``general``: never the shortcut for a load whose
    holders are all known and up (tests hold the two equal). Blocks are numbered from
    ``first_block`` (row 0 of ``holders``).
    """
    blocks, n = holders.shape
    if blocks == 0:
        return ReadPlan([], [])
    m = n - k
    # Preference order per block: data 0..k-1, then parity rotated by block number.
    rot = (np.arange(blocks)[:, None] + np.arange(m)[None, :]) % max(m, 1) + k
    order = np.concatenate([np.broadcast_to(np.arange(k), (blocks, k)), rot], axis=1)
    rows = np.arange(blocks)[:, None]
    node = holders[rows, order]
    present = node >= 0
    up = present & node_up[np.maximum(node, 0)]
    block_ids = np.broadcast_to(np.arange(first_block, first_block + blocks)[:, None], (blocks, n))
    if not general and up.all() and (unlikely is None or not unlikely.any()):
        # Every holder known and up (a healthy load): the preference order stands as it is.
        cut = min(k + spare, n)
        return ReadPlan(
            _by_node(node[:, :cut].ravel(), block_ids[:, :cut].ravel(), order[:, :cut].ravel()),
            _by_node(node[:, cut:].ravel(), block_ids[:, cut:].ravel(), order[:, cut:].ravel()),
        )
    # Rank: present-and-up first (in preference order), then unlikely ones, then down.
    likely = up if unlikely is None else up & ~unlikely[rows, order]
    rank = np.where(likely, 0, np.where(up, 1, np.where(present, 2, 3)))
    rank_key = rank * n + np.arange(n)[None, :]
    ranked = np.argsort(rank_key, axis=1, kind="stable")
    sorted_idx = order[rows, ranked]
    sorted_node = node[rows, ranked]
    sorted_present = present[rows, ranked]
    take = np.zeros((blocks, n), bool)
    take[:, : k + spare] = True
    first_mask = take & sorted_present
    later_mask = ~take & sorted_present
    return ReadPlan(
        _by_node(sorted_node[first_mask], block_ids[first_mask], sorted_idx[first_mask]),
        _by_node(sorted_node[later_mask], block_ids[later_mask], sorted_idx[later_mask]),
    )


def _by_node(
    node: IntArray, blocks: IntArray, indices: IntArray
) -> list[tuple[int, IntArray, IntArray]]:
    if not len(node):
        return []
    order = np.argsort(node, kind="stable")
    node = node[order]
    blocks = blocks[order].astype(np.int64, copy=False)
    indices = indices[order].astype(np.int64, copy=False)
    # Slices at the node boundaries (np.split's Python loop cost more than the rest).
    bounds = [0, *(np.flatnonzero(node[1:] != node[:-1]) + 1).tolist(), len(node)]
    firsts = node[bounds[:-1]].tolist()
    return [
        (nd, blocks[a:b], indices[a:b])
        for nd, a, b in zip(firsts, bounds[:-1], bounds[1:], strict=True)
    ]
