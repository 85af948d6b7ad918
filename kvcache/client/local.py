"""An in-process transport: the client's exchanges answered by request handlers, no sockets.

The same :class:`~kvcache.client.transport.Transport` interface as the TCP
one, backed by one :class:`~kvcache.server.handler.RequestHandler` (a real
:class:`~kvcache.server.store.ShardStore` on LMDB) per node and one thread
per node that answers its exchanges in order, as a daemon's connection
would. Nothing is mocked: requests are encoded, handled and decoded with the
wire format; only the socket is missing.

What it adds is control over time and failure, per node, for tests of the
client's decisions (hedging, settling, escalation, marking nodes down):
``delay_s`` before each answer, ``stop()`` (requests are held, as by a
SIGSTOPped daemon, until ``resume()`` or a reset) and ``kill()`` (every
exchange fails, as with a dead daemon).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvcache.client.transport import Exchange
from kvcache.cluster import NodeInfo
from kvcache.credentials import TenantId
from kvcache.errors import NodeError
from kvcache.native import Segments
from kvcache.net_loop import frame_view
from kvcache.server.handler import Request, RequestHandler
from kvcache.wire import Header, Message, decode, encode, join

__all__ = ["LocalNode", "LocalTransport"]


@dataclass
class LocalNode:
    """One node of a :class:`LocalTransport`: its handler and its faults."""

    handler: RequestHandler
    #: Seconds each answer waits before it is given.
    delay_s: float = 0.0
    dead: bool = False
    _running: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._running.set()

    def stop(self) -> None:
        """Hold every request from now on (a stopped daemon keeps its connections)."""
        self._running.clear()

    def resume(self) -> None:
        """Answer held and new requests again."""
        self._running.set()

    def kill(self) -> None:
        """Fail every exchange from now on."""
        self.dead = True


class LocalTransport:
    """In-process transport over ``nodes`` answered by ``local[i].handler`` as ``tenant``."""

    def __init__(
        self, nodes: Sequence[NodeInfo], local: Sequence[LocalNode], *, tenant: TenantId
    ) -> None:
        if len(nodes) != len(local):
            raise ValueError(f"{len(nodes)} nodes but {len(local)} handlers")
        self.nodes = tuple(nodes)
        self.local = list(local)
        self.tenant = tenant
        self._queues: list[queue.SimpleQueue[Exchange | None]] = [
            queue.SimpleQueue() for _ in nodes
        ]
        self._busy: list[tuple[Exchange, float] | None] = [None] * len(nodes)
        self._epoch = [0] * len(nodes)
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._serve, args=(i,), name=f"local-{n.id}", daemon=True)
            for i, n in enumerate(nodes)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, exchange: Exchange) -> None:
        """Queue ``exchange`` for its node's thread."""
        if self._closed:
            exchange.finish(None, NodeError("client closed", node=self.nodes[exchange.node].id))
            return
        self._queues[exchange.node].put(exchange)

    def reset(self, node: int) -> None:
        """Fail what is queued and in flight for ``node`` (a stopped node's held request too)."""
        with self._lock:
            self._epoch[node] += 1
        error = NodeError(f"node {self.nodes[node].id} reset", node=self.nodes[node].id)
        while True:
            try:
                exchange = self._queues[node].get_nowait()
            except queue.Empty:
                break
            if exchange is None:
                self._queues[node].put(None)
                break
            exchange.finish(None, error)

    def abort(self, exchange: Exchange) -> None:
        """Nothing to cut: an in-process reply lands at once or not at all."""

    def busy_since(self) -> dict[int, float]:
        """Per node with an exchange in progress: since when (monotonic)."""
        with self._lock:
            return {i: b[1] for i, b in enumerate(self._busy) if b is not None}

    def close(self) -> None:
        """Fail everything queued and stop the threads."""
        if self._closed:
            return
        self._closed = True
        for i, q in enumerate(self._queues):
            self.reset(i)
            self.local[i].resume()
            q.put(None)
        for thread in self._threads:
            thread.join(timeout=5)

    # ------------------------------------------------------------------ node threads

    def _serve(self, i: int) -> None:
        node = self.local[i]
        node_id = self.nodes[i].id
        while True:
            exchange = self._queues[i].get()
            if exchange is None:
                return
            with self._lock:
                self._busy[i] = (exchange, time.monotonic())
                epoch = self._epoch[i]
            try:
                while not node._running.wait(0.01):  # held by a stopped node
                    with self._lock:
                        if self._epoch[i] != epoch:
                            raise NodeError(f"node {node_id} reset", node=node_id)
                if node.dead:
                    raise NodeError(f"node {node_id}: connection refused", node=node_id)
                if node.delay_s:
                    time.sleep(node.delay_s)  # the node's simulated service time
                reply = self._answer(node.handler, exchange)
            except NodeError as exc:
                self._done(i, exchange, None, exc)
            else:
                self._done(i, exchange, reply, None)

    def _done(
        self, i: int, exchange: Exchange, reply: Message | None, error: NodeError | None
    ) -> None:
        with self._lock:
            self._busy[i] = None
        exchange.finish(reply, error)

    def _answer(self, handler: RequestHandler, exchange: Exchange) -> Message:
        sections = exchange.data
        if isinstance(sections, Segments):
            sections = sections.views()
        data = b"".join(bytes(memoryview(d).cast("B")) for d in sections)
        header = Header(
            op=exchange.op,
            request_id=1,
            count=len(exchange.items),
            data_len=len(data),
            traffic_class=exchange.traffic_class,
            retain=exchange.retain,
        )
        raw = join(encode(header, np.ascontiguousarray(exchange.items), data))
        request = Request(self.tenant, decode(raw), time.perf_counter(), len(raw))
        reply = handler.handle(request)
        try:
            message = decode(b"".join(bytes(frame_view(f)) for f in reply.frames))
        finally:
            reply.done()
        if message.header.data_len:
            landing = exchange.landing(message.header, message.items)
            if landing is not None:
                at = 0
                for view in landing.views() if isinstance(landing, Segments) else landing:
                    view[:] = message.data[at : at + view.nbytes]
                    at += view.nbytes
                exchange.landed()
        return message
