"""Opening an authenticated data-path connection, and exact blocking reads.

Shared by the cluster client's transport and the single-node probe: connect
over TCP (optionally TLS), run the session handshake (:mod:`kvcache.session`)
and hand back a blocking socket that carries :mod:`kvcache.wire` messages.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
from pathlib import Path

from kvcache.errors import AuthError, ConfigError, NodeError, NodeTimeoutError, ProtocolError
from kvcache.session import HELLO_BYTES, RESULT_BYTES, ClientHandshake
from kvcache.wire import parse_endpoint

__all__ = ["client_tls_context", "open_session", "recv_exact", "recv_exact_into"]

log = logging.getLogger(__name__)


def client_tls_context(ca_file: Path | None, *, check_hostname: bool = True) -> ssl.SSLContext:
    """A TLS client context trusting ``ca_file`` (the system store when None); ConfigError
    when the file cannot be read or holds no certificate."""
    try:
        context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"tls_ca {str(ca_file)!r} cannot be used as a CA file: {exc}; point tls_ca at "
            "the PEM certificate that signed the daemons' certificates"
        ) from exc
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = check_hostname
    return context


def open_session(
    endpoint: str,
    *,
    tenant: str,
    secret: bytes,
    timeout_s: float,
    node: str,
    tls: ssl.SSLContext | None = None,
    buffer_bytes: int = 4 << 20,
    expect_node: str | None = None,
    require_node: bool = False,
) -> socket.socket:
    """A connected, authenticated, *blocking* socket to a daemon (no timeout set on it).

    ``expect_node`` is the node id the map gives this address: with ``require_node`` (a map
    from etcd, where a node's entry is its own registration) a daemon announcing another id
    is refused with AuthError; without, a mismatch is logged once and the session is bound
    to the id announced.

    Raises NodeError when the daemon cannot be reached, NodeTimeoutError when
    it does not answer the handshake within ``timeout_s``, AuthError when it
    refuses the credentials, ProtocolError when it is not a kvcache daemon.
    """
    try:
        host, port = parse_endpoint(endpoint)
    except ValueError as exc:
        raise NodeError(str(exc), node=node) from None
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError:
        raise NodeTimeoutError(
            f"node {node} at {endpoint} did not accept a connection within {timeout_s:.3f}s",
            node=node,
        ) from None
    except OSError as exc:
        raise NodeError(
            f"node {node} at {endpoint} is not reachable: {exc.strerror or exc}", node=node
        ) from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
        handshake = ClientHandshake(
            tenant=tenant, secret=secret, expect_node=expect_node if require_node else None
        )
        sock.sendall(handshake.auth(recv_exact(sock, HELLO_BYTES, node)))
        if expect_node is not None and handshake.node_id != expect_node:
            _warn_other_id(expect_node, handshake.node_id, endpoint)
        handshake.check(recv_exact(sock, RESULT_BYTES, node), node)
        sock.settimeout(None)
        return sock
    except TimeoutError:
        sock.close()
        raise NodeTimeoutError(
            f"node {node} at {endpoint} did not finish the handshake within {timeout_s:.3f}s",
            node=node,
        ) from None
    except (AuthError, ProtocolError, NodeError):
        sock.close()
        raise
    except (ssl.SSLError, OSError) as exc:
        sock.close()
        raise NodeError(
            f"connecting to node {node} at {endpoint} failed: {exc}", node=node
        ) from None


_warned_ids: set[tuple[str, str]] = set()


def _warn_other_id(expected: str, announced: str, endpoint: str) -> None:
    """Log once per (map id, announced id) that a static map names a daemon otherwise."""
    if (expected, announced) in _warned_ids:
        return
    _warned_ids.add((expected, announced))
    log.warning(
        "node %s at %s says it is node %r (its node_id): set node_id = %r in its config, "
        "or name it %r in the cluster file; with etcd membership it would be refused",
        expected,
        endpoint,
        announced,
        expected,
        announced,
    )


def recv_exact(sock: socket.socket, size: int, node: str) -> bytes:
    """Exactly ``size`` bytes, or NodeError when the connection ends first."""
    buf = bytearray(size)
    recv_exact_into(sock, memoryview(buf), node)
    return bytes(buf)


def recv_exact_into(sock: socket.socket, view: memoryview, node: str) -> None:
    """Fill ``view`` from the socket, or raise NodeError when the connection ends first."""
    got = 0
    size = view.nbytes
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise NodeError(f"node {node} closed the connection", node=node)
        got += n
