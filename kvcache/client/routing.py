"""A transport whose node list grows while the client runs: nodes join, the client re-places.

Rounds, pumps and the watchdog address nodes by index into ``transport.nodes``.
:class:`RoutingTransport` keeps that list append-only (a node that leaves the
map keeps its index; a node whose address changed gets a new one) and routes
each exchange to a :class:`~kvcache.client.transport.TcpTransport` of its own
node, created when the node is first added. Its connections and threads are
those the single transport had per node (``connections_per_node`` bulk
connections and one control connection, connected lazily), so a client of a
fixed cluster behaves as before. Only this module knows about the routing:
an exchange keeps its index, and a small proxy carries it to the per-node
transport as that transport's node 0.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvcache.client.transport import Credentials, Exchange, TcpTransport
from kvcache.cluster import NodeInfo
from kvcache.errors import NodeError
from kvcache.wire import Header, Message

__all__ = ["RoutingTransport"]


class _Routed(Exchange):
    """``inner`` as node 0 of its node's transport; hooks go back to ``inner``."""

    def __init__(self, owner: RoutingTransport, inner: Exchange) -> None:
        super().__init__(0, inner.op, inner.items, inner.data, traffic_class=inner.traffic_class)
        self.owner = owner
        self.inner = inner

    def landing(self, header: Header, items: npt.NDArray[np.void]) -> list[memoryview] | None:
        return self.inner.landing(header, items)

    def landed(self) -> None:
        self.inner.landed()

    def finish(self, reply: Message | None, error: BaseException | None) -> None:
        self.owner._forget(self.inner)
        self.inner.finish(reply, error)


class RoutingTransport:
    """Exchanges by node index, each node served by its own TCP transport."""

    def __init__(
        self,
        nodes: Sequence[NodeInfo],
        credentials: Credentials,
        *,
        connections_per_node: int = 2,
        connect_timeout_s: float = 2.0,
    ) -> None:
        self.credentials = credentials
        self.connections_per_node = connections_per_node
        self.connect_timeout_s = connect_timeout_s
        self.nodes: tuple[NodeInfo, ...] = ()
        self._subs: list[TcpTransport] = []
        self._lock = threading.Lock()
        self._routed: dict[int, _Routed] = {}
        self._closed = False
        for node in nodes:
            self.add(node)

    def add(self, node: NodeInfo) -> int:
        """Add ``node`` (an id and address not seen before); returns its index."""
        with self._lock:
            if self._closed:
                raise NodeError("client closed", node=node.id)
            sub = TcpTransport(
                [node],
                self.credentials,
                connections_per_node=self.connections_per_node,
                connect_timeout_s=self.connect_timeout_s,
            )
            self._subs.append(sub)
            self.nodes = (*self.nodes, node)
            return len(self.nodes) - 1

    def index(self, node: NodeInfo) -> int | None:
        """The index of the node with ``node``'s id and data address, if added."""
        for i in range(len(self.nodes) - 1, -1, -1):
            known = self.nodes[i]
            if known.id == node.id and known.data == node.data:
                return i
        return None

    def submit(self, exchange: Exchange) -> None:
        """Queue ``exchange`` on its node's transport."""
        routed = _Routed(self, exchange)
        with self._lock:
            self._routed[id(exchange)] = routed
            sub = self._subs[exchange.node]
        sub.submit(routed)

    def _forget(self, exchange: Exchange) -> None:
        with self._lock:
            self._routed.pop(id(exchange), None)

    def reset(self, node: int) -> None:
        """Fail what is queued and in flight for ``node``; it reconnects on next use.

        The node gets a fresh transport and the old one is closed in the background:
        ``TcpTransport.reset`` shuts idle sockets down but keeps them, so the next
        request on one failed with EPIPE and marked a node that had come back down
        again (a load after a paused node resumed lost 5 of 12 blocks that way).
        """
        with self._lock:
            if self._closed:
                return
            old = self._subs[node]
            self._subs[node] = TcpTransport(
                [self.nodes[node]],
                self.credentials,
                connections_per_node=self.connections_per_node,
                connect_timeout_s=self.connect_timeout_s,
            )
        threading.Thread(target=old.close, name="kvcache-transport-reset", daemon=True).start()

    def abort(self, exchange: Exchange) -> None:
        """Cut the connection carrying ``exchange``, if it is being received."""
        with self._lock:
            routed = self._routed.get(id(exchange))
            sub = self._subs[exchange.node]
        if routed is not None:
            sub.abort(routed)

    def busy_since(self) -> dict[int, float]:
        """Per node with an exchange in progress: since when (monotonic)."""
        out: dict[int, float] = {}
        for i, sub in enumerate(list(self._subs)):
            since = sub.busy_since().get(0)
            if since is not None:
                out[i] = since
        return out

    def close(self) -> None:
        """Close every node's transport (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            subs = list(self._subs)
        for sub in subs:
            sub.close()
