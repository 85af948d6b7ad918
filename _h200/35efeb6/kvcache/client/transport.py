"""How the client's requests reach the daemons: one interface, a TCP implementation.

A round (:mod:`kvcache.client.rounds`) decides *what* to send; a
:class:`Transport` sends it and reports the outcome, through an
:class:`Exchange`: the request's sections to send, a :meth:`Exchange.landing`
that says where the reply's data section goes (so GET replies land in the
caller's buffer without an intermediate copy), and :meth:`Exchange.finish`,
called once with the reply or the error. An in-process transport for tests
(:mod:`kvcache.client.local`) and, later, a native or RDMA one implement the
same interface.

:class:`TcpTransport` keeps, per node, a few bulk connections (GET, PUT) and
one control connection (HAS, TOUCH, DELETE, STATS), so a match never queues
behind a large transfer. Each connection has one thread that sends a request
(``sendmsg`` straight from the caller's buffers), receives its reply header
and items, asks the exchange where the data goes and receives it there with
one ``recvmsg_into`` (``MSG_WAITALL``). The threads block in the kernel with
the GIL released, so a load moves bytes on many cores at once.

Measured on the 16-core H200 host (``docs/architecture.md``): pyzmq peaked at
about 7.7 GB/s in one process whatever the parallelism, while plain sockets
moved 42 GB/s over 12 connections; so the data path is TCP, framed by
:mod:`kvcache.wire`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvcache.cluster import NodeInfo
from kvcache.errors import KVCacheError, NodeError, ProtocolError
from kvcache.net import open_session, recv_exact_into
from kvcache.wire import (
    HEADER_BYTES,
    Frame,
    Header,
    Limits,
    Message,
    Op,
    Status,
    check_message,
    item_dtype,
)

__all__ = ["Credentials", "Exchange", "RemoteStatusError", "TcpTransport", "Transport"]

log = logging.getLogger(__name__)

#: Most buffers per recvmsg_into / sendmsg call (Linux IOV_MAX).
_IOV_MAX = 1024
_CONTROL_OPS = {Op.HAS, Op.TOUCH, Op.DELETE, Op.STATS, Op.HAS_DIR, Op.DIR_PUT}


class RemoteStatusError(NodeError):
    """The node answered the whole request with an error status."""

    def __init__(self, message: str, *, node: str, status: Status) -> None:
        super().__init__(message, node=node)
        self.status = status


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a transport authenticates with."""

    tenant: str
    secret: bytes = field(repr=False)
    tls: ssl.SSLContext | None = None


class Exchange:
    """One request to one node and what to do with its reply (override the hooks).

    ``sections`` are sent in order (the header is built by the transport).
    :meth:`landing` runs on the I/O thread once the reply's header and items
    are in: it returns the buffers the data section is received into (their
    sizes must add up to ``header.data_len``), or None to receive it into a
    scratch buffer handed to :meth:`finish` as ``message.data``.
    :meth:`finish` runs exactly once, on the I/O thread (or the caller's, for
    an error before sending).
    """

    def __init__(
        self,
        node: int,
        op: Op,
        items: npt.NDArray[np.void],
        data: Sequence[Frame] = (),
        *,
        traffic_class: str = "",
    ) -> None:
        self.node = node
        self.op = op
        self.items = items
        self.data = data
        self.traffic_class = traffic_class

    def landing(self, header: Header, items: npt.NDArray[np.void]) -> list[memoryview] | None:
        """Where the reply's data section goes (None: a scratch buffer)."""
        return None

    def finish(self, reply: Message | None, error: BaseException | None) -> None:
        """The reply arrived (``error`` None) or the exchange failed."""

    def landed(self) -> None:
        """The data section was received into the buffers :meth:`landing` returned."""


class Transport(Protocol):
    """Sends exchanges to nodes (by index into ``nodes``) and reports their outcome."""

    nodes: tuple[NodeInfo, ...]

    def submit(self, exchange: Exchange) -> None:
        """Queue ``exchange``; its :meth:`Exchange.finish` runs when it is done."""

    def reset(self, node: int) -> None:
        """Fail everything queued or in flight to ``node`` and drop its connections."""

    def abort(self, exchange: Exchange) -> None:
        """Make ``exchange``, if it is being received, fail at once (its data is not wanted)."""

    def close(self) -> None:
        """Fail everything and close every connection."""


class _Connection:
    """One connection to one node, with the thread that owns it."""

    def __init__(self, owner: TcpTransport, node: int, name: str) -> None:
        self.owner = owner
        self.node = node
        self.queue: queue.SimpleQueue[Exchange | None] = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.busy: Exchange | None = None
        self.busy_at = 0.0
        self.ids = itertools.count(1)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            exchange = self.queue.get()
            if exchange is None:
                return
            with self.lock:
                self.busy = exchange
                self.busy_at = time.monotonic()
            try:
                reply = self._exchange(exchange)
            except BaseException as exc:
                self._drop()
                error = (
                    exc
                    if isinstance(exc, KVCacheError)
                    else NodeError(
                        f"node {self.owner.node_id(self.node)}: {exc}",
                        node=self.owner.node_id(self.node),
                    )
                )
                self._finish(exchange, None, error)
            else:
                self._finish(exchange, reply, None)

    def _finish(
        self, exchange: Exchange, reply: Message | None, error: BaseException | None
    ) -> None:
        with self.lock:
            self.busy = None
        try:
            exchange.finish(reply, error)
        except Exception:  # a bug in a hook must not kill the connection thread
            log.exception("exchange completion failed")

    def _connect(self) -> socket.socket:
        with self.lock:
            sock = self.sock
        if sock is not None:
            return sock
        owner = self.owner
        info = owner.nodes[self.node]
        sock = open_session(
            info.data,
            tenant=owner.credentials.tenant,
            secret=owner.credentials.secret,
            timeout_s=owner.connect_timeout_s,
            node=info.id,
            tls=owner.credentials.tls,
        )
        with self.lock:
            self.sock = sock
        return sock

    def _exchange(self, exchange: Exchange) -> Message:
        sock = self._connect()
        node = self.owner.node_id(self.node)
        request_id = next(self.ids)
        sizes = [memoryview(d).nbytes for d in exchange.data]
        header = Header(
            op=exchange.op,
            request_id=request_id,
            count=len(exchange.items),
            data_len=sum(sizes),
            traffic_class=exchange.traffic_class,
        )
        items_view = np.ascontiguousarray(exchange.items).view(np.uint8).data
        _send_all(
            sock,
            [
                memoryview(header.pack()),
                items_view,
                *(_flat(d) for d, n in zip(exchange.data, sizes, strict=True) if n),
            ],
        )
        raw = bytearray(HEADER_BYTES)
        recv_exact_into(sock, memoryview(raw), node)
        reply_header = Header.unpack(raw, self.owner.limits)
        if not reply_header.is_reply or reply_header.request_id != request_id:
            if reply_header.status != Status.OK and reply_header.request_id == 0:
                pass  # a request the daemon could not parse: its error reply has id 0
            else:
                raise ProtocolError(
                    f"node {node} answered request {reply_header.request_id}, expected {request_id}"
                )
        dtype = item_dtype(reply_header.op, reply=True)
        items = np.empty(reply_header.count, dtype)
        if reply_header.count:
            recv_exact_into(sock, items.view(np.uint8).data, node)
        check_message(reply_header, items, reply_header.data_len)
        if reply_header.status != Status.OK:
            text = bytearray(reply_header.data_len)
            recv_exact_into(sock, memoryview(text), node)
            raise RemoteStatusError(
                f"node {node} refused {exchange.op.name}: {reply_header.status.name}: "
                f"{text.decode('utf-8', 'replace')}",
                node=node,
                status=reply_header.status,
            )
        data: memoryview = memoryview(b"")
        if reply_header.data_len:
            landing = exchange.landing(reply_header, items)
            if landing is None:
                scratch = np.empty(reply_header.data_len, np.uint8)
                recv_exact_into(sock, scratch.data, node)
                data = scratch.data
            else:
                total = sum(v.nbytes for v in landing)
                if total != reply_header.data_len:
                    raise ProtocolError(
                        f"landing of {total} bytes for a data section of {reply_header.data_len}"
                    )
                _recv_scatter(sock, landing, node)
                exchange.landed()
        return Message(reply_header, items, data)

    def abort(self) -> None:
        """Shut the socket down: a thread blocked in it returns at once (with an error)."""
        with self.lock:
            sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _drop(self) -> None:
        with self.lock:
            sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def fail_queued(self, error: BaseException) -> None:
        """Fail every exchange still waiting in the queue."""
        while True:
            try:
                exchange = self.queue.get_nowait()
            except queue.Empty:
                return
            if exchange is None:
                self.queue.put(None)
                return
            self._finish(exchange, None, error)


class TcpTransport:
    """The data path over TCP (see the module docstring)."""

    def __init__(
        self,
        nodes: Sequence[NodeInfo],
        credentials: Credentials,
        *,
        connections_per_node: int = 2,
        connect_timeout_s: float = 2.0,
        limits: Limits | None = None,
    ) -> None:
        self.nodes = tuple(nodes)
        self.credentials = credentials
        self.connect_timeout_s = connect_timeout_s
        self.limits = limits or Limits()
        self._bulk = [
            [
                _Connection(self, i, f"kvcache-{node.id}-bulk{j}")
                for j in range(connections_per_node)
            ]
            for i, node in enumerate(self.nodes)
        ]
        self._control = [
            _Connection(self, i, f"kvcache-{node.id}-ctl") for i, node in enumerate(self.nodes)
        ]
        self._next = [itertools.count() for _ in self.nodes]
        self._closed = False

    def node_id(self, node: int) -> str:
        """The id of node ``node``."""
        return self.nodes[node].id

    def submit(self, exchange: Exchange) -> None:
        """Queue ``exchange`` on a connection of its node (control ops on the control one)."""
        if self._closed:
            exchange.finish(None, NodeError("client closed", node=self.node_id(exchange.node)))
            return
        if exchange.op in _CONTROL_OPS:
            conn = self._control[exchange.node]
        else:
            pool = self._bulk[exchange.node]
            # The least loaded connection; ties go round robin.
            start = next(self._next[exchange.node])
            conn = min(
                (pool[(start + j) % len(pool)] for j in range(len(pool))),
                key=lambda c: c.queue.qsize() + (c.busy is not None),
            )
        conn.queue.put(exchange)

    def reset(self, node: int) -> None:
        """Fail queued and in-flight exchanges of ``node``; connections reopen on next use."""
        error = NodeError(f"node {self.node_id(node)} reset", node=self.node_id(node))
        for conn in (*self._bulk[node], self._control[node]):
            conn.fail_queued(error)
            conn.abort()

    def busy_since(self) -> dict[int, float]:
        """Per node with an exchange in progress: since when the oldest one is (monotonic)."""
        out: dict[int, float] = {}
        for conn in (*(c for pool in self._bulk for c in pool), *self._control):
            with conn.lock:
                if conn.busy is not None:
                    out[conn.node] = min(out.get(conn.node, conn.busy_at), conn.busy_at)
        return out

    def abort(self, exchange: Exchange) -> None:
        """Shut down the connection carrying ``exchange`` right now, if any is."""
        for conn in (*self._bulk[exchange.node], self._control[exchange.node]):
            with conn.lock:
                carrying = conn.busy is exchange
            if carrying:
                conn.abort()

    def close(self) -> None:
        """Stop every connection thread and close the sockets."""
        if self._closed:
            return
        self._closed = True
        conns = [c for pool in self._bulk for c in pool] + self._control
        for conn in conns:
            conn.fail_queued(NodeError("client closed", node=self.node_id(conn.node)))
            conn.queue.put(None)
            conn.abort()
        for conn in conns:
            conn.thread.join(timeout=5)
            conn._drop()


def _flat(frame: Frame) -> memoryview:
    view = memoryview(frame)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def _send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Send every byte of ``views`` (gathered writes; TLS sockets send them one by one)."""
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            sock.sendall(view)
        return
    pending = [v for v in views if v.nbytes]
    while pending:
        sent = sock.sendmsg(pending[:_IOV_MAX])
        while sent:
            head = pending[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                pending.pop(0)
            else:
                pending[0] = head[sent:]
                sent = 0


def _recv_scatter(sock: socket.socket, views: list[memoryview], node: str) -> None:
    """Fill every buffer of ``views`` in order from the socket (one syscall when it can)."""
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            recv_exact_into(sock, view, node)
        return
    pending = [v for v in views if v.nbytes]
    while pending:
        batch = pending[:_IOV_MAX]
        got = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
        if got == 0:
            raise NodeError(f"node {node} closed the connection mid-reply", node=node)
        del pending[: len(batch)]
        done = 0
        for i, view in enumerate(batch):
            if got >= done + view.nbytes:
                done += view.nbytes
                continue
            # A short read (a signal, or the socket shut down): keep what is left.
            rest = [view[got - done :], *batch[i + 1 :]]
            pending[:0] = rest
            break
