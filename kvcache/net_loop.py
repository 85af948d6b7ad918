"""The socket plumbing of a one-thread selector loop: listener, wake-up pipe, send queue.

Shared by the storage daemon's data server (:mod:`kvcache.server.loop`) and the SWA
tier's peer endpoint (:mod:`kvcache.swa_local.server`), which were written twice:

- :func:`bind_listener` binds a non-blocking listening socket to ``tcp://host:port``;
- :func:`accept_ready` takes the connections waiting on it, a bounded number per turn;
- :class:`WakePipe` interrupts the loop's ``select`` from other threads (or a signal);
- :class:`SendQueue` holds a connection's outgoing sections and sends what the socket
  takes, with ``sendmsg`` straight from the callers' buffers (``native.send_gather`` for
  :class:`~kvcache.native.Segments`, ``sendfile`` for a :class:`FileRange`, plain
  ``send`` under TLS);
- :func:`watch` keeps a connection's selector registration equal to what it waits for.

What a connection is and what it is answered stay with each server: this module owns no
connection state and makes no decision.
"""

from __future__ import annotations

import collections
import contextlib
import os
import selectors
import socket
import ssl
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from kvcache import native
from kvcache.errors import KVCacheError
from kvcache.wire import parse_endpoint

__all__ = [
    "FileRange",
    "SendQueue",
    "WakePipe",
    "accept_ready",
    "bind_listener",
    "frame_nbytes",
    "frame_view",
    "watch",
]

#: Most buffers per sendmsg call (Linux IOV_MAX is 1024).
IOV_MAX = 1024


def bind_listener(endpoint: str, *, backlog: int, what: str) -> tuple[socket.socket, str]:
    """A non-blocking socket listening on ``endpoint`` (``tcp://host:port``, port 0 for any)
    and the endpoint it is bound to; KVCacheError naming ``what`` when it cannot be."""
    try:
        host, port = parse_endpoint(endpoint)
    except ValueError as exc:
        raise KVCacheError(f"{what}: {exc}") from None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise KVCacheError(f"cannot bind {what} {endpoint}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    return sock, f"tcp://{shown}:{bound_port}"


def accept_ready(
    listener: socket.socket, *, limit: int = 64
) -> Iterator[tuple[socket.socket, Any]]:
    """The connections waiting on ``listener`` (at most ``limit``), each non-blocking, with
    TCP_NODELAY on TCP. Raises OSError (e.g. EMFILE) from ``accept``; stops when none waits."""
    for _ in range(limit):
        try:
            sock, addr = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        yield sock, addr


class WakePipe:
    """A pipe whose read end a selector watches; :meth:`wake` makes ``select`` return."""

    __slots__ = ("_r", "_w")

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        """The read end (register it with the selector)."""
        return self._r

    def wake(self) -> None:
        """Interrupt the loop's ``select`` (thread- and signal-safe)."""
        with contextlib.suppress(OSError):  # full pipe: already woken; closed: shutting down
            os.write(self._w, b"\0")

    def drain(self) -> None:
        """Take the wake-ups sent so far (when the read end is ready)."""
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._r, 4096):
                pass

    def close(self) -> None:
        """Close both ends (idempotent)."""
        for fd in (self._r, self._w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._r = self._w = -1


class _OpenFile(Protocol):
    def fileno(self) -> int: ...


class FileRange:
    """Bytes of an open file to send with ``sendfile``: the kernel sends them from the page
    cache, with no copy through this process (a daemon's GET reply, issue 17).

    ``view`` is a mapping of the same bytes, sent instead where ``sendfile`` cannot be
    (TLS). Holding the range holds ``file`` open (and ``view``'s mapping alive), so the
    file cannot be closed or reused under a reply in flight.
    """

    __slots__ = ("file", "length", "offset", "view")

    def __init__(self, file: _OpenFile, offset: int, view: memoryview) -> None:
        self.file = file
        self.offset = offset
        self.length = view.nbytes
        self.view = view

    def advance(self, sent: int) -> None:
        """``sent`` bytes of the range left."""
        self.offset += sent
        self.length -= sent
        self.view = self.view[sent:]


def frame_nbytes(frame: Any) -> int:
    """Bytes of a reply section: a buffer or a :class:`FileRange`."""
    return frame.length if type(frame) is FileRange else memoryview(frame).nbytes


def frame_view(frame: Any) -> memoryview:
    """A reply section as a flat byte view (a :class:`FileRange`'s mapping)."""
    view = frame.view if type(frame) is FileRange else memoryview(frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class SendQueue:
    """A connection's outgoing sections, sent in order as the socket takes them.

    Sections are kept as given (views of the callers' buffers, never copied) until their
    last byte left; :meth:`flush` never blocks.
    """

    __slots__ = ("_out", "_special")

    def __init__(self) -> None:
        self._out: collections.deque[memoryview | native.Segments | FileRange] = collections.deque()
        #: How many queued sections are Segments or FileRanges (none: one sendmsg takes all).
        self._special = 0

    def __bool__(self) -> bool:
        return bool(self._out)

    def __len__(self) -> int:
        return len(self._out)

    def extend(self, frames: Iterable[Any]) -> None:
        """Queue sections: buffers (bytes, memoryviews, arrays), Segments and FileRanges;
        empty ones are dropped."""
        out = self._out
        for frame in frames:
            if type(frame) is FileRange:
                if frame.length:
                    out.append(frame)
                    self._special += 1
                continue
            if isinstance(frame, native.Segments):
                if frame.count:
                    out.append(frame)
                    self._special += 1
                continue
            view = memoryview(frame)
            if view.nbytes:
                out.append(view if view.format == "B" and view.ndim == 1 else view.cast("B"))

    def clear(self) -> None:
        """Drop what is queued (the connection is gone)."""
        self._out.clear()
        self._special = 0

    def flush(self, sock: socket.socket) -> int:
        """Send what ``sock`` takes now; the bytes sent. The queue is empty afterwards when
        everything went. Raises OSError (ssl.SSLError under TLS) when the connection fails."""
        out = self._out
        tls = isinstance(sock, ssl.SSLSocket)
        gather = native.AVAILABLE and not tls
        total = 0
        try:
            while out:
                first = out[0]
                if type(first) is FileRange:
                    if tls:  # no sendfile through TLS: send the mapping
                        out[0] = first.view
                        self._special -= 1
                        continue
                    sent = os.sendfile(
                        sock.fileno(), first.file.fileno(), first.offset, first.length
                    )
                    if not sent:
                        raise OSError(f"file ended {first.length} bytes short of its range")
                    total += sent
                    first.advance(sent)
                    if first.length:
                        return total  # the socket's buffer is full
                    out.popleft()
                    self._special -= 1
                    continue
                if type(first) is not memoryview:
                    assert isinstance(first, native.Segments)
                    if not gather:
                        out.popleft()
                        self._special -= 1
                        out.extendleft(reversed(first.views()))
                        continue
                    total += native.send_gather(sock.fileno(), first)
                    if not first.done:
                        return total  # the socket's buffer is full
                    out.popleft()
                    self._special -= 1
                    continue
                if tls:
                    sent = sock.send(first)
                elif not self._special and len(out) <= IOV_MAX:
                    sent = sock.sendmsg(list(out))  # type: ignore[arg-type]
                else:
                    sent = sock.sendmsg(_head(out))
                total += sent
                while sent:
                    head = out[0]
                    assert isinstance(head, memoryview)
                    if sent >= head.nbytes:
                        sent -= head.nbytes
                        out.popleft()
                    else:
                        out[0] = head[sent:]
                        sent = 0
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
            pass
        return total


def _head(
    out: collections.deque[memoryview | native.Segments | FileRange],
) -> list[memoryview]:
    """The views at the head of ``out``, up to IOV_MAX or the first Segments or FileRange."""
    views: list[memoryview] = []
    for item in out:
        if type(item) is not memoryview or len(views) == IOV_MAX:
            break
        views.append(item)
    return views


def watch(
    selector: selectors.BaseSelector, sock: socket.socket, registered: int, events: int, data: Any
) -> int:
    """Make ``sock``'s registration wait for ``events`` (0: none) instead of ``registered``;
    the events now registered. A closed socket is left alone."""
    if sock.fileno() < 0 or events == registered:
        return registered
    if not events:
        selector.unregister(sock)
    elif not registered:
        selector.register(sock, events, data)
    else:
        selector.modify(sock, events, data)
    return events
