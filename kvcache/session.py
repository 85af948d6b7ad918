"""The session handshake that opens every data-path connection, without I/O.

A daemon serves nobody it has not authenticated. Right after the TCP (or TLS)
connection is made::

    daemon → client   HELLO    magic "KVHI", version, server nonce, the daemon's node id
    client → daemon   AUTH     magic "KVAU", version, tenant name, client nonce, proof
    daemon → client   RESULT   magic "KVOK" + server proof, or "KVNO" (then it closes)

``proof = HMAC-SHA256(secret, tag || server nonce || client nonce || len(tenant) ||
tenant || node id)`` with the tenant's secret and a tag per direction, so each side proves
it holds the secret without sending it, and the daemon learns the connection's tenant
from the secret, not from a claim. The server nonce is fresh per connection,
so a recorded handshake (and everything sent after it) cannot be replayed on
another connection. The daemon answers a wrong tenant and a wrong proof alike.

The node id binds the proofs to the daemon that made the nonce: a client's proof is good
for the node it announced only, so a node without the secret (registered through etcd,
say) cannot pass a client's handshake on to a real daemon and relay the session. A client
that knows which node it dialed (from an etcd-sourced map) refuses a HELLO announcing
another; one that does not (a static map, a probe) proves for the announced id, so a
relay still cannot use its proof elsewhere than that node.

Not covered: an attacker who can modify a live TCP stream could alter the
requests that follow the handshake; TLS on the data path (``tls_cert`` on the
daemon, ``tls_ca`` on the client) covers that, at a measured cost
(``docs/benchmarks.md``). ``docs/spec/session.md`` is the normative description.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass

from kvcache.credentials import TenantCredentials, check_tenant_name
from kvcache.errors import AuthError, ConfigError, NodeError, ProtocolError

__all__ = [
    "AUTH_BYTES",
    "HELLO_BYTES",
    "MAX_NODE_ID",
    "RESULT_BUSY",
    "RESULT_BYTES",
    "RESULT_REFUSED",
    "ClientHandshake",
    "ServerHandshake",
    "node_id_bytes",
]

SESSION_VERSION = 2
NONCE_BYTES = 32
MAX_TENANT = 64
#: Longest node id a HELLO carries (UTF-8 bytes): ``ServerConfig.node_id`` keeps within it.
MAX_NODE_ID = 128
# magic, version, node id length, reserved, server nonce, node id (zero-padded)
_HELLO = struct.Struct(f"<4sBBH32s{MAX_NODE_ID}s")
_AUTH = struct.Struct(
    "<4sBBH32s32s64s"
)  # magic, version, name length, reserved, nonce, proof, name
_RESULT = struct.Struct("<4sBBH32s")  # magic, version, code, reserved, server proof
HELLO_BYTES = _HELLO.size  # 168
AUTH_BYTES = _AUTH.size  # 136
RESULT_BYTES = _RESULT.size  # 40
#: A KVNO RESULT's code: the credentials were refused, or a connection limit was reached.
RESULT_REFUSED = 1
RESULT_BUSY = 2
_CLIENT_TAG = b"kvcache:session:v2:client\x00"
_SERVER_TAG = b"kvcache:session:v2:server\x00"


def _proof(
    tag: bytes,
    secret: bytes,
    server_nonce: bytes,
    client_nonce: bytes,
    name: bytes,
    node_id: bytes,
) -> bytes:
    message = tag + server_nonce + client_nonce + bytes((len(name),)) + name + node_id
    return hmac.new(secret, message, hashlib.sha256).digest()


def node_id_bytes(node_id: str) -> bytes:
    """A node id as a HELLO carries it; ConfigError when it cannot be (empty is allowed: a
    server with no node identity, such as a worker's SWA peer endpoint)."""
    raw = node_id.encode("utf-8")
    if len(raw) > MAX_NODE_ID:
        raise ConfigError(f"node id {node_id!r} is longer than {MAX_NODE_ID} bytes")
    return raw


@dataclass(slots=True)
class ServerHandshake:
    """The daemon's side: send :meth:`hello`, then feed the client's AUTH to :meth:`answer`.

    ``lookup`` maps a tenant name to its credentials (None: unknown tenant).
    """

    lookup: Callable[[str], TenantCredentials | None]
    #: This daemon's node id, announced in HELLO and bound into both proofs.
    node_id: str = ""
    nonce: bytes = b""
    _node: bytes = b""

    def __post_init__(self) -> None:
        self._node = node_id_bytes(self.node_id)
        if not self.nonce:
            self.nonce = secrets.token_bytes(NONCE_BYTES)

    def hello(self) -> bytes:
        """The HELLO the daemon sends first."""
        return _HELLO.pack(b"KVHI", SESSION_VERSION, len(self._node), 0, self.nonce, self._node)

    @staticmethod
    def busy() -> bytes:
        """The RESULT refusing a client whose credentials were good, because the daemon is at
        a connection limit (the tenant's or its own): ``KVNO`` with code 2, try later."""
        return _RESULT.pack(b"KVNO", SESSION_VERSION, RESULT_BUSY, 0, bytes(NONCE_BYTES))

    def answer(self, raw: bytes) -> tuple[bytes, TenantCredentials | None]:
        """(RESULT to send, the authenticated tenant or None when refused)."""
        refused = _RESULT.pack(b"KVNO", SESSION_VERSION, RESULT_REFUSED, 0, bytes(NONCE_BYTES))
        if len(raw) != AUTH_BYTES:
            return refused, None
        magic, version, name_len, reserved, client_nonce, proof, name_field = _AUTH.unpack(raw)
        if magic != b"KVAU" or version != SESSION_VERSION or reserved or name_len > MAX_TENANT:
            return refused, None
        name = name_field[:name_len]
        if any(name_field[name_len:]):
            return refused, None
        try:
            tenant = self.lookup(check_tenant_name(name.decode("ascii")))
        except (UnicodeDecodeError, ConfigError):
            tenant = None
        # Compute a proof even for an unknown tenant, so both refusals cost the same.
        secret = tenant.secret if tenant is not None else self.nonce
        expected = _proof(_CLIENT_TAG, secret, self.nonce, client_nonce, name, self._node)
        if tenant is None or not hmac.compare_digest(expected, proof):
            return refused, None
        server_proof = _proof(
            _SERVER_TAG, tenant.secret, self.nonce, client_nonce, name, self._node
        )
        return _RESULT.pack(b"KVOK", SESSION_VERSION, 0, 0, server_proof), tenant


@dataclass(slots=True)
class ClientHandshake:
    """The client's side: feed the daemon's HELLO to :meth:`auth`, its RESULT to :meth:`check`."""

    tenant: str
    secret: bytes
    #: The node id the client means to reach: a HELLO announcing another is refused
    #: (AuthError). None: prove for whatever node the HELLO announces.
    expect_node: str | None = None
    nonce: bytes = b""
    #: The node id the daemon announced (after :meth:`auth`).
    node_id: str = ""
    _server_nonce: bytes = b""
    _node: bytes = b""

    def __post_init__(self) -> None:
        check_tenant_name(self.tenant)
        if len(self.tenant) > MAX_TENANT:
            raise ConfigError(f"tenant name longer than {MAX_TENANT} characters")
        if not self.nonce:
            self.nonce = secrets.token_bytes(NONCE_BYTES)

    def auth(self, hello: bytes) -> bytes:
        """The AUTH answering the daemon's HELLO; raises ProtocolError for a bad HELLO."""
        if len(hello) != HELLO_BYTES:
            raise ProtocolError(f"session hello is {len(hello)} bytes, expected {HELLO_BYTES}")
        magic, version, id_len, reserved, server_nonce, id_field = _HELLO.unpack(hello)
        if magic != b"KVHI":
            raise ProtocolError(
                f"not a kvcache data endpoint (greeting {magic!r}); check the address"
            )
        if version != SESSION_VERSION:
            raise ProtocolError(
                f"daemon speaks session version {version}, this client {SESSION_VERSION} "
                "(upgrade daemons and clients together)"
            )
        if reserved or id_len > MAX_NODE_ID or any(id_field[id_len:]):
            raise ProtocolError("malformed session hello (its node id field)")
        node = id_field[:id_len]
        try:
            self.node_id = node.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("malformed session hello (its node id is not UTF-8)") from None
        if self.expect_node is not None and self.node_id != self.expect_node:
            raise AuthError(
                f"the daemon at node {self.expect_node}'s address says it is node "
                f"{self.node_id!r}: refused (a relay, or a map that names the node otherwise "
                "than its node_id)"
            )
        self._node = node
        self._server_nonce = server_nonce
        name = self.tenant.encode("ascii")
        proof = _proof(_CLIENT_TAG, self.secret, server_nonce, self.nonce, name, node)
        return _AUTH.pack(b"KVAU", SESSION_VERSION, len(name), 0, self.nonce, proof, name)

    def check(self, result: bytes, node: str = "") -> None:
        """Raise AuthError unless the daemon accepted us and proved it holds our secret
        (NodeError when it refused the connection for a connection limit: try later)."""
        if len(result) != RESULT_BYTES:
            raise ProtocolError(f"session result is {len(result)} bytes, expected {RESULT_BYTES}")
        magic, _version, code, _reserved, server_proof = _RESULT.unpack(result)
        if magic == b"KVNO" and code == RESULT_BUSY:
            raise NodeError(
                f"node {node or '?'} refused the connection: it is at its connection limit "
                f"(tenant {self.tenant!r}'s or its own); try again later",
                node=node,
            )
        if magic == b"KVNO" or code:
            raise AuthError(
                f"the daemon refused tenant {self.tenant!r}: wrong or missing secret "
                "(check the client's credentials_file / secret)"
            )
        if magic != b"KVOK":
            raise ProtocolError(f"bad session result {magic!r}")
        name = self.tenant.encode("ascii")
        expected = _proof(
            _SERVER_TAG, self.secret, self._server_nonce, self.nonce, name, self._node
        )
        if not hmac.compare_digest(expected, server_proof):
            raise AuthError("the daemon could not prove it holds this tenant's secret")
