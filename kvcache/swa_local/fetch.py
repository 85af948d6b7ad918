"""Fetching SWA states from the workers that hold them: an interface and a TCP implementation.

:class:`PeerTransport` is what the tier needs from a transport: fetch a batch
of states from one holder before a deadline. :class:`TcpPeerTransport`
implements it over the data path's framing and session
(:mod:`kvcache.net`, :mod:`kvcache.wire`), with a few pooled, authenticated
connections per holder; the reply's data section is received straight into
one buffer, and every state is checked against its digest (the one the
directory record carries when the caller has it, and the one the holder
sends) before it is handed on. A miss, a mismatch, a dead holder or a passed
deadline all come back as None for the states concerned: the engine then
recomputes; wrong bytes are never returned.

The RDMA plan (``docs/swa.md``): a UCX or NIXL transport implements the same
``fetch``; the holder registers its store's memory once, the directory record
gains the remote key, and a fetch becomes a one-sided read into the engine's
pinned buffer, with the digest checked the same way.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import logging
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import xxhash

from kvcache import native
from kvcache.errors import ArgumentError, KVCacheError, NodeError, ProtocolError
from kvcache.net import open_session
from kvcache.swa_local.protocol import GET_REPLY_ITEM, get_request, parse_get_reply
from kvcache.swa_local.state import STATE_DIGEST_TAG, StateKey
from kvcache.wire import HEADER_BYTES, Header, Limits, Op, Status

__all__ = ["PeerTransport", "TcpPeerTransport", "Wanted", "writable_bytes"]

log = logging.getLogger(__name__)

#: A state is received and hashed in pieces of this size: small enough to stay in a
#: core's L2 cache between the kernel's copy and the hash, and for the last piece's hash,
#: which nothing overlaps, to cost a few microseconds.
_PIECE = 128 << 10


@dataclass(frozen=True, slots=True)
class Wanted:
    """A state to fetch: its key, the holder incarnation its record names, and the digest
    the record carries (None: trust only the holder's own)."""

    key: StateKey
    incarnation: int
    digest: bytes | None = None


class PeerTransport(Protocol):
    """Fetches states from holders (TCP today; RDMA behind the same call later)."""

    def fetch(
        self,
        endpoint: str,
        wanted: Sequence[Wanted],
        *,
        deadline: float,
        out: Sequence[memoryview | None] | None = None,
    ) -> list[memoryview | None]:
        """Each wanted state's verified bytes, or None, by ``deadline`` (monotonic).

        With ``out`` (one writable buffer per wanted state), a state is received into its
        buffer and the buffer comes back; a state of another size than its buffer is a
        miss. A buffer whose state comes back None holds undefined bytes.
        """

    def close(self) -> None:
        """Close every connection."""


@dataclass
class _Pool:
    #: Idle connections, each with the kernel bound its calls are armed with (_Bound).
    idle: list[tuple[socket.socket, float]] = field(default_factory=list)
    open: int = 0


class TcpPeerTransport:
    """:class:`PeerTransport` over TCP with the data path's session (module docstring)."""

    def __init__(
        self,
        *,
        tenant: str,
        secret: bytes,
        connections_per_peer: int = 4,
        limits: Limits | None = None,
        tls: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tenant = tenant
        self._secret = secret
        self._per_peer = connections_per_peer
        self._limits = limits or Limits()
        self._tls = tls
        self._clock = clock
        self._lock = threading.Condition()
        self._pools: dict[str, _Pool] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.counters: dict[str, int] = dict.fromkeys(
            ("fetched", "bytes", "not_found", "corrupt", "wrong_size", "errors", "timeouts"), 0
        )

    # ------------------------------------------------------------------ fetching

    def fetch(
        self,
        endpoint: str,
        wanted: Sequence[Wanted],
        *,
        deadline: float,
        out: Sequence[memoryview | None] | None = None,
    ) -> list[memoryview | None]:
        """One SWA_GET to ``endpoint`` for every state of ``wanted`` (see PeerTransport)."""
        if out is not None:
            if len(out) != len(wanted):
                raise ArgumentError(f"out has {len(out)} buffers for {len(wanted)} states")
            out = [None if b is None else writable_bytes(b) for b in out]
        if not wanted:
            return []
        step = self._limits.max_items
        if len(wanted) > step:  # a peer refuses more items than its limit in one request
            results: list[memoryview | None] = []
            for at in range(0, len(wanted), step):
                part = None if out is None else out[at : at + step]
                results += self.fetch(endpoint, wanted[at : at + step], deadline=deadline, out=part)
            return results
        sock: socket.socket | None = None
        try:
            sock, armed = self._checkout(endpoint, deadline)
            bound = _Bound(sock, deadline, self._clock, armed=armed)
            results = self._exchange(sock, endpoint, wanted, bound, out)
        except TimeoutError:
            self._count("timeouts")
            self._discard(endpoint, sock)
            log.info("SWA fetch from %s passed its deadline", endpoint)
            return [None] * len(wanted)
        except (KVCacheError, OSError) as exc:
            self._count("errors")
            self._discard(endpoint, sock)
            log.info("SWA fetch from %s failed: %s", endpoint, exc)
            return [None] * len(wanted)
        self._checkin(endpoint, sock, bound.armed)
        return results

    def fetch_many(
        self, requests: Sequence[tuple[str, Wanted]], *, deadline: float
    ) -> list[memoryview | None]:
        """Fetch states from several holders at once (one request per holder, in parallel)."""
        by_holder: dict[str, list[int]] = {}
        for i, (endpoint, _) in enumerate(requests):
            by_holder.setdefault(endpoint, []).append(i)
        out: list[memoryview | None] = [None] * len(requests)

        def one(endpoint: str, positions: list[int]) -> None:
            got = self.fetch(endpoint, [requests[i][1] for i in positions], deadline=deadline)
            for i, value in zip(positions, got, strict=True):
                out[i] = value

        if len(by_holder) == 1:
            ((endpoint, positions),) = by_holder.items()
            one(endpoint, positions)
            return out
        with self._lock:
            if self._closed:  # no thread is started for a closed transport: all misses
                return out
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    8, thread_name_prefix="kvcache-swa-fetch"
                )
            executor = self._executor
        futures = [executor.submit(one, ep, pos) for ep, pos in by_holder.items()]
        concurrent.futures.wait(futures)
        return out

    def _exchange(
        self,
        sock: socket.socket,
        endpoint: str,
        wanted: Sequence[Wanted],
        bound: _Bound,
        out: Sequence[memoryview | None] | None,
    ) -> list[memoryview | None]:
        """One request and its reply: the request in one send; the reply's header and items
        in one receive (they leave together); each state received straight into its
        destination, piece by piece, each piece hashed while it is still in cache."""
        count = len(wanted)
        request_id = next(self._ids)
        request = get_request(request_id, [(w.key, w.incarnation) for w in wanted])
        try:
            sock.sendall(request)
        except BlockingIOError:  # SO_SNDTIMEO passed
            raise TimeoutError from None
        head = bytearray(HEADER_BYTES + count * GET_REPLY_ITEM.size)
        view = memoryview(head)
        got = _recv_some(sock, view, HEADER_BYTES, bound, endpoint)
        reply = Header.unpack(view[:HEADER_BYTES], self._limits)
        if not reply.is_reply:
            raise ProtocolError(f"SWA peer {endpoint} sent a request, not a reply")
        # An error is read before the op: a peer that could not read the request answers
        # with an op of its own (STATS), and its reason was lost.
        if reply.status != Status.OK:
            # An error reply has no items: what came after its header is its text.
            text = bytearray(reply.data_len)
            early = min(got - HEADER_BYTES, reply.data_len)
            text[:early] = view[HEADER_BYTES : HEADER_BYTES + early]
            _recv_exact(sock, memoryview(text)[early:], bound, endpoint)
            raise NodeError(
                f"SWA peer {endpoint} refused: {reply.status.name}: {text.decode(errors='replace')}",
                node=endpoint,
            )
        if reply.op is not Op.SWA_GET:
            raise ProtocolError(f"SWA peer {endpoint} answered {reply.op.name}, not SWA_GET")
        if reply.request_id != request_id:
            raise ProtocolError(f"SWA peer {endpoint} answered request {reply.request_id}")
        if reply.count != count:
            raise ProtocolError(f"SWA_GET reply has {reply.count} items for {count} asked")
        _recv_exact(sock, view[got:], bound, endpoint)
        answers = parse_get_reply(view[HEADER_BYTES:], count, reply.data_len)
        if out is None:
            data = np.empty(reply.data_len, np.uint8)
            spill = data.data.cast("B")
        else:
            spill = None
        results: list[memoryview | None] = []
        for i, (want, answer) in enumerate(zip(wanted, answers, strict=True)):
            if answer.status is not Status.OK:
                self._count("not_found")
                results.append(None)
                continue
            if spill is not None:
                dest = spill[answer.offset : answer.offset + answer.length]
            else:
                given = out[i] if out is not None else None
                if given is None or given.nbytes != answer.length:
                    # No room of its size: drained, and a miss for the caller.
                    self._count("wrong_size")
                    log.warning(
                        "SWA state from %s is %d bytes, its destination %s: not used",
                        endpoint,
                        answer.length,
                        "none" if given is None else given.nbytes,
                    )
                    _recv_hashed(sock, memoryview(bytearray(answer.length)), None, bound, endpoint)
                    results.append(None)
                    continue
                dest = given
            digest = _recv_hashed(sock, dest, STATE_DIGEST_TAG, bound, endpoint)
            if digest != answer.digest or (want.digest is not None and digest != want.digest):
                self._count("corrupt")
                log.warning("SWA state from %s failed its digest: not used", endpoint)
                results.append(None)
                continue
            self._count("fetched")
            self._count("bytes", answer.length)
            results.append(dest)
        return results

    # ------------------------------------------------------------------ connections

    def _checkout(self, endpoint: str, deadline: float) -> tuple[socket.socket, float]:
        """A connection to ``endpoint`` and its armed bound (0.0 for a new one)."""
        with self._lock:
            while True:
                if self._closed:
                    raise NodeError("SWA peer transport closed", node=endpoint)
                pool = self._pools.setdefault(endpoint, _Pool())
                if pool.idle:
                    return pool.idle.pop()
                if pool.open < self._per_peer:
                    pool.open += 1
                    break
                left = deadline - self._clock()
                if left <= 0:
                    raise TimeoutError
                self._lock.wait(left)
        try:
            timeout = max(0.001, deadline - self._clock())
            sock = open_session(
                endpoint,
                tenant=self._tenant,
                secret=self._secret,
                timeout_s=timeout,
                node=endpoint,
                tls=self._tls,
            )
        except BaseException:
            self._discard(endpoint, None)
            raise
        return sock, 0.0

    def _checkin(self, endpoint: str, sock: socket.socket, armed: float) -> None:
        with self._lock:
            pool = self._pools.setdefault(endpoint, _Pool())
            if self._closed:
                pool.open -= 1
                sock.close()
            else:
                pool.idle.append((sock, armed))
            self._lock.notify()

    def _discard(self, endpoint: str, sock: socket.socket | None) -> None:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        with self._lock:
            pool = self._pools.setdefault(endpoint, _Pool())
            pool.open = max(0, pool.open - 1)
            self._lock.notify()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def close(self) -> None:
        """Close every pooled connection; fetches after this fail (as misses)."""
        with self._lock:
            self._closed = True
            pools, self._pools = self._pools, {}
            executor, self._executor = self._executor, None
            self._lock.notify_all()
        for pool in pools.values():
            for sock, _ in pool.idle:
                with contextlib.suppress(OSError):
                    sock.close()
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> TcpPeerTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def writable_bytes(buf: memoryview) -> memoryview:
    """``buf`` as a flat byte view to receive into (ArgumentError: read-only or not contiguous)."""
    view = memoryview(buf)
    if view.readonly or not view.c_contiguous:
        raise ArgumentError("each out buffer must be writable and contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class _Bound:
    """Keeps a blocking socket's calls within a fetch's deadline.

    A plain socket stays blocking, with the bound in the kernel (SO_RCVTIMEO,
    SO_SNDTIMEO): one ``recv`` with MSG_WAITALL then takes a whole piece while it
    arrives, where a Python-level timeout makes the socket non-blocking and costs a
    poll per chunk (measured: 0.21 -> 0.15 ms for 1.4 MB on loopback). A call may end at
    most a tenth of the time left past the deadline: the bound is armed with a little more
    than the time left, and armed again only when it no longer fits (the time left has
    fallen by a tenth, or a new fetch has less time). A connection keeps its bound
    between fetches, so fetches with the same timeout arm it once, not twice per fetch
    (measured on the H200 host: ~15 us of a 0.8 ms fetch). A TLS socket takes a
    Python-level timeout instead.
    """

    __slots__ = ("_armed", "_clock", "_deadline", "_sock", "_tls")

    @property
    def deadline(self) -> float:
        """The fetch's deadline, on the bound's clock."""
        return self._deadline

    @property
    def armed(self) -> float:
        """The seconds any one call on the socket may block now (0.0: not set yet)."""
        return self._armed

    @property
    def native(self) -> bool:
        """Whether a native receive may keep this bound: a plain socket, and the deadline on
        ``time.monotonic`` (the C side checks it against CLOCK_MONOTONIC)."""
        return not self._tls and self._clock is time.monotonic

    def __init__(
        self,
        sock: socket.socket,
        deadline: float,
        clock: Callable[[], float],
        *,
        armed: float = 0.0,
    ) -> None:
        self._sock = sock
        self._deadline = deadline
        self._clock = clock
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._armed = armed
        self.check()

    def check(self) -> None:
        """Raise TimeoutError past the deadline; arm the bound again when it does not fit."""
        left = self._deadline - self._clock()
        if left <= 0:
            raise TimeoutError
        if left <= self._armed <= left * 1.1:
            return
        arm = left * 1.05
        sock = self._sock
        if self._tls:
            sock.settimeout(arm)
        else:
            if not self._armed:
                sock.settimeout(None)  # blocking from now on; the bound is the kernel's
            seconds = int(arm)
            bound = struct.pack("ll", seconds, max(1, int((arm - seconds) * 1e6)))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, bound)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, bound)
        self._armed = arm

    def after_native_receive(self) -> None:
        """The native receive arms a shorter receive bound itself once the time left falls
        below a tenth under the one armed: if it may have, the next check arms both bounds
        again (a later fetch on this connection would otherwise inherit the short one)."""
        if (self._deadline - self._clock()) * 1.1 < self._armed:
            self._armed = -1.0  # not 0: the socket is blocking already

    @property
    def waitall(self) -> int:
        """The receive flags: MSG_WAITALL, which TLS sockets do not take."""
        return 0 if self._tls else socket.MSG_WAITALL


def _recv(sock: socket.socket, view: memoryview, flags: int, bound: _Bound, endpoint: str) -> int:
    bound.check()
    try:
        n = sock.recv_into(view, view.nbytes, flags)
    except BlockingIOError:  # SO_RCVTIMEO passed with nothing received
        raise TimeoutError from None
    if n == 0:
        raise NodeError(f"SWA peer {endpoint} closed the connection", node=endpoint)
    return n


def _recv_some(
    sock: socket.socket, view: memoryview, least: int, bound: _Bound, endpoint: str
) -> int:
    """Receive into ``view`` what has arrived, at least ``least`` bytes; how many."""
    got = 0
    while got < least:
        got += _recv(sock, view[got:], 0, bound, endpoint)
    return got


def _recv_exact(sock: socket.socket, view: memoryview, bound: _Bound, endpoint: str) -> None:
    got, size, flags = 0, view.nbytes, bound.waitall
    while got < size:
        got += _recv(sock, view[got:], flags, bound, endpoint)


def _recv_hashed(
    sock: socket.socket,
    view: memoryview,
    tag: bytes | None,
    bound: _Bound,
    endpoint: str,
) -> bytes:
    """Fill ``view`` piece by piece, hashing each piece while it is in cache (and while the
    holder sends the next); the state digest of ``tag`` then the bytes (b"" with no tag).

    With the native helpers (a plain socket on the monotonic clock), the whole loop runs
    in one C call without the GIL: on the H200 host the Python loop's per-piece overhead
    and xxhash's SSE2 kernel were most of the fetch's cost over a raw socket transfer."""
    if native.AVAILABLE and bound.native:
        bound.check()
        status, _got, digest = native.recv_hashed(
            sock.fileno(), view, piece=_PIECE, deadline=bound.deadline, prefix=tag
        )
        bound.after_native_receive()
        if status == native.RECV_DONE:
            return digest
        if status == native.RECV_CLOSED:
            raise NodeError(f"SWA peer {endpoint} closed the connection", node=endpoint)
        if status == native.RECV_DEADLINE or status in (-errno.EAGAIN, -errno.EWOULDBLOCK):
            raise TimeoutError
        raise NodeError(
            f"SWA peer {endpoint}: receive failed: {os.strerror(-status)}", node=endpoint
        )
    hasher = None if tag is None else xxhash.xxh3_128(tag)
    got, size, flags = 0, view.nbytes, bound.waitall
    while got < size:
        end = min(size, got + _PIECE)
        n = _recv(sock, view[got:end], flags, bound, endpoint)
        if hasher is not None:
            hasher.update(view[got : got + n])
        got += n
    return b"" if hasher is None else hasher.digest()
