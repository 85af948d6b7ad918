"""The thin loop between the rounds (decisions) and the transport (bytes).

An operation creates a :class:`Pump`, submits exchanges through it and waits
for their outcomes as :class:`Event` s, up to the time its round says it must
be woken (:meth:`Pump.wait`). Exchanges finish on the transport's I/O
threads; the pump hands the outcome to the operation's thread through a
queue, so rounds and assemblies are only ever touched by that one thread.
The pump also keeps node health current: a failed exchange marks its node
down; a node that answers is up again.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvcache import native
from kvcache.client.assembly import LoadAssembly
from kvcache.client.health import NodeHealth
from kvcache.client.rounds import Send
from kvcache.client.transport import BurstLanding, Exchange, RemoteStatusError, Transport
from kvcache.errors import AuthError, ExchangeAbortedError, KVCacheError, NodeError
from kvcache.native import Segments
from kvcache.net import open_session
from kvcache.wire import NO_RETAIN, Frame, Header, Message, Op, Retain

__all__ = ["Event", "GetExchange", "GetShards", "Pump", "Reviver", "Watchdog", "get_shards"]


class Event(NamedTuple):
    """The outcome of one exchange: its reply, or the error it failed with (a named tuple:
    one is made per reply, on the I/O path)."""

    ticket: int
    exchange: Exchange
    reply: Message | None
    error: BaseException | None


class PumpedExchange(Exchange):
    """An exchange whose outcome goes to a :class:`Pump`."""

    def __init__(
        self,
        pump: Pump,
        ticket: int,
        node: int,
        op: Op,
        items: npt.NDArray[np.void],
        data: Sequence[Frame] | Segments = (),
        *,
        traffic_class: str = "",
        retain: Retain = NO_RETAIN,
    ) -> None:
        super().__init__(node, op, items, data, traffic_class=traffic_class, retain=retain)
        self.pump = pump
        self.ticket = ticket
        self.submitted = 0.0

    def finish(self, reply: Message | None, error: BaseException | None) -> None:
        self.pump.deliver(Event(self.ticket, self, reply, error))


class _Detached:
    """Where an exchange's reply goes once its load is over: nowhere (see
    :meth:`GetExchange.detach`)."""

    k = 0

    def land_reply(self, *args: object) -> None:
        return None

    def burst_target(self) -> None:
        return None

    def claim_landing(self) -> None:
        raise AssertionError("a detached exchange claimed a landing")

    def landed(self, writes: object, writes_at: int = 0) -> None:
        return None


_DETACHED = _Detached()


class GetShards(NamedTuple):
    """What a :class:`GetExchange` asks, ready for the native calls: the blocks and shard
    indices as C-contiguous int64 arrays, their addresses, the blocks' span [first, end) and
    the address of the request's items (0: not known). A load builds these for all its asks
    at once (:func:`get_shards`), from one array each, so that an ask costs no address
    lookups and no reductions of its own."""

    blocks: npt.NDArray[np.int64]
    indices: npt.NDArray[np.int64]
    shards_at: tuple[int, int]
    span: tuple[int, int]
    items_at: int = 0

    @classmethod
    def of(cls, send: Send) -> GetShards:
        """One send's, on its own."""
        blocks = np.ascontiguousarray(send.blocks, np.int64)
        indices = np.ascontiguousarray(send.indices, np.int64)
        if not len(blocks):
            return cls(blocks, indices, (0, 0), (0, 0))
        at = (
            (native.addresses_of(blocks), native.addresses_of(indices))
            if native.AVAILABLE
            else (0, 0)
        )
        return cls(blocks, indices, at, (int(blocks.min()), int(blocks.max()) + 1))


def get_shards(
    sends: Sequence[Send],
    items: npt.NDArray[np.void],
    blocks: npt.NDArray[np.int64],
    indices: npt.NDArray[np.int64],
) -> tuple[list[npt.NDArray[np.void]], list[GetShards]]:
    """Per send, its slice of ``items`` (one GET item per shard asked, every send's in
    turn; ``blocks`` and ``indices`` are the sends' own, concatenated) and its
    :class:`GetShards`, all cut from one array each: per send, slices and arithmetic, no
    numpy call (a load over 48 nodes made 48 of each)."""
    counts = [len(s.blocks) for s in sends]
    ends = list(itertools.accumulate(counts))
    starts = [e - c for e, c in zip(ends, counts, strict=True)]
    if not ends or not ends[-1]:
        return [items[0:0] for _ in sends], [GetShards.of(s) for s in sends]
    blocks = np.ascontiguousarray(blocks, np.int64)
    indices = np.ascontiguousarray(indices, np.int64)
    nonempty = [a for a, c in zip(starts, counts, strict=True) if c]
    lows = np.minimum.reduceat(blocks, nonempty).tolist()
    highs = np.maximum.reduceat(blocks, nonempty).tolist()
    at_b = at_i = at_items = 0
    if native.AVAILABLE:
        at_b, at_i = native.addresses_of(blocks), native.addresses_of(indices)
        at_items = native.addresses_of(items)
    width = items.dtype.itemsize
    views, shards = [], []
    j = 0
    for a, b in zip(starts, ends, strict=True):
        views.append(items[a:b])
        if a == b:
            shards.append(GetShards(blocks[a:b], indices[a:b], (0, 0), (0, 0)))
            continue
        shards.append(
            GetShards(
                blocks[a:b],
                indices[a:b],
                (at_b + 8 * a, at_i + 8 * a) if at_b else (0, 0),
                (lows[j], highs[j] + 1),
                at_items + width * a if at_items else 0,
            )
        )
        j += 1
    return views, shards


class GetExchange(PumpedExchange):
    """A GET whose reply data lands in a :class:`LoadAssembly`."""

    def __init__(
        self,
        pump: Pump,
        send: Send,
        items: npt.NDArray[np.void],
        assembly: LoadAssembly,
        cls: str,
        retain: Retain = NO_RETAIN,
        *,
        shards: GetShards | None = None,
    ) -> None:
        super().__init__(
            pump, send.ticket, send.node, Op.GET, items, traffic_class=cls, retain=retain
        )
        self.send = send
        self.assembly: LoadAssembly | _Detached = assembly
        #: The shards asked, as C-contiguous int64 arrays, and their addresses (native calls).
        if shards is None:
            shards = GetShards.of(send)
        self.shards = (shards.blocks, shards.indices)
        self.shards_at = shards.shards_at
        self.items_at = shards.items_at
        self._span = shards.span
        self._writes: npt.NDArray[np.int64] | None = None
        self._writes_at = 0
        #: The reply's native landing, where it had one (its buffer takes the verdicts).
        self.native_landing: native.GetLanding | None = None
        #: The reply's data went into the assembly (only then may its shards be accepted).
        self.landed_in_assembly = False
        #: Its shards' verdicts, when a native burst landed and accepted the reply itself,
        #: and its items' flag bytes OR-ed (then no item needs looking at for them).
        self.accepted: npt.NDArray[np.bool_] | None = None
        self.item_flags = 0

    def detach(self) -> None:
        """The load is over (its assembly closed): drop the assembly, so an exchange still
        queued on a stopped node's connection does not keep the load's buffers alive.
        Its reply, if one ever comes, is read and discarded, as a closed assembly's is.

        While a holder is stopped and not yet marked down, every load leaves one such
        exchange behind; each held about 9 MB (a 64-block load's buffer, parity and
        tables), and the memory of each new load was then fresh pages (the 2-core VM pays
        ~2.3 CPU-s per GB to touch them): loads took 12 ms of CPU instead of 1.7."""
        self.assembly = _DETACHED

    def landing(self, header: Header, items: npt.NDArray[np.void]) -> Segments | None:
        assert self._writes is None, "a second landing claimed for one reply"
        if len(items) != len(self.send.blocks):
            return None
        claim = self.assembly.land_reply(*self.shards, self.shards_at, items)
        if claim is None:
            return None
        if isinstance(claim, native.GetLanding):
            self.native_landing = claim
            self._writes, self._writes_at = claim.writes, claim.writes_at
            return claim.segments
        views, self._writes = claim
        return views

    def burst_landing(self) -> BurstLanding | None:
        if not len(self.send.blocks):
            return None
        target = self.assembly.burst_target()
        if target is None:
            return None
        return BurstLanding(self.shards_at, target, self._span, self.assembly.k, self.shards[0])

    def burst_done(self, accepted: npt.NDArray[np.bool_], item_flags: int = 0) -> None:
        self.accepted = accepted
        self.item_flags = item_flags
        self.landed_in_assembly = True

    def landed_natively(self, landing: native.GetLanding) -> None:
        assert self._writes is None, "a second landing claimed for one reply"
        self.assembly.claim_landing()
        self.native_landing = landing
        self._writes, self._writes_at = landing.writes, landing.writes_at

    def finish(self, reply: Message | None, error: BaseException | None) -> None:
        if self._writes is not None:
            writes, self._writes = self._writes, None
            if error is not None:
                # Whatever landed is incomplete: never accept it.
                reply = None
            else:
                self.landed_in_assembly = True
            self.assembly.landed(writes, self._writes_at)
        super().finish(reply, error)


class Pump:
    """Submits one operation's exchanges and collects their outcomes (see the module docstring)."""

    def __init__(
        self, transport: Transport, health: NodeHealth, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.transport = transport
        self.health = health
        self.clock = clock
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.outstanding: dict[int, PumpedExchange] = {}
        self.node_errors = 0

    def submit(self, exchange: PumpedExchange) -> None:
        """Send ``exchange``; its outcome comes back from :meth:`wait`."""
        exchange.submitted = self.clock()
        self.outstanding[exchange.ticket] = exchange
        # The caller waits through wait(), which runs the loop itself when it can.
        getattr(self.transport, "submit_then_drive", self.transport.submit)(exchange)

    def submit_burst(self, exchanges: Sequence[PumpedExchange], until: float | None) -> None:
        """Send ``exchanges`` (GETs of one load, one per node) and receive what comes back by
        ``until`` in one native burst where the transport offers one (else as
        :meth:`submit`); their outcomes come back from :meth:`wait`."""
        now = self.clock()
        for exchange in exchanges:
            exchange.submitted = now
            self.outstanding[exchange.ticket] = exchange
        burst = getattr(self.transport, "burst", None)
        rest = burst(exchanges, until) if burst is not None else exchanges
        submit = getattr(self.transport, "submit_then_drive", self.transport.submit)
        for exchange in rest:
            submit(exchange)

    def submit_plain_burst(
        self, exchanges: Sequence[PumpedExchange], until: float | None, *, min_left: int = 0
    ) -> None:
        """Send ``exchanges`` (one op whose replies carry items and no data, one per node)
        and read what comes back by ``until`` in one native burst where the transport offers
        one (``TcpTransport.burst_plain``: it returns once no more than ``min_left`` are
        out, after a short grace), else as :meth:`submit`; outcomes come from :meth:`wait`."""
        now = self.clock()
        for exchange in exchanges:
            exchange.submitted = now
            self.outstanding[exchange.ticket] = exchange
        burst = getattr(self.transport, "burst_plain", None)
        rest = burst(exchanges, until, min_left=min_left) if burst is not None else exchanges
        submit = getattr(self.transport, "submit_then_drive", self.transport.submit)
        for exchange in rest:
            submit(exchange)

    def cut(self, exchange: PumpedExchange) -> None:
        """Cut the connection carrying ``exchange`` (a late reply still landing where it is
        no longer wanted). It, and any other reply already landing on that connection,
        fails with :class:`~kvcache.errors.ExchangeAbortedError`, which marks no node down
        (it was late, not dead); the connection's other exchanges are sent again."""
        self.transport.abort(exchange)

    def deliver(self, event: Event) -> None:
        """Called on an I/O thread when an exchange finished."""
        self._events.put(event)

    def _arrived(self) -> bool:
        return not self._events.empty()

    def wait(self, until: float | None) -> list[Event]:
        """Outcomes that arrived, waiting at most until ``until`` (None: for one)."""
        events: list[Event] = []
        pending = self._events
        drive = getattr(self.transport, "drive", None)
        if (
            pending.empty()
            and drive is not None
            and drive(until, self._arrived)
            and pending.empty()
            and until is not None
        ):
            return events  # this thread ran the loop until the deadline passed
        timeout = None if until is None else max(0.0, until - self.clock())
        try:
            events.append(pending.get(timeout=timeout))
        except queue.Empty:
            return events
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                break
        for event in events:
            self._account(event)
        return events

    def _account(self, event: Event) -> None:
        self.outstanding.pop(event.ticket, None)
        node_id = self.transport.nodes[event.exchange.node].id
        if event.error is None:
            self.health.mark_up(node_id)
        elif isinstance(event.error, ExchangeAbortedError):
            pass  # cut by a client (late, not dead): no mark
        elif isinstance(event.error, AuthError) or (
            isinstance(event.error, NodeError) and not isinstance(event.error, RemoteStatusError)
        ):
            # A node that refuses our credentials is as useless as a dead one, and asking it
            # again on every request would redo a connection and a handshake each time.
            self.node_errors += 1
            self.health.mark_down(node_id, str(event.error))

    def abandon(
        self, timeout_s: float | None = None, *, since: float | None = None
    ) -> list[PumpedExchange]:
        """Forget exchanges still out (their outcomes are dropped); returns them.

        With ``timeout_s``, a node whose exchange has been out that long is marked
        down and its connections reset (it did not answer in time), so nothing more
        queues behind it. ``since``: count from then instead of from each
        exchange's submission (a round that ran to its deadline, which started
        counting just before it sent its requests).
        """
        left = list(self.outstanding.values())
        self.outstanding.clear()
        if timeout_s is not None:
            now = self.clock()
            late = {
                ex.node
                for ex in left
                if now - (ex.submitted if since is None else min(since, ex.submitted)) >= timeout_s
            }
            for node in late:
                self.node_errors += 1
                self.health.mark_down(
                    self.transport.nodes[node].id, f"no answer within {timeout_s:.3f}s"
                )
                self.transport.reset(node)
        return left


class Watchdog:
    """Marks down and resets nodes whose exchanges hang past ``timeout_s``.

    A stopped daemon keeps its TCP connections open and answers nothing, so
    an exchange to it would wait forever and everything queued behind it
    with it; rounds hedge around it, and this thread frees the connection.
    """

    def __init__(
        self,
        transport: Any,
        health: NodeHealth,
        timeout_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        every_s: float = 0.05,
    ) -> None:
        self._transport = transport
        self._health = health
        self._timeout = timeout_s
        self._clock = clock
        self._every = every_s
        self._stop = threading.Event()
        self.resets = 0
        self._thread = threading.Thread(target=self._run, name="kvcache-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            now = self._clock()
            for node, since in self._transport.busy_since().items():
                if now - since > self._timeout:
                    node_id = self._transport.nodes[node].id
                    self._health.mark_down(
                        node_id, f"no answer within {self._timeout:.3f}s: connections reset"
                    )
                    self._transport.reset(node)
                    self.resets += 1

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        self._thread.join(timeout=5)


class Reviver:
    """Brings nodes marked down back as soon as they answer a session handshake again.

    A node marked down is otherwise skipped for ``down_retry_s`` (5 s); during a
    rolling restart that left the node restarted a moment ago skipped while the
    next one was down, two of 12 out, and loads came up short (issue 18). A
    handshake, not a bare TCP connect, is the test: a stopped (SIGSTOP) daemon's
    kernel still accepts connections, but it answers no handshake.
    """

    def __init__(
        self,
        transport: Any,
        health: NodeHealth,
        *,
        every_s: float = 0.25,
        timeout_s: float = 0.5,
    ) -> None:
        self._transport = transport
        self._health = health
        self._every = every_s
        self._timeout = timeout_s
        self._stop = threading.Event()
        self.revived = 0
        self._thread = threading.Thread(target=self._run, name="kvcache-reviver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            down = set(self._health.down_nodes())
            if not down:
                continue
            credentials = self._transport.credentials
            for info in tuple(self._transport.nodes):
                if info.id not in down or self._stop.is_set():
                    continue
                try:
                    sock = open_session(
                        info.data,
                        tenant=credentials.tenant,
                        secret=credentials.secret,
                        timeout_s=self._timeout,
                        node=info.id,
                        tls=credentials.tls,
                        expect_node=info.id,
                        require_node=credentials.require_node_ids,
                    )
                except KVCacheError:
                    continue
                sock.close()
                self._health.mark_up(info.id)
                self.revived += 1

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        self._thread.join(timeout=5)


def gather_abort(transport: Transport, exchanges: Sequence[Exchange]) -> Callable[[], None]:
    """A callable that aborts every exchange of ``exchanges`` still being received."""

    def abort() -> None:
        for exchange in exchanges:
            transport.abort(exchange)

    return abort
