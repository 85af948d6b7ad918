"""What every client operation shares: the cluster, placement, codec, transport and health.

:class:`ClientCore` is plain state plus a few helpers; the operations are
functions in :mod:`.matching`, :mod:`.loading` and :mod:`.storing` that take
it, and :class:`kvcache.client.Client` is the public façade over them.
Composition, not inheritance: each operation's module reads top to bottom.

The cluster map comes from a membership source (:mod:`kvcache.membership.source`:
the static cluster file, re-read when it changes, or etcd, watched). Every
operation takes one :class:`~kvcache.client.view.ClusterView` when it starts
and uses it to the end; a change of the map only affects operations that
start after it. Node indices are into ``transport.nodes``, which only grows
(:meth:`~kvcache.client.transport.TcpTransport.add`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache.client.config import ClientConfig
from kvcache.client.health import LatencyTracker, NodeHealth
from kvcache.client.scratch import ScratchCache
from kvcache.client.transport import Credentials, TcpTransport, Transport
from kvcache.client.view import ClusterView, Topology
from kvcache.cluster import ClusterMap
from kvcache.erasure import ErasureParams, get_codec
from kvcache.errors import ArgumentError
from kvcache.keys import BlockKey
from kvcache.membership.source import EtcdSource, MapSource, StaticSource, open_source
from kvcache.memtune import tune_malloc
from kvcache.net import client_tls_context
from kvcache.shard import check_class_name

__all__ = ["COUNTERS", "ClientCore"]

log = logging.getLogger(__name__)

_MAX_SUSPECT = 65536

#: Names in :attr:`ClientCore.counters`.
COUNTERS = (
    "hedges",
    "node_errors",
    "blocks_loaded",
    "blocks_rebuilt",
    "blocks_written",
    "blocks_touched",
    "write_failures",
    "write_conflicts",
    "blocks_corrupt",
    "loads_buffer_changed",
    "blocks_other_payload_len",
    "blocks_other_erasure",
    "bad_shards_found",
    "shards_repaired",
    "blocks_refreshed",
    "stripes_dropped",
    "escalations",
    "loads_rematched",
    "shards_redirected",
    "map_changes",
    "scratch_reused",
    "landings_cut",
)


class ClientCore:
    """A connection to a cluster: transport, placement, codec, node health, counters."""

    def __init__(
        self,
        config: ClientConfig,
        *,
        cluster: ClusterMap | None = None,
        transport: Transport | None = None,
        clock: Callable[[], float] = time.monotonic,
        source: MapSource | None = None,
    ) -> None:
        self.config = config
        if config.tune_malloc:
            tune_malloc()
        credentials = None
        if transport is None:
            tls = client_tls_context(config.tls_ca) if config.tls_ca is not None else None
            credentials = Credentials(config.tenant, config.secret_bytes(), tls)
        if source is None:
            source = (
                StaticSource(cluster) if cluster is not None else open_source(config.cluster_file)
            )
        self.source = source
        if credentials is not None and isinstance(source, EtcdSource):
            # A map from etcd holds what nodes registered themselves: a daemon must then be
            # the node its entry names, so a node registered by anyone who can write to etcd
            # cannot relay other daemons' sessions (kvcache.session).
            credentials = dataclasses.replace(credentials, require_node_ids=True)
        try:
            initial = source.initial()
        except BaseException:
            source.close()
            raise
        self.params = ErasureParams(k=config.k, m=config.m)
        self.codec = get_codec(self.params)
        #: Parity scratch kept from one load to the next (kvcache.client.scratch).
        self.scratch = ScratchCache(config.scratch_cache_bytes)
        self.clock = clock
        self.health = NodeHealth(retry_s=config.down_retry_s, clock=clock)
        self.read_latency = LatencyTracker()
        self.meta_latency = LatencyTracker()
        add_node: Callable[..., int] | None = None
        if transport is None:
            assert credentials is not None  # made above
            tcp = TcpTransport(
                (),
                credentials,
                connections_per_node=config.connections_per_node,
                connect_timeout_s=config.timeout_s,
                caller_drives=config.caller_drives,
                burst=config.burst,
            )
            transport, add_node = tcp, tcp.add
        self.transport = transport
        self.topology = Topology(
            initial,
            width=config.n,
            min_write=config.min_write_shards,
            nodes=lambda: self.transport.nodes,
            add_node=add_node,
            clock=clock,
        )
        self._lock = threading.Lock()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        # Keys whose stored stripe failed verification and could not be dropped everywhere:
        # a store rewrites them instead of trusting their shard count.
        self._suspect: collections.OrderedDict[BlockKey, int] = collections.OrderedDict()
        self.topology.subscribe(lambda _m: self.count("map_changes"))
        source.start(self.topology.update)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (thread-safe)."""
        if n:
            with self._lock:
                self.counters[name] += n

    def suspect(self, key: BlockKey, stripe: int) -> None:
        """Remember that ``key``'s stripe ``stripe`` is broken (bounded memory)."""
        with self._lock:
            self._suspect[key] = stripe
            self._suspect.move_to_end(key)
            while len(self._suspect) > _MAX_SUSPECT:
                self._suspect.popitem(last=False)

    def suspects(self, keys: list[BlockKey]) -> dict[int, int]:
        """{position in ``keys``: broken stripe id} for the keys remembered as broken."""
        with self._lock:
            if not self._suspect:
                return {}
            return {i: self._suspect[k] for i, k in enumerate(keys) if k in self._suspect}

    def clear_suspect(self, key: BlockKey) -> None:
        """``key`` was rewritten."""
        with self._lock:
            self._suspect.pop(key, None)

    @property
    def cluster(self) -> ClusterMap:
        """The current cluster map."""
        return self.topology.membership.cluster

    @property
    def placement(self) -> ClusterView:
        """The current view (``.nodes`` are the transport's nodes, ``.holders(keys)``)."""
        return self.topology.view()

    def view(self) -> ClusterView:
        """The view one operation uses from start to end."""
        return self.topology.view()

    def up_mask(self, view: ClusterView) -> npt.NDArray[np.bool_]:
        """Per node of ``view``: live by the membership source and not marked down here."""
        up = view.live[: len(view.nodes)].copy()
        skipped = self.health.skipped()
        if skipped:  # only then a step per node: a healthy cluster's mask costs a copy
            up &= np.array([node.id not in skipped for node in view.nodes], bool)
        return up

    def gone_mask(self, view: ClusterView) -> npt.NDArray[np.bool_]:
        """Per node of ``view``: down long enough that read repair may rebuild its shards on
        stand-ins: dead by the membership source (its lease ran out), or marked down here
        ``repair_down_after_s`` ago or more without answering since."""
        after = self.config.repair_down_after_s
        gone = ~view.live[: len(view.nodes)]
        long_down = {n for n, secs in self.health.down_since().items() if secs >= after}
        if long_down:
            gone |= np.array([node.id in long_down for node in view.nodes], bool)
        return gone

    def node_up_mask(
        self,
        holders: npt.NDArray[np.int64] | None = None,
        need: int = 0,
        view: ClusterView | None = None,
    ) -> npt.NDArray[np.bool_]:
        """Nodes to use: those live and not marked down; also the ones marked down here
        when, for some block of ``holders``, skipping them would leave fewer than
        ``need`` holders (then the call doubles as their probe instead of failing for
        sure). A node the membership source reports dead is never probed: it comes back
        by registering again."""
        view = view or self.view()
        nodes = view.nodes
        up = self.up_mask(view)
        if holders is not None and len(holders) and not up.all():
            safe = np.where(holders >= 0, holders, 0)
            present = (holders >= 0) & up[safe]
            if int(present.sum(axis=1).min()) < need:
                for i, node in enumerate(nodes):
                    if not up[i] and view.live[i] and self.health.may_probe(node.id):
                        up[i] = True
        return up

    def hedge_s(self, tracker: LatencyTracker) -> float:
        """How long to wait before hedging (configured, or from observed latency)."""
        if self.config.hedge_ms is not None:
            return self.config.hedge_ms / 1000.0
        return tracker.hedge_after()

    def traffic_class(self, name: str | None) -> str:
        """The class of a call: ``name`` or the configured default, validated."""
        try:
            return check_class_name(name or self.config.traffic_class)
        except Exception as exc:
            raise ArgumentError(str(exc)) from None

    def close(self) -> None:
        """Stop the membership source and close the transport."""
        self.source.close()
        self.transport.close()

    def snapshot(self) -> dict[str, Any]:
        """The counters, copied."""
        with self._lock:
            return dict(self.counters)
