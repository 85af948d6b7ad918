"""Serving this worker's SWA states to peers: one thread, one selector, plain TCP.

The endpoint speaks the data path's protocol: the session handshake of
:mod:`kvcache.session` (a peer proves it holds *this worker's tenant's*
secret; nobody else is served), then :mod:`kvcache.wire` messages under the
same :class:`~kvcache.wire.Limits`. It answers ``SWA_GET`` (states, sent with
``sendmsg`` straight from the store's immutable ``bytes``, no copy) and
``STATS``; anything else is refused with BAD_REQUEST.

Why TCP and not zmq: the data path measured pyzmq at about 7.7 GB/s in one
process whatever the parallelism, against 42 GB/s for plain sockets over 12
connections (``kvcache/client/transport.py``), and dropped zmq for bulk data.
A state is one 1.4 MB transfer, the data path's own shape; reusing its
framing, handshake and limits gives peers the same authentication and
bounds, and ``bench/swa.py`` checks the fetch against raw pyzmq in one run.

Each connection is read, answered and read again (replies in order, one at a
time); a connection whose reply makes no progress for ``send_timeout_s`` is
closed. Who may hold a connection follows the daemon's admission rules
(:mod:`kvcache.server.admission`): connections still in their handshake have
bounds of their own (``max_preauth``, ``max_preauth_per_peer``; when full, the
oldest waiting one makes room) and must finish it within
``handshake_timeout_s``, so sockets opened without credentials never lock the
tenant's own peers out; ``max_connections`` bounds authenticated ones. A
request carries no data section (refused unread), and one still arriving after
``request_timeout_s``, or slower than ``min_request_rate`` bytes/s after its
grace, is cut off.
"""

from __future__ import annotations

import contextlib
import json
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from kvcache.credentials import TenantCredentials
from kvcache.errors import KVCacheError, ProtocolError
from kvcache.net_loop import SendQueue, WakePipe, accept_ready, bind_listener, watch
from kvcache.server.admission import Admission, AdmissionLimits
from kvcache.session import AUTH_BYTES, ServerHandshake
from kvcache.swa_local.protocol import GET_ITEM, get_reply, parse_get_request
from kvcache.swa_local.state import StateKey
from kvcache.swa_local.store import SwaStore
from kvcache.wire import (
    FLAG_REPLY,
    HEADER_BYTES,
    Frame,
    Header,
    Limits,
    Message,
    MessageReader,
    Op,
    Status,
    error_reply,
    plain_request,
)

__all__ = ["PeerServer"]

log = logging.getLogger(__name__)

_SNDBUF = 4 << 20
_HANDSHAKE, _AUTH, _READY, _CLOSING = range(4)
_NOT_FOUND = (Status.NOT_FOUND, 0, bytes(16))
_BAD_ITEM = (Status.BAD_ITEM, 0, bytes(16))


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    addr: object
    reader: MessageReader
    opened: float
    state: int = _AUTH
    auth: bytearray = field(default_factory=bytearray)
    handshake: ServerHandshake | None = None
    out: SendQueue = field(default_factory=SendQueue)
    last_progress: float = 0.0
    events: int = 0
    #: Its buffered requests are being answered (see PeerServer._answer_buffered).
    answering: bool = False
    #: When the request now arriving began to (0: none is half received).
    request_started: float = 0.0


class PeerServer:
    """The endpoint peers fetch this worker's states from (see the module docstring)."""

    def __init__(
        self,
        store: SwaStore,
        *,
        tenant: TenantCredentials,
        incarnation: int,
        listen: str = "tcp://127.0.0.1:0",
        limits: Limits | None = None,
        max_connections: int = 256,
        max_preauth: int = 256,
        max_preauth_per_peer: int = 64,
        handshake_timeout_s: float = 10.0,
        request_timeout_s: float = 10.0,
        send_timeout_s: float = 30.0,
    ) -> None:
        self.store = store
        self.tenant = tenant
        self.incarnation = incarnation
        self.listen = listen
        self.limits = limits or Limits()
        #: What a request may carry: its items, and no data section.
        self._request_limits = Limits(max_items=self.limits.max_items, max_data_bytes=0)
        self.max_connections = max_connections
        self.handshake_timeout_s = handshake_timeout_s
        self.send_timeout_s = send_timeout_s
        self._admission: Admission[int] = Admission(
            AdmissionLimits(
                max_connections=max_connections,
                tenant_connections=max_connections,
                max_preauth=max_preauth,
                max_preauth_per_peer=max_preauth_per_peer,
                handshake_timeout_s=handshake_timeout_s,
                request_timeout_s=request_timeout_s,
                request_grace_s=min(2.0, request_timeout_s),
            )
        )
        #: Connections past their handshake.
        self._authenticated = 0
        self.endpoint = ""
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "connections",
                "refused",
                "requests",
                "states_served",
                "bytes_served",
                "not_found",
                "stale_incarnation",
                "bad_requests",
                "handshakes_displaced",
                "handshakes_timed_out",
                "requests_cut_off",
            ),
            0,
        )
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._conns: dict[int, _Conn] = {}
        self._stop = threading.Event()
        self._wake = WakePipe()
        self._last_expire = 0.0
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        """Bind and serve on a thread of its own; returns ``tcp://host:port``."""
        sock, self.endpoint = bind_listener(self.listen, backlog=128, what="SWA peer endpoint")
        self._listener = sock
        self._selector.register(sock, selectors.EVENT_READ, None)
        self._selector.register(self._wake, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._serve, name="kvcache-swa-peer", daemon=True)
        self._thread.start()
        return self.endpoint

    def close(self) -> None:
        """Stop serving and close every connection (idempotent)."""
        self._stop.set()
        self._wake.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._wake.close()

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                for key, mask in self._selector.select(0.5):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake:
                        self._wake.drain()
                    else:
                        self._event(key.data, mask)
                self._expire(time.monotonic())
        except Exception:  # the loop must not die silently: log, and peers see misses
            log.exception("SWA peer server stopped on an error")
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            if self._listener is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(self._listener)
                self._listener.close()
                self._listener = None
            self._selector.close()

    def _accept(self) -> None:
        assert self._listener is not None
        ready: list[tuple[socket.socket, object]] = []
        try:
            ready.extend(accept_ready(self._listener))
        except OSError as exc:
            log.warning("SWA peer accept failed: %s", exc)
        for sock, addr in ready:
            # A state (1.4 MB in the reference) leaves in one or two sends, not a selector
            # round per 200 KB: measured 0.5 -> 0.4 ms per fetch on loopback.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
            now = time.monotonic()
            reader = MessageReader(limits=self._request_limits)
            conn = _Conn(sock, addr, reader, now, last_progress=now)
            fd = sock.fileno()
            peer = addr[0] if isinstance(addr, tuple) and addr else str(addr)
            for displaced in self._admission.preauth_open(fd, str(peer), now):
                self.counters["handshakes_displaced"] += 1
                self._close(self._conns[displaced])
            self._conns[fd] = conn
            self.counters["connections"] += 1
            conn.handshake = ServerHandshake(self._lookup)
            self._send(conn, [conn.handshake.hello()])

    def _lookup(self, name: str) -> TenantCredentials | None:
        return self.tenant if name == self.tenant.name else None

    def _event(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and not conn.out and conn.sock.fileno() >= 0:
            self._read(conn)

    def _read(self, conn: _Conn) -> None:
        while conn.state in (_AUTH, _READY) and not conn.out:
            if conn.state == _AUTH:
                buf = memoryview(bytearray(AUTH_BYTES - len(conn.auth)))
                idle = False
            else:
                idle = conn.reader.idle
                buf = conn.reader.recv_buffer()
            try:
                n = conn.sock.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(conn)
                return
            if n == 0:
                self._close(conn)
                return
            conn.last_progress = time.monotonic()
            if conn.state == _AUTH:
                conn.auth += buf[:n]
                if len(conn.auth) == AUTH_BYTES:
                    self._authenticate(conn)
                continue
            if idle and self._answer_whole_get(conn, buf, n):
                continue  # the reader never saw it, and stays idle
            if idle:
                conn.request_started = conn.last_progress
            conn.reader.commit(n)
            self._answer_buffered(conn)
            if conn.reader.idle:
                conn.request_started = 0.0
            if n < buf.nbytes:
                return  # the socket is drained: the selector says when more arrives

    def _authenticate(self, conn: _Conn) -> None:
        assert conn.handshake is not None
        result, tenant = conn.handshake.answer(bytes(conn.auth))
        conn.auth = bytearray()
        self._admission.preauth_close(conn.sock.fileno())
        if tenant is None:
            self.counters["refused"] += 1
            log.info("refused an SWA peer connection from %s: bad credentials", conn.addr)
            conn.state = _CLOSING
        elif self._authenticated >= self.max_connections:
            self.counters["refused"] += 1
            log.warning(
                "refused an SWA peer connection from %s: %d connections open (max_connections)",
                conn.addr,
                self._authenticated,
            )
            conn.state = _CLOSING
        else:
            conn.state = _READY
            self._authenticated += 1
        self._send(conn, [result])

    def _answer_whole_get(self, conn: _Conn, buf: memoryview, n: int) -> bool:
        """Answer the ``n`` bytes at the start of ``buf`` if they are exactly one plain
        SWA_GET request, without the generic reader; False to leave them to it.

        A fetch's request is one small message that arrives whole: on the H200 host the
        generic path (a checked Header, the items as a numpy record array, then bytes again)
        was most of the 40-70 us from the peer's wake-up to its first byte out, which a
        fetch waits on. Whatever is not exactly that shape (a partial request, several at
        once, flags, a data section, anything malformed) goes through
        :class:`MessageReader`, which checks it in full."""
        if n < HEADER_BYTES:
            return False
        plain = plain_request(buf[:HEADER_BYTES], Op.SWA_GET, self.limits)
        if plain is None or n != HEADER_BYTES + plain[1] * GET_ITEM.size:
            return False
        self.counters["requests"] += 1
        self._send(conn, self._answer_get(plain[0], buf[HEADER_BYTES:n]))
        return True

    def _answer_buffered(self, conn: _Conn) -> None:
        """Answer the complete requests buffered on ``conn``, one after another, while each
        reply goes out at once (the rest once the socket takes more). Called again from
        inside a reply's send, it returns: the loop here goes on (a call per request, one
        inside the other, crashed the peer with a RecursionError at a few thousand
        pipelined requests)."""
        if conn.answering:
            return
        conn.answering = True
        try:
            while conn.state == _READY and not conn.out:
                try:
                    message = conn.reader.next_message()
                except ProtocolError as exc:
                    self.counters["bad_requests"] += 1
                    conn.state = _CLOSING
                    self._send(conn, error_reply(None, Status.BAD_REQUEST, f"bad_request: {exc}"))
                    return
                if message is None:
                    return
                self._send(conn, self.answer(message))
        finally:
            conn.answering = False
            if conn.reader.idle:  # nothing half received: no request is timed any more
                conn.request_started = 0.0

    # ------------------------------------------------------------------ requests

    def answer(self, message: Message) -> list[Frame]:
        """The reply to one request (no I/O; tests call it directly). Never raises."""
        header = message.header
        self.counters["requests"] += 1
        if header.status != Status.OK:
            self.counters["bad_requests"] += 1
            return error_reply(header, Status.BAD_REQUEST, "bad_request: a request has no status")
        if header.op is Op.STATS:
            body = json.dumps(self.stats()).encode()
            reply = Header(
                op=Op.STATS,
                request_id=header.request_id,
                count=0,
                data_len=len(body),
                flags=FLAG_REPLY,
            )
            return [reply.pack(), body]
        if header.op is not Op.SWA_GET:
            self.counters["bad_requests"] += 1
            return error_reply(
                header,
                Status.BAD_REQUEST,
                f"bad_request: an SWA peer does not answer {header.op.name}",
            )
        return self._answer_get(header.request_id, message.items.tobytes())

    def _answer_get(self, request_id: int, items: bytes | memoryview) -> list[Frame]:
        """The reply to SWA_GET request ``request_id`` whose items are ``items`` (whole
        items); a request that is not OK never gets here."""
        answers: list[tuple[Status, int, bytes]] = []
        parts: list[Frame] = []
        total = 0
        for item in parse_get_request(items):
            if item.incarnation != self.incarnation:
                answers.append(_NOT_FOUND)
                self.counters["stale_incarnation"] += 1
                continue
            try:
                key = StateKey(
                    namespace=item.namespace,
                    block=item.block,  # type: ignore[arg-type]
                    position=item.position,
                )
            except KVCacheError:
                answers.append(_BAD_ITEM)
                continue
            state = self.store.get(key)
            if state is None:
                answers.append(_NOT_FOUND)
                self.counters["not_found"] += 1
                continue
            total += state.nbytes
            if total > self.limits.max_data_bytes:
                return error_reply(
                    Header(op=Op.SWA_GET, request_id=request_id, count=0),
                    Status.TOO_LARGE,
                    f"too_large: the states asked for exceed {self.limits.max_data_bytes} bytes",
                )
            answers.append((Status.OK, state.nbytes, state.digest))
            parts.append(state.data)
        self.counters["states_served"] += len(parts)
        self.counters["bytes_served"] += total
        return [get_reply(request_id, answers), *parts]

    def stats(self) -> dict[str, object]:
        """Server counters and the store's."""
        return {
            "endpoint": self.endpoint,
            "incarnation": self.incarnation,
            "server": dict(self.counters),
            "store": self.store.stats(),
        }

    # ------------------------------------------------------------------ sending

    def _send(self, conn: _Conn, frames: list[Frame]) -> None:
        conn.out.extend(frames)
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        out = conn.out
        if out:
            try:
                sent = out.flush(conn.sock)
            except OSError:
                self._close(conn)
                return
            if sent:
                conn.last_progress = time.monotonic()
            if out:
                self._watch(conn, selectors.EVENT_WRITE)
                return
        if conn.state == _CLOSING:
            self._close(conn)
            return
        self._watch(conn, selectors.EVENT_READ)
        if conn.state == _READY:
            self._answer_buffered(conn)

    def _watch(self, conn: _Conn, events: int) -> None:
        conn.events = watch(self._selector, conn.sock, conn.events, events, conn)

    def _close(self, conn: _Conn) -> None:
        conn.out.clear()
        fd = conn.sock.fileno()
        if fd >= 0:
            if conn.events:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(conn.sock)
                conn.events = 0
            if self._conns.pop(fd, None) is conn:
                self._admission.preauth_close(fd)
                if conn.state == _READY:
                    self._authenticated -= 1
        with contextlib.suppress(OSError):
            conn.sock.close()
        conn.state = _CLOSING

    def _expire(self, now: float) -> None:
        if now - self._last_expire < 0.1:  # a pass visits every connection
            return
        self._last_expire = now
        for fd in self._admission.handshakes_overdue(now):
            self.counters["handshakes_timed_out"] += 1
            self._close(self._conns[fd])
        for conn in list(self._conns.values()):
            if conn.state != _READY and now - conn.opened > self.handshake_timeout_s:
                self._close(conn)  # refused, its answer still going out
            elif conn.out and now - conn.last_progress > self.send_timeout_s:
                log.warning("closing SWA peer %s: its reply made no progress", conn.addr)
                self._close(conn)
            elif conn.request_started and not conn.out:
                received = conn.reader.buffered_bytes
                why = self._admission.request_overdue(conn.request_started, received, now)
                if why is not None:
                    self.counters["requests_cut_off"] += 1
                    log.warning("closing SWA peer %s: its request is too slow (%s)",
                                conn.addr, why)  # fmt: skip
                    self._close(conn)
