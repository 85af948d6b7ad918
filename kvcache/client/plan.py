"""Pure read-path logic: prefix matching from HAS answers, choosing which shards
to ask whom, and assembling GET replies into stripes. No sockets here.

Arrays, not loops: a load of hundreds of blocks is planned and assembled with a
handful of numpy operations per node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from kvcache.erasure import Codec
from kvcache.errors import ErasureError
from kvcache.keys import BlockKey
from kvcache.shard import HEADER_BYTES, HEADER_DTYPE, MAGIC, VERSION

__all__ = [
    "HeldShards",
    "MatchResult",
    "ReadPlan",
    "StripeAssembly",
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

    @property
    def hit_tokens(self) -> int:
        """Tokens covered by the hit blocks."""
        return self.hit_blocks * self.tokens_per_block


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
    parts = [h for h in held if len(h.ordinal)]
    if not parts or count == 0:
        return MatchResult(
            keys, 0, tokens_per_block, np.zeros(0, np.uint64), np.zeros((0, n), np.int64),
            np.zeros(count, np.int64),
        )  # fmt: skip
    ordinal = np.concatenate([h.ordinal for h in parts])
    index = np.concatenate([h.index for h in parts])
    stripe = np.concatenate([h.stripe for h in parts])
    node = np.concatenate([np.full(len(h.ordinal), h.node, np.int64) for h in parts])
    valid = (ordinal >= 0) & (ordinal < count) & (index >= 0) & (index < n)
    ordinal, index, stripe, node = ordinal[valid], index[valid], stripe[valid], node[valid]
    # Count distinct shard indices per (block, stripe); keep the best stripe per block.
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
    sizes = np.bincount(group)
    group_block = ordinal[start]
    group_stripe = stripe[start]
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
    holders: IntArray, node_up: npt.NDArray[np.bool_], *, k: int, spare: int = 1
) -> ReadPlan:
    """Ask k + ``spare`` shards per block: the data shards first, then rotating parity.

    Shards on nodes believed down go last; every shard not asked first is kept
    for the hedge.
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
    # Rank: present-and-up first (in preference order), then present-but-down.
    rank_key = np.where(up, 0, np.where(present, 1, 2)) * n + np.arange(n)[None, :]
    ranked = np.argsort(rank_key, axis=1, kind="stable")
    sorted_idx = order[rows, ranked]
    sorted_node = node[rows, ranked]
    sorted_present = present[rows, ranked]
    take = np.zeros((blocks, n), bool)
    take[:, : k + spare] = True
    first_mask = take & sorted_present
    later_mask = ~take & sorted_present
    block_ids = np.broadcast_to(np.arange(blocks)[:, None], (blocks, n))
    return ReadPlan(
        _by_node(sorted_node[first_mask], block_ids[first_mask], sorted_idx[first_mask]),
        _by_node(sorted_node[later_mask], block_ids[later_mask], sorted_idx[later_mask]),
    )


def _by_node(
    node: IntArray, blocks: IntArray, indices: IntArray
) -> list[tuple[int, IntArray, IntArray]]:
    order = np.argsort(node, kind="stable")
    node, blocks, indices = node[order], blocks[order], indices[order]
    cuts = np.nonzero(np.diff(node))[0] + 1
    return [
        (int(nd[0]), bl.astype(np.int64), ix.astype(np.int64))
        for nd, bl, ix in zip(
            np.split(node, cuts), np.split(blocks, cuts), np.split(indices, cuts), strict=True
        )
        if len(nd)
    ]


class StripeAssembly:
    """Collects GET replies for a batch of blocks into one (blocks, n, L) stripe array."""

    def __init__(
        self,
        keys: Sequence[BlockKey],
        stripe: npt.NDArray[np.uint64],
        *,
        k: int,
        n: int,
        payload_len: int,
        shard_len: int,
    ) -> None:
        self.k, self.n = k, n
        self.payload_len = payload_len
        self.shard_len = shard_len
        blocks = len(keys)
        self.key_words = (
            np.frombuffer(b"".join(keys), dtype="V16") if blocks else np.zeros(0, "V16")
        )
        self.stripe = stripe
        self.stripes = np.empty((blocks, n, shard_len), np.uint8)
        self.got = np.zeros((blocks, n), bool)
        self.shard_hash = np.zeros((blocks, n), np.uint64)
        self.payload_hash = np.zeros(blocks, "V16")
        self.have_hash = np.zeros(blocks, bool)
        self.failed = np.zeros(blocks, bool)
        #: After finish(): the block that had enough shards but no bytes matching the
        #: writer's hash (a damaged stripe, not a missing one), else -1.
        self.corrupt = -1

    @property
    def blocks(self) -> int:
        """Blocks in this assembly."""
        return len(self.stripe)

    def add(
        self, blocks: IntArray, indices: IntArray, statuses: npt.NDArray[np.uint8], data: memoryview
    ) -> int:
        """Take one node's GET reply for shards (blocks[j], indices[j]); returns shards accepted.

        Records that are not exactly the shard asked for (key, stripe, index,
        sizes, magic, version) are ignored, so they count as missing.
        """
        ok = statuses == 0
        rec_len = HEADER_BYTES + self.shard_len
        count = int(ok.sum())
        if count == 0 or len(data) != count * rec_len:
            return 0
        recs = np.frombuffer(data, np.uint8).reshape(count, rec_len)
        hdr = recs[:, :HEADER_BYTES].copy().view(HEADER_DTYPE).reshape(count)
        b, i = blocks[ok], indices[ok]
        good = (
            (hdr["magic"] == MAGIC)
            & (hdr["version"] == VERSION)
            & (hdr["header_len"] == HEADER_BYTES)
            & (hdr["k"] == self.k)
            & (hdr["m"] == self.n - self.k)
            & (hdr["shard_index"] == i)
            & (hdr["payload_len"] == self.payload_len)
            & (hdr["shard_len"] == self.shard_len)
            & (hdr["stripe_id"] == self.stripe[b])
            & (hdr["block_key"] == self.key_words[b])
        )
        if not good.all():
            recs, hdr, b, i = recs[good], hdr[good], b[good], i[good]
        self.stripes[b, i] = recs[:, HEADER_BYTES:]
        self.got[b, i] = True
        self.shard_hash[b, i] = hdr["shard_hash"]
        fresh = ~self.have_hash[b]
        self.payload_hash[b[fresh]] = hdr["payload_hash"][fresh]
        self.have_hash[b] = True
        return len(b)

    def complete(self) -> npt.NDArray[np.bool_]:
        """Per block: at least k shards arrived."""
        result: npt.NDArray[np.bool_] = self.got.sum(axis=1) >= self.k
        return result

    def finish(self, codec: Codec) -> int:
        """Rebuild and verify blocks in order; returns how many leading blocks are good.

        A block is good when its payload's XXH3-128 equals the writer's hash. A
        block that fails is retried without the shards whose own checksum fails;
        the first block that cannot be rebuilt ends the prefix.
        """
        k = self.k
        got = self.got
        complete = got.sum(axis=1) >= k
        limit = self.blocks if complete.all() else int(np.argmin(complete))
        self._rebuild(codec, np.arange(limit))
        good = 0
        for b in range(limit):
            if self.failed[b] or (not self._verified(b) and not self._repair(codec, b)):
                self.corrupt = b
                break
            good += 1
        return good

    def payload(self, b: int) -> npt.NDArray[np.uint8]:
        """Zero-copy view of block ``b``'s payload."""
        view: npt.NDArray[np.uint8] = self.stripes[b, : self.k].reshape(-1)[: self.payload_len]
        return view

    def _verified(self, b: int) -> bool:
        digest = xxhash.xxh3_128_digest(self.payload(b).data)
        return bool(self.have_hash[b]) and digest == self.payload_hash[b].tobytes()

    def _rebuild(self, codec: Codec, blocks: IntArray) -> None:
        k = self.k
        need = blocks[~self.got[blocks, :k].all(axis=1)]
        if len(need) == 0:
            return
        # Use the first k shards present; one codec call per erasure pattern, in place.
        patterns: dict[tuple[int, ...], list[int]] = {}
        for b in need.tolist():
            present = tuple(np.nonzero(self.got[b])[0][:k].tolist())
            patterns.setdefault(present, []).append(b)
        for present, group in patterns.items():
            try:
                codec.reconstruct(self.stripes, present, blocks=group)
            except ErasureError:
                self.failed[group] = True

    def _repair(self, codec: Codec, b: int) -> bool:
        """Drop shards of block b that fail their own checksum and rebuild from the rest."""
        rows = self.stripes[b]
        ok = np.array(
            [
                bool(self.got[b, i])
                and xxhash.xxh3_64_intdigest(rows[i]) == int(self.shard_hash[b, i])
                for i in range(self.n)
            ]
        )
        if ok.sum() < self.k:
            return False
        present = tuple(np.nonzero(ok)[0][: self.k].tolist())
        sub = self.stripes[b : b + 1].copy()
        try:
            codec.reconstruct(sub, present, rows=[i for i in range(self.k) if i not in present])
        except ErasureError:
            return False
        self.stripes[b, : self.k] = sub[0, : self.k]
        return self._verified(b)
