"""The data path's socket loop: one thread, one selector, every TCP connection of a daemon.

Each connection goes through the session handshake (:mod:`kvcache.session`;
optionally inside TLS), then carries requests and replies
(:mod:`kvcache.wire`) answered in order, one at a time: while a connection's
reply is being sent it is not read, so a client that stops reading replies
only stalls itself. Replies are sent with ``sendmsg`` straight from their
sections: a GET reply's records are views into the store's read
transaction, released when the last byte left (or the connection died).

Bounds: at most ``max_connections`` connections; a handshake must finish
within ``handshake_timeout_s``; a reply that makes no progress for
``send_timeout_s`` closes its connection (and releases what it held); request
data buffered across connections stays under ``max_inflight_bytes`` (plus one
request in progress per connection). Anything malformed gets an error reply
when it can be answered, and closes the connection when the stream cannot be
resynchronised; it never stops the loop.

Between requests the loop runs the store's bounded retention work and calls
that other threads :meth:`DataServer.submit` (how the admin server reaches the
store, which only this thread may touch).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import errno
import logging
import os
import queue
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvcache import native
from kvcache.credentials import Credentials
from kvcache.errors import ConfigError, KVCacheError, ProtocolError, StorageError
from kvcache.net_loop import SendQueue, WakePipe, accept_ready, bind_listener, watch
from kvcache.server import native_plane
from kvcache.server.admission import Admission, AdmissionLimits
from kvcache.server.handler import Reply, Request, RequestHandler
from kvcache.server.native_plane import (
    CLOSE_REASONS,
    EV_CLOSED,
    EV_HANDOFF,
    HANDOFF_REASONS,
    NativeEvent,
    NativePlane,
    PlaneLimits,
    PlaneSelector,
    class_field,
)
from kvcache.session import AUTH_BYTES, ServerHandshake
from kvcache.wire import Limits, MessageReader, Op, Status

__all__ = ["DataServer"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: PUT requests of one loop turn share one write transaction (group commit) up to this many ...
_GROUP_REQUESTS = 16
#: ... and this many bytes.
_GROUP_BYTES = 64 << 20
#: Retention work runs at least this often, even under a steady request load.
_MAINTAIN_EVERY_S = 0.05
_IDLE_POLL_S = 0.2
#: How long the listener is left unwatched after ``accept`` ran out of file descriptors.
_ACCEPT_BACKOFF_S = 0.1

_HANDSHAKE, _AUTH, _READY, _CLOSING = range(4)


class _Conn:
    """One client connection's state (owned by the loop thread)."""

    __slots__ = (
        "addr",
        "admitted",
        "auth_buf",
        "busy",
        "counted",
        "events",
        "handshake",
        "last_progress",
        "native",
        "opened",
        "out",
        "peer",
        "reader",
        "reply",
        "request_bytes",
        "request_started",
        "sock",
        "state",
        "tenant",
        "tls_done",
    )

    def __init__(self, sock: socket.socket, addr: Any, limits: Limits, now: float) -> None:
        self.sock = sock
        self.addr = addr
        self.state = _HANDSHAKE
        self.tls_done = not isinstance(sock, ssl.SSLSocket)
        self.handshake: ServerHandshake | None = None
        self.auth_buf = bytearray()
        self.tenant: Any = None
        self.reader = MessageReader(limits=limits, replies=False)
        self.out = SendQueue()
        self.reply: Reply | None = None
        #: Selector events registered (0: not registered).
        self.events = 0
        #: A request of this connection is queued or its reply is being sent; the
        #: connection stays registered for reading (a client sends its next request only
        #: after the reply, so nothing arrives meanwhile) unless it does send more.
        self.busy = False
        self.opened = now
        self.last_progress = now
        #: Peer address (host) for the pre-authentication bounds.
        self.peer = str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)
        #: Bytes of the half-received request counted against its tenant's share.
        self.counted = 0
        #: When the request now arriving started, and how many bytes of it arrived.
        self.request_started = now
        self.request_bytes = 0
        #: The native data plane owns the connection now (reads and answers it).
        self.native = False
        #: Counted as an authenticated connection of its tenant (given back once, on close,
        #: whatever state it closes in: a malformed request closes a _CLOSING one).
        self.admitted = False


class DataServer:
    """The TCP front end of one daemon's store; the thread that calls :meth:`serve` owns it."""

    def __init__(
        self,
        handler: RequestHandler,
        *,
        listen: str,
        credentials: Credentials,
        limits: Limits,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int = 1024,
        handshake_timeout_s: float = 10.0,
        send_timeout_s: float = 30.0,
        max_inflight_bytes: int = 1 << 30,
        admission: AdmissionLimits | None = None,
        native_plane: bool = True,
    ) -> None:
        self.handler = handler
        self.metrics = handler.metrics
        self.listen = listen
        self._credentials = credentials
        self._limits = limits
        self._ssl = ssl_context
        limits_ = admission or AdmissionLimits(
            max_connections=max_connections,
            handshake_timeout_s=handshake_timeout_s,
            max_inflight_bytes=max_inflight_bytes,
        )
        self._admission: Admission[int] = Admission(limits_)
        self._send_timeout = send_timeout_s
        #: Connections not read for now (their tenant holds its share of in-flight bytes).
        self._paused: dict[int, _Conn] = {}
        #: Connections whose reply went out while another's next step was under way: their
        #: next step waits here, taken in turn by the outermost one (see _after_reply).
        self._after_replies: collections.deque[_Conn] = collections.deque()
        self._in_after_reply = False
        self._authenticated = 0
        self._last_expire = 0.0
        #: When the listener, unwatched after accept ran out of descriptors, is watched again.
        self._listener_paused_until = 0.0
        #: The native data plane (kvcache.server.native_plane) and what it was told: the
        #: policy its class table is for, each class name given (or refused: False), and
        #: the label of each counter slot.
        self._plane: NativePlane | None = None
        self._plane_selector: PlaneSelector | None = None
        self._plane_policy: object = None
        self._plane_classes: dict[str, bool] = {}
        self._plane_slots: dict[str, int] = {}
        self._plane_labels: list[str] = []
        if native_plane and ssl_context is None:
            self._plane = self._open_plane(limits_)
        self._selector: selectors.BaseSelector
        if self._plane is not None:
            self._plane_selector = PlaneSelector(self._plane, self._plane_settings)
            self._selector = self._plane_selector
        else:
            self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}
        self._ready: list[tuple[_Conn, Request]] = []
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._calls = queue.SimpleQueue()
        self._wake = WakePipe()
        self.endpoint = ""
        self.serving = threading.Event()

    # ------------------------------------------------------------------ lifecycle

    def bind(self) -> str:
        """Create and bind the listening socket; returns ``tcp://host:port`` (port 0 resolved)."""
        sock, self.endpoint = bind_listener(self.listen, backlog=512, what="data endpoint")
        self._listener = sock
        self._selector.register(sock, selectors.EVENT_READ, None)
        if self._plane_selector is not None:
            self._plane_selector.prioritize(self._wake)
        self._selector.register(self._wake, selectors.EVENT_READ, None)
        return self.endpoint

    def serve(self, stop: threading.Event) -> None:
        """Answer requests until ``stop`` is set; the request in hand is finished first."""
        if self._listener is None:
            raise RuntimeError("bind() first")
        self.serving.set()
        more_work = True
        last_maintain = 0.0
        try:
            store = self.handler.store
            while not stop.is_set():
                if more_work or self._ready:
                    timeout = 0.0
                else:  # idle: wake for the next expiry due, if it comes before the poll
                    timeout = min(_IDLE_POLL_S, max(0.0, store.seconds_to_sweep()))
                for key, mask in self._selector.select(timeout):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake:
                        self._wake.drain()
                    else:
                        self._guarded(key.data, self._event, key.data, mask)
                if self._plane_selector is not None:
                    for event in self._plane_selector.native_events():
                        self._guarded(self._conns.get(event.fd), self._native_event, event)
                self._pump()
                self._run_calls()
                now = time.monotonic()
                if self._listener_paused_until and now >= self._listener_paused_until:
                    self._listener_paused_until = 0.0
                    self._selector.register(self._listener, selectors.EVENT_READ, None)
                self._expire(now)
                if (
                    more_work
                    or now - last_maintain >= _MAINTAIN_EVERY_S
                    or store.seconds_to_sweep() <= 0
                ):
                    last_maintain = now
                    more_work = self._maintain()
        finally:
            self.serving.clear()
            self._run_calls()
            self.close()

    def _guarded(self, conn: _Conn | None, step: Callable[..., None], *args: Any) -> None:
        """Run one connection's step; a bug in it closes that connection (counted as
        ``internal``, logged with its traceback), never the daemon: every other client is
        served on."""
        try:
            step(*args)
        except Exception:
            log.exception("closing %s: its request hit a bug", conn.addr if conn else "?")
            self.metrics.error("internal")
            if conn is not None:
                with contextlib.suppress(Exception):
                    self._close(conn, "internal error")

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the loop thread between requests (how other threads reach the store)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._calls.put((fn, future))
        self.wake()
        return future

    def wake(self) -> None:
        """Interrupt the idle poll (thread- and signal-safe)."""
        self._wake.wake()

    def close(self) -> None:
        """Close every connection and the listening socket (idempotent)."""
        for conn in list(self._conns.values()):
            self._close(conn, "daemon stopping")
        if self._listener is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None
        self._wake.close()
        self._selector.close()

    # ------------------------------------------------------------------ native data plane

    def _open_plane(self, limits: AdmissionLimits) -> NativePlane | None:
        """The native data plane over this daemon's store, if it applies (see
        :mod:`kvcache.server.native_plane`); None: every request is answered here."""
        store = self.handler.store
        if not native_plane.AVAILABLE or store.realtime_offset_s() is None:
            return None
        try:
            plane = NativePlane(
                lmdb_dir=store.path,
                map_size=store.map_size,
                segment_dir=store.segments.directory,
                limits=PlaneLimits(
                    max_items=self._limits.max_items,
                    max_reply_bytes=store.max_reply_bytes,
                    send_timeout_s=self._send_timeout,
                    request_timeout_s=limits.request_timeout_s,
                    request_grace_s=limits.request_grace_s,
                    min_request_rate=limits.min_request_rate,
                ),
            )
        except KVCacheError as exc:
            if os.environ.get(native.ENV, "").strip().lower() == "require":
                raise ConfigError(f"{native.ENV}=require: {exc}") from exc
            log.warning("%s; every request is answered by the Python loop", exc)
            return None
        store.segments.still_sending = plane.forget_segment
        self.metrics.attach_native(plane.stats, self._plane_label, HANDOFF_REASONS)
        return plane

    def _plane_label(self, slot: int) -> str:
        labels = self._plane_labels
        return labels[slot] if slot < len(labels) else "unlabelled"

    def _plane_settings(self) -> tuple[float, bool, bool]:
        """What the plane needs before each step: the clock's offset from wall time, whether
        it may answer requests now (else it hands every one to this loop), and whether hits
        wait to be written."""
        store = self.handler.store
        if store.policy is not self._plane_policy:
            self._plane_policy = store.policy
            self._plane_classes = {}
            assert self._plane is not None
            self._plane.clear_classes()
            # The policy's classes and none: a name it does not know (counted as its default
            # class) stays with this loop, so no client can fill the engine's table.
            for name in ("", *sorted(store.policy.classes)):
                self._plane_class(name)
        offset = store.realtime_offset_s()
        answer = (
            offset is not None and store.damaged is None and not self.metrics.request_log.enabled()
        )
        return offset or 0.0, answer, store.touches_pending

    def _plane_class(self, name: str) -> None:
        """Let the plane answer GETs and HASes naming traffic class ``name`` ("": none)."""
        if name in self._plane_classes or self._plane is None:
            return
        store = self.handler.store
        label = store.policy.resolve(name) if name else "unlabelled"
        slot = self._plane_slots.get(label)
        if slot is None:
            if len(self._plane_labels) >= native_plane.MAX_CLASSES:
                self._plane_classes[name] = False
                return
            slot = self._plane_slots[label] = len(self._plane_labels)
            self._plane_labels.append(label)
        self._plane_classes[name] = self._plane.set_class(
            class_field(name), store.quiet_delta_ms(name), slot
        )

    def _adopt(self, conn: _Conn) -> bool:
        """Hand an idle, authenticated plain-TCP connection to the native plane."""
        plane, selector = self._plane, self._plane_selector
        if plane is None or selector is None or conn.state != _READY or conn.busy or conn.out:
            return False
        prefix = conn.reader.release()
        if prefix is None:
            return False  # a request is half parsed here: this loop finishes it
        fd = conn.sock.fileno()
        registered = selector.forget_key(fd)
        adopted = plane.adopt(
            fd,
            conn.tenant.id,
            prefix,
            started=conn.request_started if prefix else 0.0,
            received=conn.request_bytes if prefix else 0,
        )
        if not adopted:
            conn.reader.prime(prefix)
            if registered is not None:
                selector.restore_key(registered)
            return False
        conn.events = 0
        conn.native = True
        return True

    def _native_event(self, event: NativeEvent) -> None:
        """A native connection's request is handed back, or the plane closed it."""
        assert self._plane is not None
        conn = self._conns.get(event.fd)
        if event.kind == EV_HANDOFF:
            data, started, received = self._plane.take(event.fd)
            if conn is None:  # pragma: no cover - the plane only holds connections of ours
                return
            conn.native = False
            conn.events = 0
            now = time.monotonic()
            conn.last_progress = now
            conn.request_started = started or now
            conn.request_bytes = max(received, len(data))
            conn.reader.prime(data)
            if not self._admission.may_start(conn.tenant.id):
                # The request starts here, as far as admission goes: its tenant holds its
                # share of in-flight bytes, so it waits, unread, like one that arrives here.
                self.metrics.error("inflight_paused")
                self._paused[event.fd] = conn
                return
            self._continue(conn)
        elif event.kind == EV_CLOSED and conn is not None:
            why, kind = CLOSE_REASONS.get(event.aux, ("closed", None))
            if kind is not None:
                self.metrics.error(kind)
                log.warning("closing %s (tenant %s): %s", conn.addr, conn.tenant.name, why)
            conn.native = False
            conn.events = 0
            self._close(conn, why)

    # ------------------------------------------------------------------ connections

    def _accept(self) -> None:
        assert self._listener is not None
        ready: list[tuple[socket.socket, Any]] = []
        try:
            ready.extend(accept_ready(self._listener))
        except OSError as exc:  # e.g. EMFILE: keep serving the connections we have
            log.warning("accept failed: %s", exc)
            self.metrics.error("accept")
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                # Out of descriptors: the waiting connection stays, so the listener stays
                # ready; stop watching it for a while instead of being woken for it on
                # every turn (the connections we have are served meanwhile).
                self._selector.unregister(self._listener)
                self._listener_paused_until = time.monotonic() + _ACCEPT_BACKOFF_S
        for sock, addr in ready:
            self._open(sock, addr)

    def _open(self, sock: socket.socket, addr: Any) -> None:
        if self._ssl is not None:
            sock = self._ssl.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        now = time.monotonic()
        conn = _Conn(sock, addr, self._limits, now)
        fd = sock.fileno()
        for displaced in self._admission.preauth_open(fd, conn.peer, now):
            other = self._conns.get(displaced)
            if other is not None:
                self.metrics.error("preauth_evicted")
                self._close(other, "displaced by a newer unauthenticated connection")
        self._conns[fd] = conn
        self.metrics.connections += 1
        self._watch(conn, selectors.EVENT_READ)
        if conn.tls_done:
            self._start_session(conn)
        else:
            self._tls_step(conn)

    def _start_session(self, conn: _Conn) -> None:
        conn.handshake = ServerHandshake(self._credentials.tenant, node_id=self.handler.node_id)
        conn.state = _AUTH
        self._send(conn, Reply([conn.handshake.hello()]))

    def _tls_step(self, conn: _Conn) -> None:
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket)
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            self._watch(conn, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._watch(conn, selectors.EVENT_WRITE)
            return
        except (ssl.SSLError, OSError) as exc:
            self.metrics.error("tls")
            self._close(conn, f"TLS handshake failed: {exc}")
            return
        conn.tls_done = True
        self._start_session(conn)

    def _event(self, conn: _Conn, mask: int) -> None:
        if conn.sock.fileno() < 0:
            return
        if not conn.tls_done:
            self._tls_step(conn)
            return
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and conn.sock.fileno() >= 0:
            if conn.busy:
                # Sent more before its reply (or closed): stop watching until the reply
                # is out, instead of being woken for it on every turn.
                self._watch(conn, 0)
            elif not conn.out:
                self._read(conn)

    def _read(self, conn: _Conn) -> None:
        """Receive what is there; hand over at most one complete request."""
        while conn.state in (_AUTH, _READY) and not conn.out and not conn.busy and not conn.native:
            if conn.state == _AUTH:
                want = AUTH_BYTES - len(conn.auth_buf)
                buf = memoryview(bytearray(want))
            else:
                if conn.reader.idle and not self._admission.may_start(conn.tenant.id):
                    # Its tenant holds its share of half-received bytes: read it again
                    # once some of them are stored (others' connections go on).
                    self.metrics.error("inflight_paused")
                    self._paused[conn.sock.fileno()] = conn
                    self._watch(conn, 0)
                    return
                buf = conn.reader.recv_buffer()
            try:
                n = conn.sock.recv_into(buf)
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
                return
            except (ssl.SSLError, OSError) as exc:
                self._close(conn, f"receive failed: {exc}")
                return
            if n == 0:
                if conn.state == _READY and not conn.reader.idle:
                    self.metrics.error("truncated")  # the peer closed inside a request
                self._close(conn, "closed by peer")
                return
            now = time.monotonic()
            conn.last_progress = now
            if conn.state == _AUTH:
                conn.auth_buf += buf[:n]
                if len(conn.auth_buf) == AUTH_BYTES:
                    self._authenticate(conn)
                continue
            if conn.reader.idle:
                conn.request_started, conn.request_bytes = now, 0
            conn.request_bytes += n
            conn.reader.commit(n)
            parsed = self._parse(conn)
            self._recount(conn)
            if parsed:
                return

    def _parse(self, conn: _Conn) -> bool:
        """Queue the connection's next complete request, if one is buffered."""
        try:
            message = conn.reader.next_message()
        except ProtocolError as exc:
            # The stream cannot be trusted past this point: answer, then close.
            log.debug("closing %s after a malformed request: %s", conn.addr, exc)
            reply = self.handler.fail(None, Status.BAD_REQUEST, "bad_request", exc)
            conn.state = _CLOSING
            self._send(conn, reply)
            return True
        if message is None:
            return False
        if message.header.status != Status.OK:
            reply = self.handler.fail(
                message.header, Status.BAD_REQUEST, "bad_request", "a request carries no status"
            )
            self._send(conn, reply)
            return True
        size = 48 + message.header.items_len + message.header.data_len
        request = Request(conn.tenant.id, message, time.perf_counter(), size)
        self._ready.append((conn, request))
        conn.busy = True
        return True

    def _authenticate(self, conn: _Conn) -> None:
        assert conn.handshake is not None
        result, tenant = conn.handshake.answer(bytes(conn.auth_buf))
        conn.auth_buf = bytearray()
        if tenant is None:
            self.metrics.error("unauthorized")
            log.info("refused a data connection from %s: bad credentials", conn.addr)
            conn.state = _CLOSING
        else:
            self._admission.preauth_close(conn.sock.fileno())
            refused = self._admission.tenant_may_connect(tenant.id, self._authenticated)
            if refused is not None:
                self.metrics.error(refused)
                log.info("refused a data connection of %s: %s", tenant.name, refused)
                conn.state = _CLOSING
                self._send(conn, Reply([conn.handshake.busy()]))  # KVNO: try again later
                return
            conn.tenant = tenant
            conn.state = _READY
            conn.admitted = True
            self._authenticated += 1
            self._admission.tenant_connected(tenant.id)
        self._send(conn, Reply([result]))

    # ------------------------------------------------------------------ requests

    def _pump(self) -> None:
        """Answer every queued request; PUTs of one turn share a transaction."""
        while self._ready:
            batch, self._ready = self._ready, []
            puts = [(c, r) for c, r in batch if r.message.header.op is Op.PUT]
            answers: list[tuple[_Conn, Reply]] = []
            group: list[tuple[_Conn, Request]] = []
            size = 0
            for conn, request in puts:
                if group and (len(group) >= _GROUP_REQUESTS or size + request.size > _GROUP_BYTES):
                    answers += self._store_group(group)
                    group, size = [], 0
                group.append((conn, request))
                size += request.size
            if group:
                answers += self._store_group(group)
            if puts:
                # The PUTs' replies go out first; then, if one crossed the high watermark,
                # a batch of the drain runs before any other request is answered.
                self._answer(answers)
                answers = []
                self._drain_after_writes()
            for conn, request in batch:
                if request.message.header.op is not Op.PUT:
                    answers.append((conn, self.handler.handle(request)))
            self._answer(answers)
        if self._paused:
            self._resume_paused()

    def _answer(self, answers: list[tuple[_Conn, Reply]]) -> None:
        for conn, reply in answers:
            if conn.sock.fileno() < 0:
                reply.done()
                continue
            self._guarded(conn, self._send, conn, reply)

    def _drain_after_writes(self) -> None:
        try:
            self.handler.store.drain_after_crossing()
        except (StorageError, OSError) as exc:  # the writes are in; maintain() tries again
            log.error("eviction after a write failed: %s", exc)
            self.metrics.error("gc")

    def _resume_paused(self) -> None:
        """Read again the paused connections whose tenant may now start a request."""
        for fd, conn in list(self._paused.items()):
            if conn.sock.fileno() < 0:
                del self._paused[fd]
            elif self._admission.may_start(conn.tenant.id):
                del self._paused[fd]
                # Its deadline and rate count from now: the wait was this daemon's doing.
                conn.request_started = time.monotonic()
                conn.request_bytes = conn.reader.buffered_bytes
                self._guarded(conn, self._continue, conn)

    def _continue(self, conn: _Conn) -> None:
        """Go on with a connection's request: answer it if its bytes are all in (a native
        hand-off may have brought them all), else wait for more."""
        parsed = self._parse(conn)
        self._recount(conn)
        if not parsed:
            self._watch(conn, selectors.EVENT_READ)

    def _recount(self, conn: _Conn) -> None:
        """Charge ``conn``'s tenant with what its half-received request now holds."""
        held = conn.reader.buffered_bytes
        if held != conn.counted:
            self._admission.moved(conn.tenant.id, held - conn.counted)
            conn.counted = held
            self.metrics.inflight_bytes = self._admission.inflight

    def _store_group(self, group: list[tuple[_Conn, Request]]) -> list[tuple[_Conn, Reply]]:
        replies = self.handler.handle_puts([r for _, r in group])
        return [(c, reply) for (c, _), reply in zip(group, replies, strict=True)]

    def _send(self, conn: _Conn, reply: Reply) -> None:
        """Start sending ``reply`` on ``conn``; the connection is read again once it is out."""
        conn.reply = reply
        conn.out.extend(reply.frames)
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        sock = conn.sock
        out = conn.out
        if out:
            try:
                sent = out.flush(sock)
            except (ssl.SSLError, OSError) as exc:
                self._close(conn, f"send failed: {exc}")
                return
            if sent:
                conn.last_progress = time.monotonic()
            if out:
                self._watch(conn, selectors.EVENT_WRITE)
                return
        if conn.reply is not None:
            conn.reply.done()
            conn.reply = None
        conn.busy = False
        if conn.state == _CLOSING:
            self._close(conn, "refused")
            return
        self._after_reply(conn)

    def _after_reply(self, conn: _Conn) -> None:
        """Go on with ``conn`` once its reply is out, without recursing: an error reply is
        sent from inside the parse that found the error, and its send would go on to parse
        the next buffered request, and so on, a stack frame per request (2,000 pipelined
        requests carrying a status crashed the daemon with a RecursionError, issue 18's
        probe). Called while another connection's (or its own) next step is under way, the
        connection is queued and taken by the outermost call, one after another."""
        self._after_replies.append(conn)
        if self._in_after_reply:
            return
        self._in_after_reply = True
        try:
            while self._after_replies:
                queued = self._after_replies.popleft()
                self._guarded(queued, self._next_step, queued)  # a bug closes that one alone
        finally:
            self._in_after_reply = False

    def _next_step(self, conn: _Conn) -> None:
        """Requests already buffered come first; then the native plane takes the connection,
        or this loop waits for more (nothing, if it was closed or is busy again since)."""
        if conn.sock.fileno() < 0 or conn.busy or conn.out or conn.native:
            return
        if conn.state == _READY and self._parse(conn):
            return
        if self._plane is not None and self._adopt(conn):
            return
        self._watch(conn, selectors.EVENT_READ)
        sock = conn.sock
        if conn.state == _READY and isinstance(sock, ssl.SSLSocket) and sock.pending():
            self._read(conn)

    def _watch(self, conn: _Conn, events: int) -> None:
        """Wait for ``events`` on ``conn`` (0: none, while its request is being answered)."""
        conn.events = watch(self._selector, conn.sock, conn.events, events, conn)

    def _close(self, conn: _Conn, why: str) -> None:
        if conn.reply is not None:
            conn.reply.done()
            conn.reply = None
        conn.out.clear()
        fd = conn.sock.fileno()
        if fd >= 0:
            if self._plane is not None:
                self._plane.forget(fd)
                conn.native = False
            if conn.events:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(conn.sock)
                conn.events = 0
            self._conns.pop(fd, None)
            self._paused.pop(fd, None)
            self._admission.preauth_close(fd)
            if conn.admitted:
                conn.admitted = False
                self._authenticated -= 1
                self._admission.tenant_disconnected(conn.tenant.id)
                self._admission.moved(conn.tenant.id, -conn.counted)
                conn.counted = 0
                self.metrics.inflight_bytes = self._admission.inflight
            self.metrics.connections = max(0, self.metrics.connections - 1)
            self.metrics.disconnects += 1
            log.debug("connection %s closed: %s", conn.addr, why)
        with contextlib.suppress(OSError):
            conn.sock.close()
        conn.state = _CLOSING

    def _expire(self, now: float) -> None:
        """Cut off handshakes past their deadline, requests arriving too slowly or too long,
        and replies the peer stopped reading (at most every 0.1 s: a pass visits every
        connection)."""
        if now - self._last_expire < 0.1:
            return
        self._last_expire = now
        for fd in self._admission.handshakes_overdue(now):
            conn = self._conns.get(fd)
            if conn is None:
                self._admission.preauth_close(fd)
                continue
            self.metrics.error("handshake_timeout")
            self._close(conn, "no handshake in time")
        admission = self._admission
        for conn in list(self._conns.values()):
            if conn.out:
                if now - conn.last_progress > self._send_timeout:
                    self.metrics.error("send_timeout")
                    log.warning(
                        "closing %s: its reply made no progress for %.0f s (peer not reading)",
                        conn.addr,
                        self._send_timeout,
                    )
                    self._close(conn, "send timeout")
            elif (
                conn.state == _READY
                and not conn.busy
                and not conn.reader.idle
                and conn.sock.fileno() not in self._paused  # held back by us, not slow
            ):
                why = admission.request_overdue(conn.request_started, conn.request_bytes, now)
                if why is not None:
                    self.metrics.error(why)
                    log.warning(
                        "closing %s (tenant %s): %s, %d bytes in %.1f s",
                        conn.addr,
                        conn.tenant.name,
                        why.replace("_", " "),
                        conn.request_bytes,
                        now - conn.request_started,
                    )
                    self._close(conn, why)

    # ------------------------------------------------------------------ housekeeping

    def _maintain(self) -> bool:
        try:
            more = self.handler.store.maintain()
        except (StorageError, OSError) as exc:
            log.error("retention work failed: %s", exc)
            self.metrics.error("gc")
            more = False
        scrubber = self.handler.scrubber
        if scrubber is not None:
            try:
                more |= scrubber.step()
            except (StorageError, OSError) as exc:
                log.error("scrub step failed: %s", exc)
                self.metrics.error("scrub")
        return more

    def _run_calls(self) -> None:
        # Asked on every turn of the loop, almost always with nothing queued: an empty check
        # is cheaper than the exception get_nowait raises then.
        while not self._calls.empty():
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)
