"""The session handshake that opens every data-path connection, without I/O.

A daemon serves nobody it has not authenticated. Right after the TCP (or TLS)
connection is made::

    daemon → client   HELLO    magic "KVHI", version, server nonce (32 random bytes)
    client → daemon   AUTH     magic "KVAU", version, tenant name, client nonce, proof
    daemon → client   RESULT   magic "KVOK" + server proof, or "KVNO" (then it closes)

``proof = HMAC-SHA256(secret, tag || server nonce || client nonce || tenant)``
with the tenant's secret and a tag per direction, so each side proves it holds
the secret without sending it, and the daemon learns the connection's tenant
from the secret, not from a claim. The server nonce is fresh per connection,
so a recorded handshake (and everything sent after it) cannot be replayed on
another connection. The daemon answers a wrong tenant and a wrong proof alike.

Not covered: an attacker who can modify a live TCP stream could alter the
requests that follow the handshake; TLS on the data path (``tls_cert`` on the
daemon, ``tls_ca`` on the client) covers that, at a measured cost
(``docs/benchmarks.md``). ``docs/spec/wire.md`` is the normative description.
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
    "RESULT_BUSY",
    "RESULT_BYTES",
    "RESULT_REFUSED",
    "ClientHandshake",
    "ServerHandshake",
]

SESSION_VERSION = 1
NONCE_BYTES = 32
MAX_TENANT = 64
_HELLO = struct.Struct("<4sBBH32s")  # magic, version, flags, reserved, server nonce
_AUTH = struct.Struct(
    "<4sBBH32s32s64s"
)  # magic, version, name length, reserved, nonce, proof, name
_RESULT = struct.Struct("<4sBBH32s")  # magic, version, code, reserved, server proof
HELLO_BYTES = _HELLO.size  # 40
AUTH_BYTES = _AUTH.size  # 136
RESULT_BYTES = _RESULT.size  # 40
#: A KVNO RESULT's code: the credentials were refused, or a connection limit was reached.
RESULT_REFUSED = 1
RESULT_BUSY = 2
_CLIENT_TAG = b"kvcache:session:v1:client\x00"
_SERVER_TAG = b"kvcache:session:v1:server\x00"


def _proof(
    tag: bytes, secret: bytes, server_nonce: bytes, client_nonce: bytes, name: bytes
) -> bytes:
    return hmac.new(secret, tag + server_nonce + client_nonce + name, hashlib.sha256).digest()


@dataclass(slots=True)
class ServerHandshake:
    """The daemon's side: send :meth:`hello`, then feed the client's AUTH to :meth:`answer`.

    ``lookup`` maps a tenant name to its credentials (None: unknown tenant).
    """

    lookup: Callable[[str], TenantCredentials | None]
    nonce: bytes = b""

    def __post_init__(self) -> None:
        if not self.nonce:
            self.nonce = secrets.token_bytes(NONCE_BYTES)

    def hello(self) -> bytes:
        """The HELLO the daemon sends first."""
        return _HELLO.pack(b"KVHI", SESSION_VERSION, 0, 0, self.nonce)

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
        expected = _proof(_CLIENT_TAG, secret, self.nonce, client_nonce, name)
        if tenant is None or not hmac.compare_digest(expected, proof):
            return refused, None
        server_proof = _proof(_SERVER_TAG, tenant.secret, self.nonce, client_nonce, name)
        return _RESULT.pack(b"KVOK", SESSION_VERSION, 0, 0, server_proof), tenant


@dataclass(slots=True)
class ClientHandshake:
    """The client's side: feed the daemon's HELLO to :meth:`auth`, its RESULT to :meth:`check`."""

    tenant: str
    secret: bytes
    nonce: bytes = b""
    _server_nonce: bytes = b""

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
        magic, version, _flags, _reserved, server_nonce = _HELLO.unpack(hello)
        if magic != b"KVHI":
            raise ProtocolError(
                f"not a kvcache data endpoint (greeting {magic!r}); check the address"
            )
        if version != SESSION_VERSION:
            raise ProtocolError(
                f"daemon speaks session version {version}, this client {SESSION_VERSION}"
            )
        self._server_nonce = server_nonce
        name = self.tenant.encode("ascii")
        proof = _proof(_CLIENT_TAG, self.secret, server_nonce, self.nonce, name)
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
        expected = _proof(_SERVER_TAG, self.secret, self._server_nonce, self.nonce, name)
        if not hmac.compare_digest(expected, server_proof):
            raise AuthError("the daemon could not prove it holds this tenant's secret")
