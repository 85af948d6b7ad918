"""Placement: which nodes hold a block's shards — a pure function of (cluster map, key).

**By the key's placement tag.** Only a key's first :data:`~kvcache.keys.PLACEMENT_TAG_BYTES`
bytes choose its nodes: the blocks of one placement group of a prompt share them
(``docs/spec/hashing.md``), and so their holders; which of those holders takes which
shard is turned per key (:meth:`Placement.rotations`), so a group's data shards are spread
over all of them. A call for a
prompt's blocks then asks about a dozen nodes per group (about 8 MiB of blocks) however
many nodes the cluster has (issue 21), and a group's rows are computed once.

**Sequential per-position rendezvous.** Position ``p`` of a key (a shard
holder for ``p < width``: shard ``i`` at position ``(i + r) mod width``, ``r`` the key's
rotation; spill positions after that) goes to the node with the
highest weighted rendezvous score ``-weight / ln(u)``, where ``u`` is uniform in
(0, 1) and derived from (key, node, p), among the nodes still *eligible* for it:

1. nodes holding the fewest positions of this key so far (no node holds two
   while another holds none);
2. among those, nodes whose failure domain holds the fewest positions so far
   (a host with three daemons in a cluster of four hosts gets 3 of 12 shards,
   never 5).

With every node in its own domain (the default) this is: position 0 to the
best node for position 0, position 1 to the best remaining node for position
1, and so on. Why per position and not "shard i to the i-th best node": a
join then moves only the shards whose position the new node wins, plus rarely
one more it displaces, instead of shifting every shard ranked below it. Over
12 → 13 nodes the per-position rule remapped 2.2 shards per key against 6.0
for rank order (the set of holders changes by one node either way); over 16
→ 17, 1.2 against 4.6 (a 3,000-key simulation; ``tests/test_placement.py``
holds the bound). Fewer remapped shards means fewer shards for the repairer
to move and fewer (key, index) slots on which two writers that placed under
different map epochs disagree (``docs/spec/shard-layout.md``, section 6).

**Spill positions.** Positions ``width .. width + spill - 1`` continue the same
sequence: they are the key's next nodes in rendezvous order. A writer that
finds a holder down sends that holder's shard to the next live spill node
(:func:`write_targets`); readers ask the same nodes.

Scores are computed for whole batches of keys at once with numpy (one pass
per position over a (keys, nodes) array).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import xxhash

from kvcache.cluster import ClusterMap, NodeInfo, NodeState
from kvcache.errors import ConfigError
from kvcache.keys import KEY_BYTES, PLACEMENT_TAG_BYTES, BlockKey

__all__ = [
    "NODE_TAG",
    "POSITION_TAG",
    "Placement",
    "holders_for",
    "max_redirect",
    "write_targets",
    "write_targets_many",
]

NODE_TAG = b"kvcache:node:v1\x00"
POSITION_TAG = b"kvcache:position:v1\x00"
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
#: Default spill depth: positions past the stripe width a placement computes.
DEFAULT_SPILL = 4
#: Placement tags whose rows one Placement remembers (about 100 bytes each).
_CACHE_KEYS = 1 << 17
#: (position, key, node) scores computed in one pass (8 MiB per temporary array).
_CHUNK_PAIRS = 1 << 20
IntArray = npt.NDArray[np.int64]


# A key's placement tag is its first 32-bit word (what :func:`_words_of` reads as word 0).
assert PLACEMENT_TAG_BYTES == 4, "placement reads a key's tag as one 32-bit word"


def _words_of(keys: Sequence[BlockKey]) -> npt.NDArray[np.uint32]:
    """The keys as rows of little-endian 32-bit words: word 0 is the placement tag
    (:data:`~kvcache.keys.PLACEMENT_TAG_BYTES`), word 1 the rotation's source."""
    if any(len(k) != KEY_BYTES for k in keys):
        raise ConfigError(f"block keys must be {KEY_BYTES} bytes")
    return np.frombuffer(b"".join(keys), dtype="<u4").reshape(-1, KEY_BYTES // 4)


def _mix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finaliser, elementwise (wrapping uint64 arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def max_redirect(*, n: int, min_write: int) -> int:
    """Most shards of one block a writer may place off their holders (down holders,
    failed sends): ``floor((2 q - n - 1) / 2)`` with q = ``min_write``.

    Two writers of one block can both reach q shards only if q_A + q_B <= n + d,
    where d counts the shard indices they send to different nodes. Each writer
    redirects at most this many, so d <= 2 * max_redirect < 2 q - n and at most one
    of them is acknowledged (``docs/spec/shard-layout.md``, section 6). 4 for 10+2
    with q = 11; 3 with q = 10.
    """
    return max(0, (2 * min_write - n - 1) // 2)


class Placement:
    """Precomputed placement over one cluster map's placeable nodes.

    ``states`` are the node states that take placements (default: up only; a
    reader also asks nodes being drained, through a second placement with
    ``states=(UP, DRAIN)``). Node indices returned are into :attr:`nodes`.
    """

    def __init__(
        self,
        cluster: ClusterMap,
        *,
        width: int,
        spill: int = DEFAULT_SPILL,
        states: tuple[NodeState, ...] = (NodeState.UP,),
    ) -> None:
        if width < 1:
            raise ConfigError(f"placement width must be >= 1, got {width}")
        if spill < 0:
            raise ConfigError(f"placement spill must be >= 0, got {spill}")
        nodes = tuple(n for n in cluster.nodes if n.state in states)
        if not nodes:
            raise ConfigError("no node in the cluster map is up for placement")
        self.cluster = cluster
        self.width = width
        self.spill = spill
        self.nodes: tuple[NodeInfo, ...] = nodes
        self.ids = tuple(n.id for n in nodes)
        self._seeds = np.array(
            [xxhash.xxh3_64_intdigest(NODE_TAG + n.id.encode()) for n in nodes], dtype=np.uint64
        )
        self._weights = np.array([float(n.weight) for n in nodes], dtype=np.float64)
        domains = [n.domain for n in nodes]
        self.domain_names = sorted(set(domains))
        number = {d: i for i, d in enumerate(self.domain_names)}
        self.domain_of = np.array([number[d] for d in domains], np.int64)
        self._distinct_domains = len(self.domain_names) == len(nodes)
        self._equal_weights = bool(np.all(self._weights == self._weights[0]))
        # Placement rows remembered per key: key -> slot of ``_table``.
        self._slot: dict[int, int] = {}
        self._table = np.zeros((0, width + spill), np.int64)
        self._used = 0
        self._lock = threading.Lock()
        self._salts = np.array(
            [
                xxhash.xxh3_64_intdigest(POSITION_TAG + p.to_bytes(2, "little"))
                for p in range(width + spill)
            ],
            dtype=np.uint64,
        )

        # Per rotation r, the column order of a row turned by r: its first ``width``
        # positions turned, its spill positions as they are.
        depth = width + spill
        self._turns = np.array(
            [[(i + r) % width if i < width else i for i in range(depth)] for r in range(width)],
            np.int64,
        )

    @property
    def depth(self) -> int:
        """Positions per key that :meth:`order` returns (width + spill)."""
        return self.width + self.spill

    def _key_words(self, keys: Sequence[BlockKey]) -> npt.NDArray[np.uint64]:
        """Each key's placement word: its placement tag, mixed (the rest of the key is
        not looked at, so a group's keys place alike)."""
        return _mix64(_words_of(keys)[:, 0].astype(np.uint64))

    def scores(self, keys: Sequence[BlockKey], position: int = 0) -> npt.NDArray[np.float64]:
        """Rendezvous scores of every node for ``position`` of each key, shape (keys, nodes)."""
        if not keys:
            return np.zeros((0, len(self.nodes)))
        key_word = self._key_words(keys)
        mixed = _mix64((key_word ^ self._salts[position])[:, None] ^ self._seeds[None, :])
        unit = ((mixed >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))
        scores: npt.NDArray[np.float64] = -self._weights[None, :] / np.log(unit)
        return scores

    def pair_scores(
        self, keys: Sequence[BlockKey], nodes: Sequence[int] | IntArray, position: int = 0
    ) -> npt.NDArray[np.float64]:
        """The score of node ``nodes[j]`` for ``position`` of ``keys[j]``, per j: the
        entries of :meth:`scores` one at a time, O(1) per pair (the simulator uses it to
        find, without placing every key again, the keys a joining node can take)."""
        if len(keys) != len(nodes):
            raise ConfigError(f"{len(keys)} keys but {len(nodes)} nodes")
        if not keys:
            return np.zeros(0)
        which = np.asarray(nodes, np.int64)
        key_word = self._key_words(keys)
        mixed = _mix64((key_word ^ self._salts[position]) ^ self._seeds[which])
        unit = ((mixed >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))
        scores: npt.NDArray[np.float64] = -self._weights[which] / np.log(unit)
        return scores

    def order(self, keys: Sequence[BlockKey], depth: int | None = None) -> IntArray:
        """Node per key and column, shape (len(keys), depth): column ``i < width`` is the
        holder of shard ``i`` (the key's rendezvous positions turned by its rotation:
        :meth:`positions` has them unturned), the rest spill positions (see the module
        docstring).

        With fewer nodes than positions, nodes hold several positions, as evenly
        as the rules allow. Rows are remembered per placement tag (a bounded cache: a
        prompt's keys are placed by its match, its load and its store, and shared
        prefixes by every request that has them).
        """
        depth = self.depth if depth is None else depth
        if not 0 < depth <= self.depth:
            raise ConfigError(f"placement depth must lie in 1..{self.depth}, got {depth}")
        count = len(keys)
        if count == 0:
            return np.zeros((0, depth), np.int64)
        rows = self._rows_of(keys)
        return rows[:, :depth] if depth < self.depth else rows

    def positions(self, keys: Sequence[BlockKey]) -> IntArray:
        """Node per key and rendezvous position, full depth, before :meth:`order` turns the
        first ``width`` by the key's rotation (what the rules of the module docstring
        decide, position by position)."""
        if not keys:
            return np.zeros((0, self.depth), np.int64)
        return self._rows_of(keys, turned=False)

    def _rows_of(self, keys: Sequence[BlockKey], *, turned: bool = True) -> IntArray:
        """Full-depth rows for ``keys``, from the cache (computed and added where missing),
        each key's first ``width`` positions turned by its :meth:`rotations`: one gather
        from the cache, of each key's row in its turn's column order."""
        words = _words_of(keys)
        depth = self.depth
        columns: IntArray
        if turned and self.width > 1:
            columns = self._turns.take(words[:, 1] % np.uint32(self.width), axis=0)
        else:
            columns = np.broadcast_to(self._turns[0], (len(keys), depth))
        tags = words[:, 0].tolist()
        with self._lock:
            slots = self._slots_locked(keys, tags)
            # A prompt's keys share one group as a rule: one slot for all of them.
            start = slots * depth if isinstance(slots, int) else (slots * depth)[:, None]
            rows: IntArray = self._table.take(columns + start)
        return rows

    def rotations(self, keys: Sequence[BlockKey]) -> IntArray:
        """Per key, how far its shards are turned over its group's ``width`` holders:
        shard ``i`` goes to the group's position ``(i + r) mod width``. ``r`` comes from
        the key's own bytes (4..7), so the keys of one placement group, which share their
        holders, spread their data and parity shards over all of them alike: without it,
        the same 10 nodes served every data shard of a group's load and 2 only parity,
        and a load's replies came in unequal sizes (at 12 daemons, 47 of 480 loads then
        waited for a late data holder's reply, against 1 of 480 before groups)."""
        return (_words_of(keys)[:, 1] % np.uint32(max(1, self.width))).astype(np.int64)

    def _slots_locked(self, keys: Sequence[BlockKey], tags: list[int]) -> int | IntArray:
        """Each key's slot in the row cache (``tags``: the keys' placement tags as
        integers), its group's row computed and added where missing; one slot when the
        keys share one tag."""
        slot_of = self._slot
        distinct = set(tags)
        missing = distinct.difference(slot_of)
        if missing:
            # One row per tag: a group's keys missing together are computed once.
            first: dict[int, int] = {}
            for i, tag in enumerate(tags):
                if tag in missing:
                    first.setdefault(tag, i)
            if self._used + len(first) > len(self._table):
                if self._used + len(first) > _CACHE_KEYS:
                    slot_of.clear()
                    self._used = 0
                    first = {}
                    for i, tag in enumerate(tags):
                        first.setdefault(tag, i)
                size = max(min(len(self._table) * 2, _CACHE_KEYS), self._used + len(first), 1024)
                table = np.zeros((size, self.depth), np.int64)
                table[: self._used] = self._table[: self._used]
                self._table = table
            computed = self._compute([keys[i] for i in first.values()])
            new = np.arange(self._used, self._used + len(first))
            self._table[new] = computed
            for tag, slot in zip(first, new.tolist(), strict=True):
                slot_of[tag] = slot
            self._used += len(first)
        if len(distinct) == 1:
            return slot_of[tags[0]]
        return np.fromiter(map(slot_of.__getitem__, tags), np.int64, len(tags))

    def _compute(self, keys: Sequence[BlockKey], *, general: bool = False) -> IntArray:
        """Rows for ``keys`` (``general``: never the one-domain-per-node shortcut; tests
        hold the two equal), computed :data:`_CHUNK_PAIRS` (position, key, node) scores
        at a time: the work is O(nodes) per key either way, but one (depth, keys, nodes)
        array for a 1M-token prompt's 7,813 keys over 10,000 nodes would be 15 GB, and
        past the CPU caches every pass over it runs at memory speed (``kvcache sim``:
        36 ms per key over 10,000 nodes in batches of 256, 4 ms in batches of 6)."""
        per_key = self.depth * len(self.nodes)
        chunk = max(1, _CHUNK_PAIRS // per_key)
        if len(keys) <= chunk:
            return self._compute_chunk(keys, general=general)
        return np.concatenate(
            [
                self._compute_chunk(keys[i : i + chunk], general=general)
                for i in range(0, len(keys), chunk)
            ]
        )

    def _compute_chunk(self, keys: Sequence[BlockKey], *, general: bool) -> IntArray:
        count, nodes, depth = len(keys), len(self.nodes), self.depth
        key_word = self._key_words(keys)
        # Every position's scores at once: (depth, keys, nodes).
        mixed = _mix64((key_word[None, :] ^ self._salts[:depth, None])[:, :, None] ^ self._seeds)
        scores: npt.NDArray[np.float64] | npt.NDArray[np.int64]
        if self._equal_weights:
            # -w / ln(u) grows with u: with one weight the top 53 bits order the nodes
            # exactly as the scores would (no logarithm per pair).
            scores = (mixed >> np.uint64(11)).astype(np.int64)
        else:
            unit = ((mixed >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))
            scores = -self._weights / np.log(unit)
        lowest = -1 if self._equal_weights else -np.inf
        out = np.zeros((count, depth), np.int64)
        rows = np.arange(count)
        if self._distinct_domains and not general:
            # One node per domain: the rule is "the best node not taken in this round"
            # (a round: until every node holds one more position).
            taken = np.zeros((count, nodes), bool)
            for p in range(depth):
                pick = np.argmax(np.where(taken, lowest, scores[p]), axis=1)
                out[:, p] = pick
                taken[rows, pick] = True
                if (p + 1) % nodes == 0:
                    taken[:] = False
            return out
        node_load = np.zeros((count, nodes), np.int64)
        domain_load = np.zeros((count, len(self.domain_names)), np.int64)
        big = nodes + 1
        for p in range(depth):
            # Eligible: fewest positions on the node, then fewest in its domain.
            rank = node_load * big + domain_load[:, self.domain_of]
            eligible = rank == rank.min(axis=1, keepdims=True)
            pick = np.argmax(np.where(eligible, scores[p], lowest), axis=1)
            out[:, p] = pick
            node_load[rows, pick] += 1
            domain_load[rows, self.domain_of[pick]] += 1
        return out

    def holders(self, keys: Sequence[BlockKey]) -> IntArray:
        """Node indices (into :attr:`nodes`) per key and shard, shape (len(keys), width).

        With fewer nodes than ``width``, one node holds several shards of a block.
        """
        return self.order(keys, self.width)


def write_targets(
    order: Sequence[int],
    live: Sequence[bool] | npt.NDArray[np.bool_],
    domain_of: Sequence[int] | npt.NDArray[np.int64],
    *,
    width: int,
    limit: int,
) -> tuple[list[int], int]:
    """Where a writer sends each shard of one key, given which nodes are live.

    ``order`` is the key's row of :meth:`Placement.order` (holders, then spill
    positions), ``live[x]`` / ``domain_of[x]`` per node index. Shard ``i`` goes to
    its holder ``order[i]`` when that is live; the shards of down holders go, in
    index order, to the next live spill nodes not used yet ("the next node in
    the key's rendezvous order"); when those run out (a cluster of ``width`` nodes
    or fewer live ones), to the live node that holds the fewest shards of this
    key, then whose domain holds the fewest, then earliest in ``order``.

    Returns (targets, redirected): ``targets[i]`` is a node index, or -1 when
    no node is live; ``redirected`` counts shards not on their holder. A writer
    refuses a block with more than ``limit`` redirected shards (see
    :func:`max_redirect`): every target is then -1.
    """
    holders = list(order[:width])
    targets = [h if h >= 0 and live[h] else -1 for h in holders]
    missing = [i for i, t in enumerate(targets) if t < 0]
    if not missing:
        return targets, 0
    if len(missing) > limit:
        return [-1] * width, len(missing)
    used = set(targets)
    spills = [x for x in order[width:] if x >= 0 and live[x] and x not in used]
    for i in missing:
        if spills:
            node = spills.pop(0)
        else:
            node = least_loaded(targets, live, domain_of, order)
            if node < 0:
                return [-1] * width, len(missing)
        targets[i] = node
        used.add(node)
    return targets, len(missing)


def write_targets_many(
    order: IntArray,
    live: npt.NDArray[np.bool_],
    domain_of: IntArray,
    *,
    width: int,
    limit: int,
) -> tuple[IntArray, IntArray]:
    """:func:`write_targets` for many keys at once: ``order`` is (keys, positions), -1 for
    a node the caller cannot address (never live); returns (targets (keys, width),
    redirected (keys,)). Same rules, same choices, computed on columns: a client whose
    cluster has a holder of every key down (12 nodes, one stopped) places every block
    of every call this way."""
    order = np.asarray(order, np.int64)
    positions = order.shape[1]
    nodes = len(live)
    live = np.asarray(live, bool)
    holders = order[:, :width]
    up = (holders >= 0) & live[np.maximum(holders, 0)]
    targets = np.where(up, holders, -1)
    missing = ~up
    redirected = missing.sum(axis=1).astype(np.int64)
    refused = redirected > limit
    targets[refused] = -1
    todo = (redirected > 0) & ~refused
    if not todo.any():
        return targets, redirected
    rows = np.flatnonzero(todo)
    t = targets[rows]
    miss = missing[rows]
    # Spill nodes: live, not a live holder of the key; the k-th missing shard (in index
    # order) takes the k-th of them.
    spill = order[rows, width:]
    ok_spill = (spill >= 0) & live[np.maximum(spill, 0)]
    if spill.shape[1]:
        ok_spill &= ~(spill[:, :, None] == np.where(t >= 0, t, -2)[:, None, :]).any(axis=2)
    miss_rank = np.cumsum(miss, axis=1) - 1
    spills_available = ok_spill.sum(axis=1)
    usable_first = np.argsort(~ok_spill, axis=1, kind="stable")  # usable spills, in order
    rr, ii = np.nonzero(miss & (miss_rank < spills_available[:, None]))
    t[rr, ii] = spill[rr, usable_first[rr, miss_rank[rr, ii]]]
    # The rest, one shard per row at a time in index order: the least loaded live node.
    left = miss & (miss_rank >= spills_available[:, None])
    if left.any():
        base = max(nodes, positions, width) + 2
        domains = np.asarray(domain_of, np.int64)
        dom_ids = np.unique(domains, return_inverse=True)[1].reshape(-1)
        n_dom = int(dom_ids.max()) + 1 if len(dom_ids) else 1
        # first_seen[r, x]: the first position of node x in row r's order.
        first_seen = np.full((len(rows), nodes), positions, np.int64)
        cols = order[rows]
        r_at, p_at = np.nonzero((cols >= 0) & (cols < nodes))
        np.minimum.at(first_seen, (r_at, cols[r_at, p_at]), p_at)
        node_ids = np.arange(nodes, dtype=np.int64)
        failed = np.zeros(len(rows), bool)
        while left.any():
            r_idx = np.flatnonzero(left.any(axis=1))
            i_idx = left[r_idx].argmax(axis=1)
            sub = t[r_idx]
            placed = sub >= 0
            flat = (np.arange(len(r_idx))[:, None] * nodes + np.maximum(sub, 0))[placed]
            node_load = np.bincount(flat, minlength=len(r_idx) * nodes).reshape(-1, nodes)
            dflat = (np.arange(len(r_idx))[:, None] * n_dom + dom_ids[np.maximum(sub, 0)])[placed]
            dom_load = np.bincount(dflat, minlength=len(r_idx) * n_dom).reshape(-1, n_dom)
            score = (
                (node_load * base + dom_load[:, dom_ids]) * base + first_seen[r_idx]
            ) * base + node_ids
            score[:, ~live] = np.iinfo(np.int64).max
            best = score.argmin(axis=1)
            none = ~live[best]
            failed[r_idx[none]] = True
            t[r_idx, i_idx] = np.where(none, -1, best)
            left[r_idx, i_idx] = False
        t[failed] = -1
    targets[rows] = t
    return targets, redirected


def least_loaded(
    targets: Sequence[int],
    live: Sequence[bool] | npt.NDArray[np.bool_],
    domain_of: Sequence[int] | npt.NDArray[np.int64],
    order: Sequence[int],
    *,
    exclude: frozenset[int] = frozenset(),
) -> int:
    """The live node (not in ``exclude``) holding the fewest of ``targets``, then whose
    domain holds the fewest, then earliest in ``order`` (then lowest index); -1: none."""
    node_load: dict[int, int] = {}
    domain_load: dict[int, int] = {}
    for t in targets:
        if t >= 0:
            node_load[t] = node_load.get(t, 0) + 1
            domain_load[int(domain_of[t])] = domain_load.get(int(domain_of[t]), 0) + 1
    first_seen: dict[int, int] = {}
    for pos, x in enumerate(order):
        first_seen.setdefault(int(x), pos)
    best, best_key = -1, (0, 0, 0, 0)
    for x in range(len(live)):
        if not live[x] or x in exclude:
            continue
        key = (
            node_load.get(x, 0),
            domain_load.get(int(domain_of[x]), 0),
            first_seen.get(x, len(order)),
            x,
        )
        if best < 0 or key < best_key:
            best, best_key = x, key
    return best


def holders_for(cluster: ClusterMap, key: BlockKey, *, width: int) -> list[NodeInfo]:
    """The nodes holding shards 0..width-1 of ``key``, in shard order."""
    placement = Placement(cluster, width=width)
    return [placement.nodes[i] for i in placement.holders([key])[0]]
