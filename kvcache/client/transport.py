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
import os
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from kvcache import native
from kvcache.cluster import NodeInfo
from kvcache.errors import ExchangeAbortedError, KVCacheError, NodeError, ProtocolError
from kvcache.net import open_session
from kvcache.wire import (
    COUNT_AT,
    DATA_LEN_AT,
    FLAG_REPLY,
    HEADER_BYTES,
    NO_RETAIN,
    REQUEST_ID_AT,
    Frame,
    Header,
    Limits,
    Message,
    Op,
    Retain,
    Status,
    check_message,
    item_dtype,
    pack_header,
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
    #: Refuse a daemon whose HELLO announces another node id than the map's (a map from
    #: etcd, where each entry is the node's own registration; see kvcache.session).
    require_node_ids: bool = False


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
        #: The address of ``items`` when whoever built them knows it (0: look it up).
        self.items_at = 0

    def landing(
        self, header: Header, items: npt.NDArray[np.void]
    ) -> list[memoryview] | native.Segments | None:
        """Where the reply's data section goes (None: a scratch buffer)."""
        return None

    def finish(self, reply: Message | None, error: BaseException | None) -> None:
        """The reply arrived (``error`` None) or the exchange failed."""

    def landed(self) -> None:
        """The data section was received into the buffers :meth:`landing` returned."""

    def burst_landing(self) -> BurstLanding | None:
        """What a native burst (:meth:`TcpTransport.burst`) needs to land this exchange's GET
        reply itself; None: this exchange goes the usual way."""
        return None

    def landed_natively(self, landing: native.GetLanding) -> None:
        """A burst landed this exchange's reply with ``landing`` (instead of :meth:`landing`)
        and left the rest of it to this transport."""

    def burst_done(self, accepted: npt.NDArray[np.bool_], item_flags: int = 0) -> None:
        """A burst landed and accepted this exchange's whole reply (``accepted``: its shards'
        verdicts; ``item_flags``: its items' flag bytes OR-ed); :meth:`finish` follows."""


class BurstLanding(NamedTuple):
    """How a burst lands a GET reply (kvcache.native.get_burst): the addresses of the asked
    shards' int64 block and index arrays (alive as long as the exchange) and of the
    assembly's burst tables (``LoadAssembly.burst_target``; one assembly per burst). A named
    tuple: one is made per exchange of every burst."""

    shards_at: tuple[int, int]
    target_at: int
    #: The blocks asked, [first, end), how many shards of each a load needs (k), and the
    #: block of each shard asked: a burst returns once every block has k shards, or all its
    #: own exchanges ask of it (stragglers are the loop's).
    span: tuple[int, int] = (0, 0)
    k: int = 0
    blocks: npt.NDArray[np.int64] = np.zeros(0, np.int64)


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
        burst: bool = True,
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
        #: Counted hand-overs (for tests and stats): loops run by callers, I/O thread turns;
        #: exchanges a native burst took, and those it finished alone.
        self.counters |= {"caller_turns": 0, "io_turns": 0, "burst_taken": 0, "burst_done": 0}
        #: Burst exchanges left to the loop, by where they stood (see kvcache.native.Burst).
        self.counters |= {f"burst_left_{name}": 0 for name in _BURST_LEFT.values()}
        self.caller_drives = caller_drives
        #: Whether :meth:`burst` runs (else it hands every exchange back to be submitted).
        self.bursts = burst
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
                    if self._inbox:
                        # What other threads posted may finish the exchanges waited for (a
                        # watchdog's reset fails them): look at done() again before the
                        # select, which nothing would wake then.
                        if not self._drain():
                            self._stop_loop()
                            break
                        continue
                    timeout = None if until is None else max(0.0, until - self.clock())
                    if not self._events(timeout) or timeout == 0.0:
                        break
        finally:
            self._hand_back()
        return True

    def burst(self, exchanges: Sequence[Exchange], until: float | None) -> list[Exchange]:
        """Send GET ``exchanges`` (each with a :meth:`Exchange.burst_landing`, one per node)
        and receive their replies in ONE native call on this thread, until each is in or
        ``until`` (monotonic) comes; their outcomes go to their ``finish`` hooks as usual.
        Returns those it did not take (no idle plain-TCP connection to their node, another
        thread runs the loop, no native library): submit them.

        Why: per exchange the Python transport costs a request built and sent, a reply's
        header and items read, parsed and landed, about 50 µs of the caller's CPU, 12 times
        per load on 12 nodes, in a client whose one thread sets a load's pace (the 2-core
        VM's loads were client-bound at 28 % idle CPU). An exchange the burst cannot finish
        alone (an unexpected reply, a landing it declines, the deadline) is left on its
        connection where it stands, and this loop goes on with it.
        """
        return self._burst_turn(exchanges, lambda: self._burst(exchanges, until))

    def burst_plain(
        self, exchanges: Sequence[Exchange], until: float | None, *, min_left: int = 0
    ) -> list[Exchange]:
        """:meth:`burst` for control requests of one op whose replies are items and no data
        (HAS), one per node, each on its node's control connection if that is idle: sent,
        and their replies read whole, in ONE native call, until each is
        in, or ``until`` comes, or no more than ``min_left`` are still out and a short grace
        for them has passed (``kvcache.native.get_burst``: the round may not need them).
        Returns those it did not take: submit them. A reply it cannot read alone (one with
        data, more items than it made room for, not the expected header) is left on its
        connection where it stands, and this loop goes on with it.

        Why: a match over 48 nodes is 48 HAS exchanges, each about 25 µs of the caller's
        Python through this loop (``bench/scale.py``, issue 21)."""
        op = exchanges[0].op if exchanges else Op.HAS
        if any(
            x.op is not op
            or (x.data and not isinstance(x.data, native.Segments))
            or x.burst_landing() is not None
            for x in exchanges
        ):
            return list(exchanges)
        return self._burst_turn(exchanges, lambda: self._burst_plain(exchanges, until, min_left))

    def _burst_turn(
        self, exchanges: Sequence[Exchange], run: Callable[[], list[Exchange]]
    ) -> list[Exchange]:
        """Run a burst (``run``) on this thread if it may take the loop now; else hand every
        exchange back."""
        if not (native.AVAILABLE and self.bursts and self.caller_drives and exchanges):
            return list(exchanges)
        if self._closed:
            return list(exchanges)
        with self._turn:
            if self._runner is not None or self._wanted or self._stopped:
                return list(exchanges)
            self._runner = "caller"
            self.counters["caller_turns"] += 1
        try:
            # Idle connections their daemon closed are dropped first (as drive() does).
            if not self._events(0.0):
                return list(exchanges)
            if not self._drain():
                self._stop_loop()
                return list(exchanges)
            return run()
        finally:
            self._hand_back()

    def _burst_plain(
        self, exchanges: Sequence[Exchange], until: float | None, min_left: int
    ) -> list[Exchange]:
        taken: list[tuple[Exchange, _Conn, None, int]] = []
        rest: list[Exchange] = []
        busy: set[int] = set()
        for exchange in exchanges:
            # A control op goes on its node's control connection, as submit() sends it (a
            # match never queues behind a load's bulk transfers); a PUT on a bulk one.
            if exchange.op in _CONTROL_OPS:
                conn: _Conn | None = self._control[exchange.node]
                if conn is not None and (id(conn) in busy or not _idle(conn)):
                    conn = None
            else:
                conn = self._idle_bulk(exchange.node, busy)
            if conn is None:
                rest.append(exchange)
                continue
            busy.add(id(conn))
            taken.append((exchange, conn, None, next(conn.ids)))
        if not taken:
            return rest
        # The rest go out first: a control op on its own node's control connection (the
        # burst does not use it), a PUT on a bulk connection the burst does not use; a
        # send that fails at once may reset a node whose connection the burst took.
        later = self._send_rest(rest, busy)
        taken, later = _still_idle(taken, later)
        if not taken:
            return later
        n = len(taken)
        op = taken[0][0].op
        now = self.clock()
        counts = np.fromiter((len(t[0].items) for t in taken), np.int64, n)
        heads = _request_heads(op, taken, counts)
        reply_dtype = item_dtype(op, reply=True)
        # A HAS: room for two answers a key asked, and a few more (a node holding more,
        # several shards of a block or leftovers of other writes, is answered past the
        # burst). Other ops: an answer an item.
        caps = 2 * counts + 8 if op is Op.HAS else counts
        item_at = np.zeros(n, np.int64)
        np.cumsum(caps[:-1], out=item_at[1:])
        reply_heads = np.empty(HEADER_BYTES * n, np.uint8)
        reply_items = np.empty(int(caps.sum()) * reply_dtype.itemsize, np.uint8)
        table, items_sent = _burst_table(
            taken, heads, reply_heads, reply_items, item_at, caps, reply_dtype.itemsize
        )
        table["reply_item"] = reply_dtype.itemsize
        datas = [t[0].data if isinstance(t[0].data, native.Segments) else None for t in taken]
        if any(d is not None for d in datas):
            # The data sections' lengths into the headers; each sent from its start.
            lens = np.array([0 if d is None else d.nbytes for d in datas], "<u8")
            heads.reshape(n, HEADER_BYTES)[:, DATA_LEN_AT : DATA_LEN_AT + 8] = lens.view(
                np.uint8
            ).reshape(-1, 8)
            for d in datas:
                if d is not None:
                    d.table[2 * d.cap : 2 * d.cap + 3] = 0
        table["data_at"] = [d.pointers[0] if d is not None else 0 for d in datas]
        table["data_cap"] = [d.cap if d is not None else 0 for d in datas]
        table["data_count"] = [d.count if d is not None else 0 for d in datas]
        _mark_sent(taken, now)
        wait = 0.0 if until is None else max(0.0, until - self.clock())
        try:
            native.get_burst(
                table, 0, wait, self.limits.max_data_bytes, wake_fd=self._wake_r.fileno(),
                min_left=min_left,
            )  # fmt: skip
        except OSError as exc:  # poll() failed: each connection reports on its own next
            log.warning("native burst failed: %s", exc)
        states = table["state"].tolist()
        replied = table["reply_count"].tolist()
        self.counters["burst_taken"] += n
        all_items = reply_items.view(reply_dtype)
        heads_rows = reply_heads.reshape(n, HEADER_BYTES)
        firsts = item_at.tolist()
        left: list[tuple[int, _BurstBuffers]] = []
        pumps: list[_Conn] = []
        done = 0
        for j, (exchange, conn, _none, request_id) in enumerate(taken):
            items = all_items[firsts[j] : firsts[j] + replied[j]]
            state = states[j]
            if state == native.Burst.DONE:
                done += 1
                sent = conn.sent.popleft()
                assert sent.exchange is exchange
                header = Header(op=op, request_id=request_id, count=replied[j], flags=FLAG_REPLY)
                _finish(exchange, Message(header, items, _EMPTY), None)
                if conn.queue:
                    pumps.append(conn)
                continue
            self.counters[f"burst_left_{_BURST_LEFT[state]}"] += 1
            bufs = _BurstBuffers(
                heads[HEADER_BYTES * j : HEADER_BYTES * (j + 1)].data,
                items_sent[j].view(np.uint8).data,
                items,
                heads_rows[j],
                np.zeros(0, np.uint64),
                0,
                datas[j],
            )
            left.append((j, bufs))
        self.counters["burst_done"] += done
        self._burst_over(taken, [(j, None, bufs) for j, bufs in left], states, table, pumps)
        return later

    def _send_rest(self, rest: list[Exchange], busy: set[int]) -> list[Exchange]:
        """Send the exchanges a burst does not take on connections it does not use (else
        they would wait for it; a control op on its node's control connection); those of a
        node whose every such connection it uses are returned."""
        later: list[Exchange] = []
        for exchange in rest:
            spare: _Conn | None
            if exchange.op in _CONTROL_OPS:
                ctl = self._control[exchange.node]
                spare = None if id(ctl) in busy else ctl
            else:
                spare = self._free_bulk(exchange.node, busy)
            if spare is None:
                later.append(exchange)
            else:
                spare.queue.append(exchange)
                self._pump(spare)
        return later

    def _burst(self, exchanges: Sequence[Exchange], until: float | None) -> list[Exchange]:
        taken: list[tuple[Exchange, _Conn, BurstLanding, int]] = []
        rest: list[Exchange] = []
        busy: set[int] = set()  # connections this burst already uses: one exchange each
        for exchange in exchanges:
            how = exchange.burst_landing()
            conn = self._idle_bulk(exchange.node, busy) if how is not None else None
            if how is None or conn is None or (taken and how.target_at != taken[0][2].target_at):
                rest.append(exchange)
                continue
            busy.add(id(conn))
            taken.append((exchange, conn, how, next(conn.ids)))
        if not taken:
            return rest
        # The rest go out first, on connections the burst does not use (else they would
        # wait for it); those of a node whose every connection it uses are handed back.
        later = self._send_rest(rest, busy)
        taken, later = _still_idle(taken, later)
        if not taken:
            return later
        n = len(taken)
        now = self.clock()
        counts = np.fromiter((len(t[0].items) for t in taken), np.int64, n)
        # One buffer for the requests' headers, one for the replies' headers and items, one
        # for the landing tables: three addresses taken, the rest arithmetic.
        heads = _request_heads(Op.GET, taken, counts)
        # The replies' headers in one buffer, their items in another (one view of them all,
        # each exchange's a slice of it).
        item_at = np.zeros(n, np.int64)
        np.cumsum(counts[:-1], out=item_at[1:])
        reply_heads = np.empty(HEADER_BYTES * n, np.uint8)
        reply_dtype = item_dtype(Op.GET, reply=True)
        reply_items = np.empty(int(counts.sum()) * reply_dtype.itemsize, np.uint8)
        caps = 3 * counts
        words = 2 * caps + 3 + counts + 2 + (counts + 7) // 8
        land_at = np.zeros(n, np.int64)
        np.cumsum(words[:-1], out=land_at[1:])
        lands = np.empty(int(words.sum()), np.uint64)
        for k in range(3):  # each segment table's state (segment, offset, closed)
            lands[land_at + 2 * caps + k] = 0
        table, items_sent = _burst_table(
            taken, heads, reply_heads, reply_items, item_at, counts, reply_dtype.itemsize
        )
        table["blocks_at"] = [t[2].shards_at[0] for t in taken]
        table["indices_at"] = [t[2].shards_at[1] for t in taken]
        table["table_at"] = native.addresses_of(lands) + 8 * land_at
        table["cap"] = caps
        _mark_sent(taken, now)
        first, need = _burst_need(taken)
        wait = 0.0 if until is None else max(0.0, until - self.clock())
        try:
            native.get_burst(
                table,
                taken[0][2].target_at,
                wait,
                self.limits.max_data_bytes,
                first_block=first,
                need=need,
                wake_fd=self._wake_r.fileno(),
            )
        except OSError as exc:  # poll() failed: each connection reports on its own next
            log.warning("native burst failed: %s", exc)
        states = table["state"].tolist()
        item_flags = table["item_flags"].tolist()
        self.counters["burst_taken"] += n
        # First, with no I/O (nothing here can reset a node): finish what is done, and
        # claim the landings of what is left half landed. Per exchange only slices: the
        # numbers come out of the tables whole.
        left: list[tuple[int, native.GetLanding | None, _BurstBuffers]] = []
        pumps: list[_Conn] = []
        all_items = reply_items.view(reply_dtype)
        heads_rows = reply_heads.reshape(n, HEADER_BYTES)
        data_lens = np.ascontiguousarray(heads_rows[:, 24:32]).view("<u8").ravel().tolist()
        verdicts = lands.view(np.bool_)  # each landing's verdicts: a byte per item, at its end
        accepted_at = (8 * (land_at + 2 * caps + 3 + counts + 2)).tolist()
        firsts, ends = item_at.tolist(), (item_at + counts).tolist()
        done = 0
        for j, (exchange, conn, _how, request_id) in enumerate(taken):
            c = ends[j] - firsts[j]
            items = all_items[firsts[j] : ends[j]]
            state = states[j]
            if state == native.Burst.DONE:
                done += 1
                sent = conn.sent.popleft()
                assert sent.exchange is exchange
                accepted = verdicts[accepted_at[j] : accepted_at[j] + c]
                exchange.burst_done(accepted, item_flags[j])
                header = Header(op=Op.GET, request_id=request_id, count=c,
                                data_len=data_lens[j], flags=FLAG_REPLY)  # fmt: skip
                _finish(exchange, Message(header, items, _EMPTY), None)
                if conn.queue:
                    pumps.append(conn)
                continue
            self.counters[f"burst_left_{_BURST_LEFT[state]}"] += 1
            w, cap = int(land_at[j]), int(caps[j])
            landing_buf = lands[w : w + int(words[j])]
            landing: native.GetLanding | None = None
            if state == native.Burst.DATA or (
                state == native.Burst.FAILED and int(table[j]["used"])
            ):
                landing = native.landing_of(landing_buf, cap, int(table[j]["used"]), c, exchange)
                exchange.landing_asked = True
                exchange.landed_natively(landing)
            bufs = _BurstBuffers(
                heads[HEADER_BYTES * j : HEADER_BYTES * (j + 1)].data,
                items_sent[j].view(np.uint8).data,
                items,
                heads_rows[j],
                landing_buf,
                cap,
            )
            left.append((j, landing, bufs))
        self.counters["burst_done"] += done
        self._burst_over(taken, left, states, table, pumps)
        return later

    def _burst_over(
        self,
        taken: Sequence[tuple[Exchange, _Conn, Any, int]],
        left: list[tuple[int, native.GetLanding | None, _BurstBuffers]],
        states: list[int],
        table: npt.NDArray[np.void],
        pumps: list[_Conn],
    ) -> None:
        """After a burst: each exchange ``left`` goes back to its connection where it
        stands, unless a reset of its node (one of these steps failing) took it already;
        then the connections with requests queued behind the burst send them."""
        for j, landing, bufs in left:
            exchange, conn = taken[j][0], taken[j][1]
            if not (conn.sent and conn.sent[0].exchange is exchange):
                continue
            try:
                self._after_burst(conn, exchange, int(states[j]), table[j], bufs, landing)
            except (OSError, ssl.SSLError, KVCacheError) as exc:
                self._failed(conn, exc)
        for conn in pumps:
            if conn.sock is not None and conn.queue:
                self._pump(conn)

    def _free_bulk(self, node: int, busy: set[int]) -> _Conn | None:
        """The least loaded bulk connection of ``node`` a burst does not use, if any."""
        free = [conn for conn in self._bulk[node] if id(conn) not in busy]
        return min(free, key=_load) if free else None

    def _idle_bulk(self, node: int, busy: set[int]) -> _Conn | None:
        """A connected plain-TCP bulk connection of ``node`` with nothing on it, and none
        of ``busy`` (ids of connections a burst has given an exchange already)."""
        for conn in self._bulk[node]:
            if id(conn) not in busy and _idle(conn):
                return conn
        return None

    def _after_burst(
        self,
        conn: _Conn,
        exchange: Exchange,
        state: int,
        row: np.void,
        bufs: _BurstBuffers,
        landing: native.GetLanding | None,
    ) -> None:
        """Hand an exchange the burst left back to this loop, where it stands on ``conn``
        (its landing, if it has one, already claimed). Raises what a step of _receive
        would: the caller fails the connection then."""
        if state == native.Burst.FAILED:
            node = self.node_id(conn.node)
            code = int(row["error"])
            self._failed(conn, NodeError(f"node {node}: {os.strerror(code)}", node=node))
            return
        if state == native.Burst.SEND:
            sent = int(row["sent"])
            rest: list[memoryview | native.Segments] = []
            for view in (bufs.head, bufs.items_sent):
                if sent >= view.nbytes:
                    sent -= view.nbytes
                elif view.nbytes:
                    rest.append(view[sent:])
                    sent = 0
            if bufs.data is not None and not bufs.data.done:
                rest.append(bufs.data)  # its state says how much of it the burst sent
            conn.out = rest
            self._flush(conn)
            return
        if state == native.Burst.HEAD:
            got = int(row["got"])
            conn.raw[:got] = bufs.header.tobytes()[:got]
            conn.rgot = got
            return
        raw = bufs.header.tobytes()
        if state == native.Burst.STOP_HEADER:
            conn.raw[:] = raw
            conn.rgot = HEADER_BYTES
            self._resume(conn, lambda: self._advance(conn))
            return
        # The header is the expected one: parsed here as _advance would.
        conn.header = Header.unpack(raw, self.limits)
        conn.items = bufs.items
        if state == native.Burst.ITEMS:
            conn.rstate, conn.rgot = _ITEMS, int(row["got"])
            return
        if state == native.Burst.STOP_LANDING:
            conn.rstate, conn.rgot = _ITEMS, bufs.items.nbytes
            self._resume(conn, lambda: self._advance(conn))
            return
        assert landing is not None
        conn.rstate, conn.index = _DATA, 0
        conn.landing = True
        conn.segments = landing.segments

    def _resume(self, conn: _Conn, step: Callable[[], None]) -> None:
        """Run one step of ``conn``'s reply where a burst left it, with the errors
        _receive handles, then read on whatever is already there."""
        sock = conn.sock
        try:
            step()
        except (OSError, ssl.SSLError, KVCacheError) as exc:
            self._failed(conn, exc)
            return
        except Exception as exc:  # a landing hook that failed: the stream is lost
            log.exception("a reply from node %s could not be received", self.node_id(conn.node))
            self._failed(conn, exc)
            return
        if conn.sock is sock and conn.sock is not None and conn.sent:
            self._receive(conn)

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
                    expect_node=info.id,
                    require_node=credentials.require_node_ids,
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
                error = ExchangeAbortedError(f"node {node}: exchange aborted", node=node)
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


class _BurstBuffers(NamedTuple):
    """One burst exchange's buffers: its request (header, items) and where its reply's
    header, items and landing table go (the landing's segment capacity)."""

    head: memoryview
    items_sent: memoryview
    items: npt.NDArray[np.void]
    header: npt.NDArray[np.uint8]
    landing: npt.NDArray[np.uint64]
    cap: int
    #: The request's data section, when the burst sent it (its state says how far).
    data: native.Segments | None = None


def _burst_table(
    taken: Sequence[tuple[Exchange, _Conn, Any, int]],
    heads: npt.NDArray[np.uint8],
    reply_heads: npt.NDArray[np.uint8],
    reply_items: npt.NDArray[np.uint8],
    item_at: npt.NDArray[np.int64],
    counts: npt.NDArray[np.int64],
    reply_item: int,
) -> tuple[npt.NDArray[np.void], list[npt.NDArray[Any]]]:
    """A burst's table, the columns every burst fills: each exchange's connection, its
    request (its header in ``heads``, then its items), the request id its reply must
    carry, room for ``counts`` reply items of ``reply_item`` bytes and where its reply's header and items go
    (``reply_heads``, ``reply_items`` from ``item_at`` items on). Returns the table and
    the items sent (kept alive until the burst is over)."""
    n = len(taken)
    table = np.zeros(n, native.BURST_DTYPE)
    table["fd"] = [t[1].sock.fileno() for t in taken]  # type: ignore[union-attr]
    table["req_addr"][:, 0] = native.addresses_of(heads) + HEADER_BYTES * np.arange(n)
    table["req_len"][:, 0] = HEADER_BYTES
    items_sent = [np.ascontiguousarray(t[0].items) for t in taken]
    table["req_addr"][:, 1] = [
        (t[0].items_at or native.addresses_of(a)) if a.nbytes else 0
        for t, a in zip(taken, items_sent, strict=True)
    ]
    table["req_len"][:, 1] = [a.nbytes for a in items_sent]
    table["expect_id"] = [t[3] for t in taken]
    table["count"] = counts
    table["header_at"] = native.addresses_of(reply_heads) + HEADER_BYTES * np.arange(n)
    table["items_at"] = native.addresses_of(reply_items) + reply_item * item_at
    return table, items_sent


def _mark_sent(taken: Sequence[tuple[Exchange, _Conn, Any, int]], now: float) -> None:
    """The burst's requests count as sent, each at the tail of its connection."""
    for exchange, conn, _how, request_id in taken:
        exchange.attempts += 1
        conn.sent.append(_Sent(exchange, request_id, now))


def _still_idle(taken: list[Any], later: list[Exchange]) -> tuple[list[Any], list[Exchange]]:
    """The burst's picks whose connection is still idle after the rest were sent (a send
    that failed at once resets its node, closing every connection of it: the burst must not
    use a descriptor that is no longer the connection's), and ``later`` with the others."""
    kept = [t for t in taken if _idle(t[1])]
    if len(kept) == len(taken):
        return taken, later
    return kept, later + [t[0] for t in taken if not _idle(t[1])]


def _idle(conn: _Conn) -> bool:
    """``conn`` is connected, plain TCP, and has nothing queued, out or coming in: a burst
    may take it."""
    return (
        conn.sock is not None
        and not conn.tls
        and not conn.queue
        and not conn.sent
        and not conn.out
        and conn.rstate == _HEAD
        and not conn.rgot
    )


def _request_heads(
    op: Op,
    taken: Sequence[tuple[Exchange, _Conn, BurstLanding | None, int]],
    counts: npt.NDArray[np.int64],
) -> npt.NDArray[np.uint8]:
    """A burst's ``op`` request headers, back to back: one packed and copied, then each
    one's request id and item count written in (every exchange of one load names the same
    class and retention; exchanges that do not are packed one by one)."""
    first = taken[0][0]
    retain, cls = first.retain, first.traffic_class
    if any(
        (t[0].retain is not retain and t[0].retain != retain) or t[0].traffic_class != cls
        for t in taken
    ):
        return np.frombuffer(
            b"".join(
                pack_header(op, request_id, len(exchange.items), flags=exchange.retain.flags,
                            ttl_s=exchange.retain.ttl_s, traffic_class=exchange.traffic_class)
                for exchange, _c, _h, request_id in taken
            ),
            np.uint8,
        ).copy()  # fmt: skip
    one = np.frombuffer(
        pack_header(op, 0, 0, flags=retain.flags, ttl_s=retain.ttl_s, traffic_class=cls),
        np.uint8,
    )
    heads = np.tile(one, len(taken))
    rows = heads.reshape(len(taken), HEADER_BYTES)
    rows[:, REQUEST_ID_AT : REQUEST_ID_AT + 8] = (
        np.array([t[3] for t in taken], "<u8").view(np.uint8).reshape(-1, 8)
    )
    rows[:, COUNT_AT : COUNT_AT + 4] = counts.astype("<u4").view(np.uint8).reshape(-1, 4)
    return heads


def _burst_need(
    taken: Sequence[tuple[Exchange, _Conn, BurstLanding, int]],
) -> tuple[int, npt.NDArray[np.uint8] | None]:
    """(first block, shards per block from it on) a burst may return at: k of each block,
    or as many as the burst's own exchanges ask of it (the rest ask elsewhere)."""
    hows = [t[2] for t in taken]
    k = hows[0].k
    if not k or any(h.k != k for h in hows):
        return 0, None
    first = min(h.span[0] for h in hows)
    end = max(h.span[1] for h in hows)
    asked = np.bincount(np.concatenate([h.blocks for h in hows]) - first, minlength=end - first)
    return first, np.minimum(asked, k).astype(np.uint8)


_EMPTY = memoryview(b"")
#: Counter names of the states a burst leaves an exchange in for the loop.
_BURST_LEFT = {
    native.Burst.SEND: "send",
    native.Burst.HEAD: "head",
    native.Burst.ITEMS: "items",
    native.Burst.DATA: "data",
    native.Burst.STOP_HEADER: "stop_header",
    native.Burst.STOP_LANDING: "stop_landing",
    native.Burst.FAILED: "failed",
}


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
