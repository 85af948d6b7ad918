"""The client's picture of the cluster: placement under the current map and recent ones,
which nodes are live, and node indices into the transport. Pure given its inputs.

A :class:`ClusterView` is what one operation uses from start to end, so a map
change in the middle of a store never splits it across two placements. The
:class:`Topology` hands out views and takes new maps from a membership source
(:mod:`kvcache.membership.source`), from any thread.

Where shards are, and who is asked (``docs/membership.md`` has the why):

* **Writes** go to :meth:`ClusterView.targets`: shard ``i`` to its holder under
  the current map, or, when that holder is down, to the key's next live node
  in rendezvous order (:func:`kvcache.placement.write_targets`, for whole batches
  :func:`~kvcache.placement.write_targets_many`).
* **Reads** (HAS) ask :meth:`ClusterView.read_rows`: those write targets, the
  holders that are down (probed only when a block would be short without
  them), the holders under the maps of the last ``history`` changes (a join
  or leave leaves shards where they were written until the repairer moves
  them) and nodes being drained. A daemon answers HAS with every index it
  holds of a key, so a shard is found wherever a writer under any of those
  placements put it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvcache.cluster import ClusterMap, NodeInfo, NodeState
from kvcache.errors import ConfigError
from kvcache.keys import BlockKey
from kvcache.membership.model import Membership
from kvcache.placement import (
    DEFAULT_SPILL,
    Placement,
    least_loaded,
    max_redirect,
    write_targets_many,
)

__all__ = ["ClusterView", "MapHistory", "Topology"]

log = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


class MapHistory:
    """The maps replaced recently, each kept ``keep_s`` seconds (at most ``keep`` of them).

    Shards written under a replaced map stay on its holders until they expire or
    the repairer moves them; reads ask those holders too while the map is kept.
    Pure: the time is passed in.
    """

    def __init__(self, *, keep: int = 2, keep_s: float = 24 * 3600.0) -> None:
        self.keep = keep
        self.keep_s = keep_s
        self._maps: list[tuple[ClusterMap, float]] = []

    def replaced(self, old: ClusterMap, now: float) -> None:
        """``old`` stopped being the current map at ``now``."""
        self._maps = [(m, t) for m, t in self._maps if m.epoch != old.epoch]
        self._maps.insert(0, (old, now))
        del self._maps[self.keep :]

    def maps(self, now: float) -> list[ClusterMap]:
        """The maps still kept at ``now``, newest first."""
        self._maps = [(m, t) for m, t in self._maps if now - t < self.keep_s]
        return [m for m, _ in self._maps]


class ClusterView:
    """One operation's placement: current map, recent maps, liveness; node indices are
    into :attr:`nodes` (the transport's node list)."""

    def __init__(
        self,
        *,
        nodes: tuple[NodeInfo, ...],
        cluster: ClusterMap,
        live: BoolArray,
        placement: Placement,
        others: Sequence[Placement],
        index_of: Callable[[NodeInfo], int],
        min_write: int,
    ) -> None:
        self.nodes = nodes
        self.cluster = cluster
        self.epoch = cluster.epoch
        self.width = placement.width
        #: Per node (transport index): live by the membership source (always True without one).
        self.live = live
        self._placement = placement
        self._others = list(others)
        self._u = self._universe(placement, index_of)
        self._u_others = [self._universe(p, index_of) for p in self._others]
        self.redirect_limit = max_redirect(n=placement.width, min_write=min_write)
        self._domain = np.full(len(nodes), -1, np.int64)
        #: Per node: placeable under the current map (only these take shards).
        self.placeable = np.zeros(len(nodes), bool)
        for local, u in enumerate(self._u.tolist()):
            if u >= 0:
                self._domain[u] = int(placement.domain_of[local])
                self.placeable[u] = True
        self._placeable_count = int(self.placeable.sum())
        # Every placeable node indexed, and no more of them than a block has shards.
        self._covers_all = bool((self._u >= 0).all()) and len(placement.nodes) <= self.width

    def _all_listed(self, targets: IntArray) -> bool:
        """Whether every row of ``targets`` names every placeable node."""
        if targets.shape[1] < self._placeable_count or (targets < 0).any():
            return False
        seen = np.zeros((len(targets), len(self.nodes)), bool)
        seen[np.arange(len(targets))[:, None], targets] = True
        return bool(seen[:, self.placeable].all())

    @property
    def node_cap(self) -> int:
        """The most shards of one block a node may hold beyond how often placement lists
        it: 1 while writers can redirect to distinct spill nodes; more when a map (the
        current one or a kept one) has fewer than ``width + redirect_limit`` nodes, so a
        writer with holders down doubled up on live ones."""
        smallest = min(len(p.nodes) for p in (self._placement, *self._others))
        if smallest >= self.width + self.redirect_limit:
            return 1
        live_at_least = max(1, min(smallest, self.width) - self.redirect_limit)
        return -(-self.width // live_at_least)

    @staticmethod
    def _universe(placement: Placement, index_of: Callable[[NodeInfo], int]) -> IntArray:
        return np.array([index_of(n) for n in placement.nodes], np.int64)

    @property
    def placement(self) -> Placement:
        """The current map's placement (indices into its own node list)."""
        return self._placement

    def holders(self, keys: Sequence[BlockKey]) -> IntArray:
        """Shard holders under the current map, (keys, width), as transport indices."""
        return self._u[self._placement.holders(keys)]

    def order(self, keys: Sequence[BlockKey]) -> IntArray:
        """Holders then spill nodes under the current map, (keys, width + spill)."""
        return self._u[self._placement.order(keys)]

    def targets(
        self, keys: Sequence[BlockKey], up: BoolArray
    ) -> tuple[IntArray, IntArray, IntArray]:
        """(targets, redirected, order): where a writer sends each shard (-1: the block
        cannot be written, more than :attr:`redirect_limit` holders are down), how many
        shards per block are off their holders, and the placement order used."""
        order = self.order(keys)
        width = self.width
        usable = np.zeros(len(self.nodes), bool)
        usable[: len(up)] = up[: len(self.nodes)]
        usable &= self.placeable
        # A node the transport cannot address (-1) is never usable.
        holders = order[:, :width]
        ok = (holders >= 0) & usable[np.maximum(holders, 0)]
        targets = holders.copy()
        redirected = np.zeros(len(keys), np.int64)
        off = np.flatnonzero(~ok.all(axis=1))
        if len(off):
            targets[off], redirected[off] = write_targets_many(
                order[off], usable, self._domain, width=width, limit=self.redirect_limit
            )
        return targets, redirected, order

    def respill(
        self,
        order_row: Sequence[int],
        targets_row: Sequence[int],
        up: BoolArray,
        excluded: frozenset[int],
    ) -> int:
        """A new node for a shard whose target failed: the next node of ``order_row`` that
        is up and not among the targets or ``excluded``, else the least loaded such node;
        -1: none."""
        used = set(targets_row)
        usable = [
            bool(up[x]) and bool(self.placeable[x]) and x not in excluded
            for x in range(min(len(up), len(self.nodes)))
        ]
        for x in order_row[self.width :]:
            if 0 <= x < len(usable) and x not in used and usable[x]:
                return int(x)
        return least_loaded(list(targets_row), usable, self._domain, list(order_row))

    def read_rows(self, keys: Sequence[BlockKey], targets: IntArray | None = None) -> IntArray:
        """Nodes to ask what they hold of each key, (keys, columns), -1 padded: the write
        targets (a node listed as often as it may hold shards), then the current
        holders, the spill nodes, and the holders under kept maps and drained
        nodes, each once."""
        if targets is None:
            targets = self.holders(keys)
        # One map, no more placeable nodes than the width, every node indexed, and every
        # row already naming every one of them: the order adds nothing.
        if not self._others and self._covers_all and self._all_listed(targets):
            return targets
        parts = [targets, self.order(keys)]
        for placement, u in zip(self._others, self._u_others, strict=True):
            parts.append(u[placement.holders(keys)])
        width = targets.shape[1]
        both = np.concatenate(parts, axis=1)
        # An extra column is dropped when it is -1 or names a node already listed
        # before it in its row (the write targets themselves are all kept).
        same = both[:, width:, None] == both[:, None, :]
        earlier = np.tri(both.shape[1], k=-1, dtype=bool)[width:]
        drop = (same & earlier).any(axis=2) | (both[:, width:] < 0)
        keep = np.concatenate([np.ones(targets.shape, bool), ~drop], axis=1)
        # Kept entries first, in order (a stable sort of "dropped" flags).
        order = np.argsort(~keep, axis=1, kind="stable")
        packed = np.take_along_axis(both, order, axis=1)
        kept = keep.sum(axis=1)
        columns = int(kept.max()) if len(kept) else width
        out = packed[:, :columns]
        out[np.arange(columns)[None, :] >= kept[:, None]] = -1
        return out


class Topology:
    """Hands out :class:`ClusterView` s and takes new memberships (thread-safe).

    ``add_node`` registers a node with the transport and returns its index (a
    :meth:`~kvcache.client.transport.TcpTransport.add`); without it the
    transport's node list is fixed and a node missing from it is never used.
    """

    def __init__(
        self,
        membership: Membership,
        *,
        width: int,
        min_write: int,
        nodes: Callable[[], tuple[NodeInfo, ...]],
        add_node: Callable[[NodeInfo], int] | None = None,
        clock: Callable[[], float],
        history: MapHistory | None = None,
        spill: int = DEFAULT_SPILL,
    ) -> None:
        self.width = width
        self.min_write = min_write
        self.spill = spill
        self._nodes = nodes
        self._add_node = add_node
        self._clock = clock
        self.history = history or MapHistory()
        self._lock = threading.Lock()
        self._index: dict[tuple[str, str], int] = {}
        self._membership = membership
        self._view: ClusterView | None = None
        self._listeners: list[Callable[[Membership], None]] = []
        self.changes = 0
        with self._lock:
            self._view = self._build()

    @property
    def membership(self) -> Membership:
        """The current map and liveness."""
        return self._membership

    def subscribe(self, listener: Callable[[Membership], None]) -> None:
        """Call ``listener`` after every change (on the thread that made it)."""
        self._listeners.append(listener)

    def view(self) -> ClusterView:
        """The current view (cached until the next change)."""
        view = self._view
        assert view is not None  # built in __init__
        return view

    def update(self, membership: Membership) -> None:
        """Take a new map and liveness (from a membership source's thread)."""
        with self._lock:
            old = self._membership
            if membership == old:
                return
            if membership.cluster != old.cluster:
                self.history.replaced(old.cluster, self._clock())
                log.info(
                    "cluster map epoch %d -> %d (%d nodes)",
                    old.cluster.epoch,
                    membership.cluster.epoch,
                    len(membership.cluster.nodes),
                )
            self._membership = membership
            try:
                self._view = self._build()
            except ConfigError as exc:
                log.error("cannot place on the new cluster map (%s); keeping the old one", exc)
                self._membership = old
                return
            self.changes += 1
        for listener in self._listeners:
            listener(membership)

    def index_of(self, node: NodeInfo) -> int:
        """The transport index of ``node`` (its id and data address), added if new; -1 when
        the transport cannot take nodes and does not have it."""
        with self._lock:
            return self._index_of(node)

    def _index_of(self, node: NodeInfo) -> int:
        key = (node.id, node.data)
        found = self._index.get(key)
        if found is not None:
            return found
        for i, known in enumerate(self._nodes()):
            if (known.id, known.data) == key:
                self._index[key] = i
                return i
        if self._add_node is None:
            log.error("node %s (%s) is not in the transport's node list: not used", *key)
            return -1
        index = self._add_node(node)
        self._index[key] = index
        return index

    def _build(self) -> ClusterView:
        membership = self._membership
        cluster = membership.cluster
        placement = Placement(cluster, width=self.width, spill=self.spill)
        others: list[Placement] = []
        if any(n.state is NodeState.DRAIN for n in cluster.nodes):
            others.append(
                Placement(cluster, width=self.width, states=(NodeState.UP, NodeState.DRAIN))
            )
        for old in self.history.maps(self._clock()):
            try:
                others.append(Placement(old, width=self.width, spill=0))
            except ConfigError:  # a kept map with nothing placeable
                continue
        # Every node of the map (out and drained ones too: the repairer lists and prunes
        # them) and of every placement gets an index before the live mask is sized.
        for node in cluster.nodes:
            self._index_of(node)
        for p in (placement, *others):
            for node in p.nodes:
                self._index_of(node)
        nodes = self._nodes()
        live = np.ones(len(nodes), bool)
        if membership.live is not None:
            live[:] = [n.id in membership.live for n in nodes]
        # A node listed under an older address is not live at that address.
        current = {(n.id, n.data) for n in cluster.nodes}
        ids = {n.id for n in cluster.nodes}
        for i, n in enumerate(nodes):
            if n.id in ids and (n.id, n.data) not in current:
                live[i] = False
        return ClusterView(
            nodes=nodes,
            cluster=cluster,
            live=live,
            placement=placement,
            others=others,
            index_of=self._index_of,
            min_write=self.min_write,
        )
