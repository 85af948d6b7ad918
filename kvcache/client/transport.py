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
behind a large transfer. Every connection of the transport is served by ONE
selector loop (:class:`_Loop`), run by one thread at a time: the caller that
waits for replies runs it itself (``caller_drives``, :meth:`TcpTransport.drive`),
and the transport's I/O thread runs it only for exchanges no caller waits for
(fire-and-forget submits, a call that gave up). Requests
go out with non-blocking ``sendmsg`` straight from the caller's buffers
(pipelined, a few per connection), a reply's header and items are read, the
exchange says where the data goes, and the data is received there with
``recvmsg_into`` as it arrives. Connections are opened (TCP, TLS, session
handshake) on short-lived connector threads, so a node that does not answer
never holds up the others.

Why one thread and not one per connection (the design up to ``829384f``):
every exchange then cost a queue hand-off to its connection's thread, a
wake-up per reply and a GIL hand-over among up to three threads per node;
at 112 KiB blocks that is ~700 shard transfers per 64-block call and the
hand-offs, not the bytes, set the client's CPU per GB. One selector thread
per process pays one wake-up per batch of completions; more cores come from
I/O worker processes (:mod:`kvcache.client.pool`), each with its own loop.
Why the caller runs the loop (since ``f9a618c``): handing each finished batch
from the I/O thread to the waiting caller cost two wake-ups and a GIL
hand-over per turn, 50-84 context switches per 64-block load; a caller that
drives its own exchanges pays about 2-5, and 0.80x the client CPU per GB
(``bench/io_model.py``).

Failures (issue 18): a connection that fails takes every connection of its
node with it (after a restart they are all stale), and the exchanges that had
not started landing data are retried once on fresh connections before any
error reaches the caller, so a restarted node is never marked down for
sockets of its previous life. An idle connection whose daemon closed it is
noticed by the selector and dropped before a request is put on it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import itertools
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvcache import native
from kvcache.cluster import NodeInfo
from kvcache.errors import KVCacheError, NodeError, ProtocolError
from kvcache.net import open_session
from kvcache.wire import (
    HEADER_BYTES,
    NO_RETAIN,
    Frame,
    Header,
    Limits,
    Message,
    Op,
    Retain,
    Status,
    check_message,
    item_dtype,
)

__all__ = ["Credentials", "Exchange", "RemoteStatusError", "TcpTransport", "Transport"]

log = logging.getLogger(__name__)

#: Most buffers per recvmsg_into / sendmsg call (Linux IOV_MAX).
_IOV_MAX = 1024
_CONTROL_OPS = {Op.HAS, Op.TOUCH, Op.DELETE, Op.STATS, Op.HAS_DIR, Op.DIR_PUT}
#: Requests sent ahead of their replies on one connection (the daemon answers in order).
_PIPELINE = 4
#: Times an exchange is sent on a fresh connection after its connection failed under it.
_RETRIES = 1
#: How long exchanges left out by a call that returned wait for the next call's loop
#: before the I/O thread receives them (see TcpTransport._take_turn).
_LINGER_S = 0.005
#: How often a parked I/O thread looks for exchanges left out (see _linger_left).
_PARK_S = 0.05
_WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


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
    an error before sending). Hooks must be quick: they run on the thread that
    moves every connection's bytes.
    """

    def __init__(
        self,
        node: int,
        op: Op,
        items: npt.NDArray[np.void],
        data: Sequence[Frame] | native.Segments = (),
        *,
        traffic_class: str = "",
        retain: Retain = NO_RETAIN,
    ) -> None:
        self.node = node
        self.op = op
        self.items = items
        self.data = data
        self.traffic_class = traffic_class
        #: The request's retention hint (TTL, pin), sent in the header.
        self.retain = retain
        #: Times the transport sent it (a retry on a fresh connection adds one).
        self.attempts = 0
        #: :meth:`landing` was asked: its data may be partly written, so it is never resent.
        self.landing_asked = False

    def landing(
        self, header: Header, items: npt.NDArray[np.void]
    ) -> list[memoryview] | native.Segments | None:
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


_HEAD, _ITEMS, _TEXT, _DATA = range(4)


class _Sent:
    """An exchange on the wire, waiting for its reply."""

    __slots__ = ("at", "exchange", "request_id")

    def __init__(self, exchange: Exchange, request_id: int, at: float) -> None:
        self.exchange = exchange
        self.request_id = request_id
        self.at = at


class _Conn:
    """One connection to one node. Only the loop thread touches it (``busy_at`` aside)."""

    __slots__ = (
        "connecting",
        "control",
        "data",
        "generation",
        "header",
        "ids",
        "index",
        "items",
        "landing",
        "mask",
        "name",
        "node",
        "out",
        "queue",
        "raw",
        "raw_view",
        "rgot",
        "rstate",
        "segments",
        "sent",
        "sock",
        "tls",
        "views",
    )

    def __init__(self, node: int, name: str, *, control: bool) -> None:
        self.node = node
        self.name = name
        self.control = control
        self.sock: socket.socket | None = None
        self.tls = False
        self.connecting = False
        self.generation = 0
        self.mask = 0
        self.ids = itertools.count(1)
        self.queue: collections.deque[Exchange] = collections.deque()
        self.sent: collections.deque[_Sent] = collections.deque()
        self.out: list[memoryview | native.Segments] = []  # unsent request bytes, in order
        # The reply header's buffer, reused: a header is parsed as soon as it is in.
        self.raw = bytearray(HEADER_BYTES)
        self.raw_view = memoryview(self.raw)
        self._reset_reader()

    def _reset_reader(self) -> None:
        self.rstate = _HEAD
        self.rgot = 0
        self.header: Header | None = None
        self.items: npt.NDArray[np.void] | None = None
        self.data: npt.NDArray[np.uint8] | None = None
        self.landing = False
        self.views: list[memoryview] = []
        self.segments: native.Segments | None = None
        self.index = 0

    @property
    def load(self) -> int:
        return len(self.queue) + len(self.sent)

    @property
    def busy_since(self) -> float | None:
        sent = self.sent
        try:
            return sent[0].at if sent else None
        except IndexError:  # emptied by the loop thread meanwhile
            return None


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
        clock: Callable[[], float] = time.monotonic,
        caller_drives: bool = True,
    ) -> None:
        self.nodes: tuple[NodeInfo, ...] = ()
        self.credentials = credentials
        self.connect_timeout_s = connect_timeout_s
        self.connections_per_node = connections_per_node
        self.limits = limits or Limits()
        self.clock = clock
        #: Failed connections, and exchanges resent on fresh ones (for tests and stats).
        self.counters: dict[str, int] = {"connection_failures": 0, "retries": 0, "stale_closed": 0}
        self._bulk: list[list[_Conn]] = []
        self._control: list[_Conn] = []
        self._grow = threading.Lock()
        self._closed = False
        self._inbox: collections.deque[tuple[str, object]] = collections.deque()
        self._woken = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._connectors = concurrent.futures.ThreadPoolExecutor(
            max_workers=16, thread_name_prefix="kvcache-connect"
        )
        #: Who runs the loop now: None (nobody: the I/O thread is parked), "io" (the I/O
        #: thread) or "caller" (a thread waiting in :meth:`drive`). Guarded by ``_turn``.
        self._runner: str | None = None
        self._turn = threading.Condition(threading.Lock())
        #: Callers waiting for the I/O thread to hand the loop over.
        self._wanted = 0
        self._stopped = False
        self._idle_since = 0.0
        #: Counted hand-overs (for tests and stats): loops run by callers, I/O thread turns.
        self.counters |= {"caller_turns": 0, "io_turns": 0}
        self.caller_drives = caller_drives
        for node in nodes:
            self.add(node)
        self._thread = threading.Thread(target=self._run, name="kvcache-io", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread

    def add(self, node: NodeInfo) -> int:
        """Add ``node`` (a node that joined the map, or one at a new address); its index.

        Indices only grow: a node that leaves the map keeps its index, unused.
        """
        with self._grow:
            if self._closed:
                raise NodeError("client closed", node=node.id)
            index = len(self.nodes)
            self._bulk.append(self._connections(index, node))
            self._control.append(_Conn(index, f"{node.id}-ctl", control=True))
            self.nodes = (*self.nodes, node)
            return index

    def _connections(self, index: int, node: NodeInfo) -> list[_Conn]:
        return [
            _Conn(index, f"{node.id}-bulk{j}", control=False)
            for j in range(self.connections_per_node)
        ]

    def node_id(self, node: int) -> str:
        """The id of node ``node``."""
        return self.nodes[node].id

    def submit(self, exchange: Exchange) -> None:
        """Queue ``exchange`` on a connection of its node (control ops on the control one)."""
        if self._closed:
            exchange.finish(None, NodeError("client closed", node=self.node_id(exchange.node)))
            return
        self._post("submit", exchange)

    def submit_then_drive(self, exchange: Exchange) -> None:
        """:meth:`submit`, from a thread that calls :meth:`drive` next to wait for it: sent
        at once from this thread if nobody runs the loop now, and nobody is woken."""
        if self._closed:
            exchange.finish(None, NodeError("client closed", node=self.node_id(exchange.node)))
            return
        self._post("submit", exchange, lazy=True)

    def reset(self, node: int) -> None:
        """Fail queued and in-flight exchanges of ``node``; it gets fresh connections."""
        self._post("reset", node)

    def abort(self, exchange: Exchange) -> None:
        """Cut the connection carrying ``exchange`` right now, if any is."""
        self._post("abort", exchange)

    def busy_since(self) -> dict[int, float]:
        """Per node with an exchange in progress: since when the oldest one is (monotonic)."""
        out: dict[int, float] = {}
        for conn in (*(c for pool in self._bulk for c in pool), *self._control):
            since = conn.busy_since
            if since is not None:
                out[conn.node] = min(out.get(conn.node, since), since)
        return out

    def close(self) -> None:
        """Fail everything, close every connection and stop the I/O thread."""
        with self._grow:
            if self._closed:
                return
            self._closed = True
        self._post("close", None)
        self._thread.join(timeout=10)
        self._connectors.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(OSError):
            self._wake_w.close()

    def _post(self, what: str, arg: object, *, lazy: bool = False) -> None:
        """Hand ``arg`` to whoever runs the loop. ``lazy``: the posting thread drives the
        loop next (a submit followed by :meth:`drive`), so nobody needs waking if nobody
        runs it now."""
        self._inbox.append((what, arg))
        if lazy and self.caller_drives and self._send_now():
            return
        with self._turn:
            if self._runner is None:
                self._turn.notify_all()  # the parked I/O thread takes the loop and drains
                if self.caller_drives:
                    return
        self._wake()

    def _send_now(self) -> bool:
        """Drain the inbox (send what was submitted) on this thread if nobody runs the loop;
        False if someone does (then it must be woken to drain it)."""
        with self._turn:
            if self._runner is not None or self._wanted or self._stopped:
                return False
            self._runner = "caller"
        try:
            if not self._drain():
                self._stop_loop()
        finally:
            with self._turn:
                self._runner = None
                self._idle_since = self.clock()
                # Not woken for the exchanges now out: this thread receives them next.
                if self._wanted or self._stopped or self._inbox:
                    self._turn.notify_all()
        return True

    def _wake(self) -> None:
        """Make a loop blocked in select return (a byte on the wake socket)."""
        if not self._woken:
            self._woken = True
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

    # ------------------------------------------------------------------ running the loop

    def drive(self, until: float | None, done: Callable[[], bool]) -> bool:
        """Run the loop on the calling thread until ``done()`` or ``until`` (monotonic; None:
        until done); False, at once, if another caller runs it (then wait as usual).

        Why: a call that waits for its own replies can as well receive them. Handing each
        batch of completions from an I/O thread to the waiting caller cost a wake-up and
        a thread switch per batch, and a GIL hand-over per syscall while both ran; the I/O
        thread now runs only while exchanges are out that no caller waits for (a hedge's
        late answers, asynchronous loads).
        """
        if not self.caller_drives:
            return False
        with self._turn:
            while self._runner is not None:
                if self._runner == "caller" or self._stopped:
                    # Another caller runs the loop: it drains what this thread posted
                    # once its select returns, so make it return.
                    self._wake()
                    return False
                self._wanted += 1
                self._wake()
                self._turn.wait()
                self._wanted -= 1
            if self._stopped:
                return False
            self._runner = "caller"
            self.counters["caller_turns"] += 1
        try:
            # Sockets that became ready while nobody ran the loop first (an idle connection
            # its daemon closed is dropped before a request is put on it), then what this
            # thread posted, then the replies.
            if self._events(0.0):
                while not done():
                    timeout = None if until is None else max(0.0, until - self.clock())
                    if not self._step(timeout) or timeout == 0.0:
                        break
        finally:
            self._hand_back()
        return True

    def _hand_back(self) -> None:
        with self._turn:
            self._runner = None
            self._idle_since = self.clock()
            if self._wanted or self._stopped or self._inbox or not self.caller_drives:
                self._turn.notify_all()

    def _busy(self) -> bool:
        """Some exchange is queued, on the wire or waiting for its connection."""
        for pool in self._bulk:
            for conn in pool:
                if conn.queue or conn.sent or conn.connecting:
                    return True
        return any(conn.queue or conn.sent or conn.connecting for conn in self._control)

    def _run(self) -> None:
        """The I/O thread: runs the loop whenever no caller does and there is work."""
        try:
            while True:
                with self._turn:
                    while not self._take_turn():
                        self._turn.wait(self._linger_left())
                    if self._stopped:
                        return
                    self._runner = "io"
                    self.counters["io_turns"] += 1
                try:
                    while self._step(None):
                        if self._wanted or (
                            self.caller_drives and not (self._inbox or self._busy())
                        ):
                            break
                finally:
                    self._hand_back()
        except BaseException:  # pragma: no cover - a bug here would hang every caller
            log.exception("client I/O loop failed")
            self._shutdown(NodeError("client I/O loop failed", node="*"))
            raise

    def _take_turn(self) -> bool:
        """Whether the I/O thread runs the loop now (or stops); called holding ``_turn``.

        It does when something was posted that no caller will drain, and when exchanges
        are out that no caller has received for ``_LINGER_S``: the late answers of a
        call that has returned (a hedge's eleventh shard) are left to the next call's
        loop if one comes soon, which saves a thread that receives them while the
        caller, holding the GIL, goes on with its work.
        """
        if self._stopped:
            return True
        if self._runner is not None or self._wanted:
            return False
        if not self.caller_drives or self._inbox:
            return True
        return self._busy() and self.clock() - self._idle_since >= _LINGER_S

    def _linger_left(self) -> float:
        """How long the parked I/O thread sleeps: until the linger of exchanges left out
        ends, or a while (it is not woken for exchanges that callers leave out, which
        would cost a wake-up per wait of every call)."""
        if self._runner is not None or self._wanted or not self._busy():
            return _PARK_S
        return max(0.0, _LINGER_S - (self.clock() - self._idle_since))

    def _step(self, timeout: float | None) -> bool:
        """One pass of the loop: what was posted, then the sockets that are ready (waiting
        at most ``timeout``); False once the transport is closed."""
        if self._stopped:
            return False
        if self._inbox and not self._drain():
            self._stop_loop()
            return False
        return self._events(0 if self._inbox else timeout)

    def _events(self, timeout: float | None) -> bool:
        """Handle the sockets that are ready, waiting at most ``timeout``; False once closed."""
        if self._stopped:
            return False
        for key, mask in self._selector.select(timeout):
            conn = key.data
            if conn is None:
                # Consume the wake bytes first, then allow new ones: a post after
                # this point sends a byte; one before it is in the inbox, drained next.
                with contextlib.suppress(OSError):
                    while self._wake_r.recv(4096):
                        pass
                self._woken = False
                continue
            if mask & selectors.EVENT_WRITE:
                self._flush(conn)
            if mask & selectors.EVENT_READ and conn.sock is not None:
                self._receive(conn)
        return True

    def _stop_loop(self) -> None:
        with self._turn:
            self._stopped = True
            self._turn.notify_all()

    def _drain(self) -> bool:
        """Handle what other threads posted; False once the transport is closing."""
        inbox = self._inbox
        while inbox:
            what, arg = inbox.popleft()
            if what == "submit":
                assert isinstance(arg, Exchange)
                self._queue(arg)
            elif what == "connected":
                self._connected(*arg)  # type: ignore[misc]
            elif what == "reset":
                assert isinstance(arg, int)
                node = self.node_id(arg)
                self._reset_node(arg, NodeError(f"node {node} reset", node=node), retry=False)
            elif what == "abort":
                assert isinstance(arg, Exchange)
                self._abort(arg)
            elif what == "close":
                self._shutdown(NodeError("client closed", node="*"))
                return False
        return True

    def _queue(self, exchange: Exchange) -> None:
        node = exchange.node
        if exchange.op in _CONTROL_OPS:
            conn = self._control[node]
        else:
            conn = min(self._bulk[node], key=_load)
        conn.queue.append(exchange)
        self._pump(conn)

    def _pump(self, conn: _Conn) -> None:
        """Put queued requests on the wire (connecting first if needed)."""
        if conn.sock is None:
            if conn.queue and not conn.connecting:
                self._connect(conn)
            return
        now = self.clock()
        while conn.queue and len(conn.sent) < _PIPELINE:
            exchange = conn.queue.popleft()
            request_id = next(conn.ids)
            try:
                conn.out += _request(exchange, request_id)
            except Exception as exc:  # a request that cannot even be built fails alone
                _finish(exchange, None, exc)
                continue
            exchange.attempts += 1
            conn.sent.append(_Sent(exchange, request_id, now))
        if conn.out:
            self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        sock = conn.sock
        if sock is None:
            return
        out = conn.out
        gather = native.AVAILABLE and not conn.tls
        try:
            while out:
                first = out[0]
                if isinstance(first, native.Segments):
                    if not gather:
                        out[0:1] = first.views()
                        continue
                    native.send_gather(sock.fileno(), first)
                    if not first.done:
                        break  # the socket's buffer is full: wait until it is writable
                    del out[0]
                    continue
                if conn.tls:
                    sent = sock.send(first)
                else:
                    end = 1
                    while end < len(out) and end < _IOV_MAX and type(out[end]) is memoryview:
                        end += 1
                    sent = sock.sendmsg(out[:end])  # type: ignore[arg-type]
                while sent:
                    head = out[0]
                    assert isinstance(head, memoryview)
                    if sent >= head.nbytes:
                        sent -= head.nbytes
                        del out[0]
                    else:
                        out[0] = head[sent:]
                        sent = 0
        except _WOULD_BLOCK:
            pass
        except (OSError, ssl.SSLError) as exc:
            self._failed(conn, exc)
            return
        self._watch(conn)

    def _watch(self, conn: _Conn) -> None:
        sock = conn.sock
        if sock is None:
            return
        mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        if mask != conn.mask:
            self._selector.modify(sock, mask, conn)
            conn.mask = mask

    def _receive(self, conn: _Conn) -> None:
        """Read what has arrived; finish every reply that is complete."""
        sock = conn.sock
        assert sock is not None
        try:
            while True:
                if conn.sock is not sock:
                    return  # dropped while a reply was handled
                if conn.rstate == _DATA:
                    self._recv_data(conn, sock)
                    self._complete(conn)
                    if not conn.sent:
                        return  # nothing more is due: no recv that can only say EAGAIN
                    continue
                if conn.rstate == _HEAD:
                    view = conn.raw_view
                elif conn.rstate == _ITEMS:
                    assert conn.items is not None
                    view = conn.items.view(np.uint8).data
                else:
                    assert conn.data is not None
                    view = conn.data.data
                if conn.rgot < view.nbytes:
                    n = sock.recv_into(view[conn.rgot :])
                    if n == 0:
                        if not conn.sent and conn.rstate == _HEAD and conn.rgot == 0:
                            self.counters["stale_closed"] += 1
                            self._drop(conn)  # an idle connection the daemon closed
                            return
                        node = self.node_id(conn.node)
                        raise NodeError(f"node {node} closed the connection", node=node)
                    conn.rgot += n
                    if conn.rgot < view.nbytes:
                        continue
                self._advance(conn)
                if conn.rstate == _HEAD and not conn.sent:
                    return  # that reply was the last one due
        except _WOULD_BLOCK:
            return
        except (OSError, ssl.SSLError, KVCacheError) as exc:
            self._failed(conn, exc)
        except Exception as exc:  # a landing hook that failed: the stream is lost
            log.exception("a reply from node %s could not be received", self.node_id(conn.node))
            self._failed(conn, exc)

    def _advance(self, conn: _Conn) -> None:
        """A section is complete: parse it and set up the next one."""
        node = self.node_id(conn.node)
        if conn.rstate == _HEAD:
            if not conn.sent:
                raise ProtocolError(f"node {node} sent a reply to no request")
            header = Header.unpack(conn.raw, self.limits)
            expected = conn.sent[0].request_id
            if not header.is_reply or (
                header.request_id != expected
                and not (header.status != Status.OK and header.request_id == 0)
            ):
                raise ProtocolError(
                    f"node {node} answered request {header.request_id}, expected {expected}"
                )
            conn.header = header
            conn.items = np.empty(header.count, item_dtype(header.op, reply=True))
            conn.rstate, conn.rgot = _ITEMS, 0
            if header.count:
                return
        current = conn.header
        assert current is not None and conn.items is not None
        header = current
        if conn.rstate == _ITEMS:
            check_message(header, conn.items, header.data_len)
            if header.status != Status.OK:
                conn.data = np.empty(header.data_len, np.uint8)
                conn.rstate, conn.rgot = _TEXT, 0
                if header.data_len:
                    return
            elif header.data_len:
                exchange = conn.sent[0].exchange
                exchange.landing_asked = True
                views = exchange.landing(header, conn.items)
                if isinstance(views, native.Segments):
                    if views.nbytes != header.data_len:
                        raise ProtocolError(
                            f"landing of {views.nbytes} bytes for a data section of "
                            f"{header.data_len}"
                        )
                    if native.AVAILABLE and not conn.tls:
                        conn.segments = views
                    else:
                        conn.views = views.views()
                    conn.landing = True
                elif views is None:
                    conn.data = np.empty(header.data_len, np.uint8)
                    conn.views = [conn.data.data]
                else:
                    total = sum(v.nbytes for v in views)
                    if total != header.data_len:
                        raise ProtocolError(
                            f"landing of {total} bytes for a data section of {header.data_len}"
                        )
                    conn.views = [v for v in views if v.nbytes]
                    conn.landing = True
                conn.rstate, conn.index = _DATA, 0
                return
        self._complete(conn)

    def _recv_data(self, conn: _Conn, sock: socket.socket) -> None:
        """Receive into the landing buffers until all are full (or the socket would block)."""
        segments = conn.segments
        if segments is not None:
            while not segments.done:
                native.recv_scatter(sock.fileno(), segments)  # BlockingIOError: nothing yet
                if segments.closed:
                    node = self.node_id(conn.node)
                    raise NodeError(f"node {node} closed the connection mid-reply", node=node)
                if not segments.done:
                    raise BlockingIOError  # the rest has not arrived yet
            return
        views = conn.views
        while conn.index < len(views):
            if conn.tls:
                got = sock.recv_into(views[conn.index])
            else:
                got = sock.recvmsg_into(views[conn.index : conn.index + _IOV_MAX])[0]
            if got == 0:
                node = self.node_id(conn.node)
                raise NodeError(f"node {node} closed the connection mid-reply", node=node)
            i = conn.index
            while got:
                head = views[i]
                if got >= head.nbytes:
                    got -= head.nbytes
                    i += 1
                else:
                    views[i] = head[got:]
                    got = 0
            conn.index = i

    def _complete(self, conn: _Conn) -> None:
        """The reply at the head of ``conn`` is in: hand it to its exchange."""
        header, items = conn.header, conn.items
        assert header is not None and items is not None
        sent = conn.sent.popleft()
        exchange = sent.exchange
        node = self.node_id(conn.node)
        data, landing = conn.data, conn.landing
        conn._reset_reader()
        if header.status != Status.OK:
            text = b"" if data is None else data.tobytes()
            _finish(
                exchange,
                None,
                RemoteStatusError(
                    f"node {node} refused {exchange.op.name}: {header.status.name}: "
                    f"{text.decode('utf-8', 'replace')}",
                    node=node,
                    status=header.status,
                ),
            )
        else:
            if landing:
                exchange.landed()
            body = data.data if data is not None else memoryview(b"")
            _finish(exchange, Message(header, items, body), None)
        self._pump(conn)

    # ------------------------------------------------------------------ connections

    def _connect(self, conn: _Conn) -> None:
        conn.connecting = True
        generation = conn.generation
        info = self.nodes[conn.node]
        credentials = self.credentials

        def open_one() -> None:
            try:
                sock: socket.socket | BaseException = open_session(
                    info.data,
                    tenant=credentials.tenant,
                    secret=credentials.secret,
                    timeout_s=self.connect_timeout_s,
                    node=info.id,
                    tls=credentials.tls,
                )
            except BaseException as exc:
                sock = exc
            self._post("connected", (conn, generation, sock))

        try:
            self._connectors.submit(open_one)
        except RuntimeError:  # shutting down
            conn.connecting = False

    def _connected(
        self, conn: _Conn, generation: int, result: socket.socket | BaseException
    ) -> None:
        if generation != conn.generation or self._closed:
            if isinstance(result, socket.socket):
                result.close()
            return
        conn.connecting = False
        if isinstance(result, BaseException):
            error = (
                result
                if isinstance(result, KVCacheError)
                else NodeError(
                    f"node {self.node_id(conn.node)}: {result}", node=self.node_id(conn.node)
                )
            )
            self.counters["connection_failures"] += 1
            while conn.queue:
                _finish(conn.queue.popleft(), None, error)
            return
        result.setblocking(False)
        conn.sock = result
        conn.tls = isinstance(result, ssl.SSLSocket)
        conn.mask = selectors.EVENT_READ
        self._selector.register(result, conn.mask, conn)
        self._pump(conn)

    def _drop(self, conn: _Conn) -> list[Exchange]:
        """Close ``conn``'s socket; the exchanges that were on it (sent first, then queued)."""
        sock, conn.sock = conn.sock, None
        if sock is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._selector.unregister(sock)
            with contextlib.suppress(OSError):
                sock.close()
        conn.generation += 1
        conn.connecting = False
        conn.mask = 0
        conn.out = []
        conn._reset_reader()
        on_it = [s.exchange for s in conn.sent] + list(conn.queue)
        conn.sent.clear()
        conn.queue.clear()
        return on_it

    def _failed(self, conn: _Conn, exc: BaseException) -> None:
        """``conn`` broke: every connection of its node goes, and what can be is resent."""
        node = self.node_id(conn.node)
        if isinstance(exc, KVCacheError) and not isinstance(exc, ProtocolError):
            error: BaseException = exc
        else:
            error = NodeError(f"node {node}: {exc}", node=node)
        if isinstance(exc, (OSError, ssl.SSLError)) and not _is_reset(exc):
            log.debug("connection %s failed: %s", conn.name, exc)
        self.counters["connection_failures"] += 1
        self._reset_node(conn.node, error, retry=True)

    def _reset_node(self, node: int, error: BaseException, *, retry: bool) -> None:
        resend: list[Exchange] = []
        for conn in (*self._bulk[node], self._control[node]):
            for exchange in self._drop(conn):
                if retry and exchange.attempts <= _RETRIES and not exchange.landing_asked:
                    resend.append(exchange)
                else:
                    _finish(exchange, None, error)
        for exchange in resend:
            if exchange.attempts:
                self.counters["retries"] += 1
            self._queue(exchange)

    def _abort(self, exchange: Exchange) -> None:
        for conn in (*self._bulk[exchange.node], self._control[exchange.node]):
            if any(s.exchange is exchange for s in conn.sent):
                node = self.node_id(exchange.node)
                error = NodeError(f"node {node}: exchange aborted", node=node)
                others: list[Exchange] = []
                for ex in self._drop(conn):
                    if ex is exchange or ex.landing_asked:
                        _finish(ex, None, error)
                    else:
                        others.append(ex)
                for ex in others:
                    self._queue(ex)
                return

    def _shutdown(self, error: BaseException) -> None:
        for conn in (*(c for pool in self._bulk for c in pool), *self._control):
            for exchange in self._drop(conn):
                _finish(exchange, None, error)
        while self._inbox:
            what, arg = self._inbox.popleft()
            if what == "submit" and isinstance(arg, Exchange):
                _finish(arg, None, error)
            elif what == "connected":
                result = arg[2]  # type: ignore[index]
                if isinstance(result, socket.socket):
                    result.close()
        with contextlib.suppress(OSError):
            self._selector.close()
        with contextlib.suppress(OSError):
            self._wake_r.close()


def _load(conn: _Conn) -> int:
    return conn.load


def _finish(exchange: Exchange, reply: Message | None, error: BaseException | None) -> None:
    try:
        exchange.finish(reply, error)
    except Exception:  # a bug in a hook must not stop the I/O thread
        log.exception("exchange completion failed")


def _request(exchange: Exchange, request_id: int) -> list[memoryview | native.Segments]:
    """The sections of ``exchange``'s request (header, items, data): byte views, or one
    set of segments (header and items first) when the data is given as segments."""
    data = exchange.data
    if isinstance(data, native.Segments):
        sizes = [data.nbytes]
    else:
        sizes = [memoryview(d).nbytes for d in data]
    header = Header(
        op=exchange.op,
        request_id=request_id,
        count=len(exchange.items),
        data_len=sum(sizes),
        traffic_class=exchange.traffic_class,
        retain=exchange.retain,
    )
    packed = np.frombuffer(header.pack(), np.uint8)
    items = np.ascontiguousarray(exchange.items).view(np.uint8)
    if isinstance(data, native.Segments):
        lead = np.array([native.addresses_of(packed), native.addresses_of(items)], np.uint64)
        sizes_lead = np.array([packed.nbytes, items.nbytes], np.uint64)
        combined = native.Segments.of(
            np.concatenate([lead, data.addrs]),
            np.concatenate([sizes_lead, data.lens]),
            (packed, items, data.keepalive),
        )
        return [combined]
    views: list[memoryview | native.Segments] = [packed.data]
    if items.nbytes:
        views.append(items.data)
    views += [_flat(d) for d, n in zip(data, sizes, strict=True) if n]
    return views


def _is_reset(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ECONNRESET, errno.EPIPE)


def _flat(frame: Frame) -> memoryview:
    view = memoryview(frame)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")
