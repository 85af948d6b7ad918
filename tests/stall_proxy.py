"""A TCP proxy in front of one daemon that holds its replies back where a test says.

The client connects to the proxy as if it were the daemon (the session handshake passes
through untouched); bytes from the client go straight on; bytes from the daemon pass until
the budget set by :meth:`StallProxy.hold_after` is spent, then wait for
:meth:`StallProxy.release`. So a test can stop a reply inside its header, its items or its
data, exactly, and let the client meet that.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

__all__ = ["StallProxy"]


class StallProxy:
    """A proxy on 127.0.0.1 (``endpoint``) to ``target`` (host, port)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._cond = threading.Condition()
        self._budget: int | None = None  # None: no hold
        #: Daemon bytes held back so far (for the test to wait on).
        self.held = 0
        self._closed = False
        self._socks: list[socket.socket] = []
        self._cut_next = False
        #: Connections cut by :meth:`cut_next`.
        self.cut = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def hold_after(self, nbytes: int) -> None:
        """From now on let ``nbytes`` more bytes from the daemon through, then hold the rest."""
        with self._cond:
            self._budget = nbytes
            self.held = 0

    def cut_next(self) -> None:
        """Close the next connection a client request arrives on, both ways, instead of
        passing the request (a daemon dying under one of a client's connections)."""
        with self._cond:
            self._cut_next = True

    def release(self) -> None:
        """Let everything through again."""
        with self._cond:
            self._budget = None
            self._cond.notify_all()

    def wait_held(self, timeout_s: float = 10.0) -> bool:
        """Wait until the hold stopped some bytes."""
        with self._cond:
            return self._cond.wait_for(lambda: self.held > 0, timeout_s)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._budget = None
            self._cond.notify_all()
        for sock in [self._listener, *self._socks]:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> StallProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                daemon = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for sock in (client, daemon):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks += [client, daemon]
            threading.Thread(target=self._pipe, args=(client, daemon, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(daemon, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if not replies:
                    with self._cond:
                        cut, self._cut_next = self._cut_next, False
                        self.cut += cut
                    if cut:
                        break
                for chunk in self._chunks(data) if replies else [data]:
                    dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _chunks(self, data: bytes) -> Iterator[bytes]:
        """``data`` as it may pass: what the budget allows now, the rest once released."""
        while data:
            with self._cond:
                if self._budget is None:
                    allowed = len(data)
                else:
                    allowed = min(len(data), self._budget)
                    self._budget -= allowed
                    if allowed < len(data):
                        self.held += len(data) - allowed
                        self._cond.notify_all()
            if allowed:
                yield data[:allowed]
                data = data[allowed:]
            if data:
                with self._cond:
                    self._cond.wait_for(lambda: self._budget is None or self._budget > 0)
                    if self._closed:
                        return
