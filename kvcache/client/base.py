"""State and plumbing shared by the client's operations: sockets, node health, placement.

``AsyncClient`` (``kvcache.client.core``) is this base plus the read operations
(``kvcache.client.reads``) and the store operations (``kvcache.client.storing``).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq
import zmq.asyncio

from kvcache.client.config import ClientConfig
from kvcache.client.health import LatencyTracker, NodeHealth
from kvcache.client.transport import NodeChannel
from kvcache.cluster import ClusterMap
from kvcache.erasure import ErasureParams, get_codec
from kvcache.errors import NodeError
from kvcache.keys import BlockKey
from kvcache.memtune import tune_malloc
from kvcache.placement import Placement
from kvcache.shard import check_class_name
from kvcache.wire import Header, Limits, Message, Op

__all__ = ["ClientBase"]

log = logging.getLogger(__name__)

_MAX_SUSPECT = 65536


class ClientBase:
    """A connection to a cluster: one channel per node, health and latency bookkeeping."""

    def __init__(
        self,
        config: ClientConfig,
        *,
        cluster: ClusterMap | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        if config.tune_malloc:
            tune_malloc()
        self.cluster = cluster if cluster is not None else ClusterMap.load(config.cluster_file)
        self.placement = Placement(self.cluster, width=config.n)
        self.params = ErasureParams(k=config.k, m=config.m)
        self.codec = get_codec(self.params)
        self.health = NodeHealth(retry_s=config.down_retry_s, clock=clock)
        self.read_latency = LatencyTracker()
        self.meta_latency = LatencyTracker()
        self._clock = clock
        self._ctx = zmq.asyncio.Context()
        self._limits = Limits()
        token = config.token.encode() if config.token else None
        self._channels = [
            NodeChannel(self._ctx, node, limits=self._limits, token=token)
            for node in self.placement.nodes
        ]
        self._background: set[asyncio.Task[Any]] = set()
        # Keys whose stored stripe failed verification on a load: stores rewrite them.
        self._suspect: collections.OrderedDict[BlockKey, None] = collections.OrderedDict()
        self.counters: dict[str, int] = {
            "hedges": 0,
            "node_errors": 0,
            "blocks_loaded": 0,
            "blocks_rebuilt": 0,
            "blocks_written": 0,
            "blocks_touched": 0,
            "write_failures": 0,
            "blocks_corrupt": 0,
        }

    # ------------------------------------------------------------------ lifecycle

    async def aclose(self) -> None:
        """Close every socket."""
        for task in list(self._background):
            task.cancel()
        for ch in self._channels:
            await ch.aclose()
        self._ctx.term()

    # ------------------------------------------------------------------ helpers

    def _node_up_mask(
        self, holders: npt.NDArray[np.int64] | None = None, need: int = 0
    ) -> npt.NDArray[np.bool_]:
        """Nodes to use: those not marked down; all of them when, for some block of
        ``holders``, skipping the down ones would leave fewer than ``need`` holders
        (then the call doubles as the down nodes' probe instead of failing for sure)."""
        up = np.array([self.health.is_up(ch.node.id) for ch in self._channels], bool)
        short = holders is not None and len(holders) and not up.all()
        if short and int(up[holders].sum(axis=1).min()) < need:
            for i, ch in enumerate(self._channels):
                if not up[i] and self.health.may_probe(ch.node.id):
                    up[i] = True
        return up

    def suspect(self, key: BlockKey) -> None:
        """Remember that ``key``'s stored stripe failed verification (bounded memory)."""
        self._suspect[key] = None
        self._suspect.move_to_end(key)
        while len(self._suspect) > _MAX_SUSPECT:
            self._suspect.popitem(last=False)

    def _hedge_s(self, tracker: LatencyTracker) -> float:
        if self.config.hedge_ms is not None:
            return self.config.hedge_ms / 1000.0
        return tracker.hedge_after()

    async def _call(
        self,
        node: int,
        header: Header,
        items: npt.NDArray[np.void] | None,
        data: Any = None,
    ) -> Message:
        channel = self._channels[node]
        try:
            reply = await channel.request(header, items, data, timeout=self.config.timeout_s)
        except NodeError as exc:
            self.counters["node_errors"] += 1
            self.health.mark_down(channel.node.id, str(exc))
            channel.reset()
            raise
        self.health.mark_up(channel.node.id)
        return reply

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._settled)
        return task

    def _settled(self, task: asyncio.Task[Any]) -> None:
        """Forget a finished task; its error (already counted in node health) is consumed."""
        self._background.discard(task)
        if not task.cancelled():
            task.exception()

    def _keys_and_holders(
        self, keys: Sequence[BlockKey]
    ) -> tuple[npt.NDArray[np.int64], dict[int, npt.NDArray[np.int64]]]:
        """Placement rows, and per node the block numbers it holds a shard of."""
        rows = self.placement.holders(keys)
        per_node: dict[int, npt.NDArray[np.int64]] = {}
        if len(keys):
            nodes_of = np.unique(rows)
            for node in nodes_of.tolist():
                per_node[node] = np.nonzero((rows == node).any(axis=1))[0]
        return rows, per_node

    @staticmethod
    def _check_class(traffic_class: str) -> str:
        return check_class_name(traffic_class)

    async def stats(self) -> dict[str, Any]:
        """Each node's STATS answer (or its error), by node id."""
        calls = [
            self._call(i, Header(op=Op.STATS, request_id=0, count=0), None)
            for i in range(len(self._channels))
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        out: dict[str, Any] = {}
        for ch, reply in zip(self._channels, results, strict=True):
            if isinstance(reply, BaseException):
                out[ch.node.id] = {"error": str(reply)}
            else:
                try:
                    out[ch.node.id] = json.loads(bytes(reply.data))
                except ValueError:
                    out[ch.node.id] = {"error": "unreadable stats"}
        return out
