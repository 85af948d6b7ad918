"""The one error hierarchy of kvcache.

Every exception kvcache raises on purpose derives from :class:`KVCacheError`::

    KVCacheError
    ├── ConfigError              a configuration value is missing or invalid
    │   └── ArgumentError        an argument to a kvcache call is invalid (also a ValueError)
    ├── FormatError              untrusted bytes do not parse (the peer/disk sent something wrong)
    │   ├── ShardFormatError     a shard header or shard body is malformed
    │   └── ProtocolError        a wire message is malformed
    ├── IntegrityError           bytes parsed but their checksum does not match
    ├── ErasureError             the erasure codec cannot do what was asked
    │   └── TooManyErasuresError fewer than k shards of a stripe are available
    ├── StorageError             the local store failed (LMDB, disk); ``kind`` says how
    │   ├── CapacityError        the store is full and could not make room
    │   └── QuotaError           a tenant is at its byte quota and its own shards cannot make room
    ├── AuthError                a request lacked valid credentials
    ├── ClosedError              a call on a client (or store) that was closed
    └── ClusterError             talking to storage nodes failed
        ├── NodeError            one node answered with an error or not at all
        │   ├── NodeTimeoutError one node did not answer in time
        │   └── ExchangeAbortedError  the client itself cut a reply it no longer wanted

Errors carry the fields a caller needs (key, node, shard, expected, actual) as
attributes; their messages say what failed, the value seen and what to do.
"""

from __future__ import annotations

__all__ = [
    "ArgumentError",
    "AuthError",
    "CapacityError",
    "ClosedError",
    "ClusterError",
    "ConfigError",
    "ErasureError",
    "FormatError",
    "IntegrityError",
    "KVCacheError",
    "NodeError",
    "NodeTimeoutError",
    "ExchangeAbortedError",
    "ProtocolError",
    "QuotaError",
    "ShardFormatError",
    "StorageError",
    "TooManyErasuresError",
]


class KVCacheError(Exception):
    """Root of every error kvcache raises on purpose."""


class ConfigError(KVCacheError):
    """A configuration value is missing or invalid; the message names the field."""


class ArgumentError(ConfigError, ValueError):
    """An argument to a kvcache call is invalid; raised before any I/O."""


class FormatError(KVCacheError):
    """Untrusted bytes (from a socket or a disk) do not parse."""


class ShardFormatError(FormatError):
    """A shard header or shard body is malformed."""


class ProtocolError(FormatError):
    """A wire message is malformed: bad magic, version, op, counts or frame sizes."""


class IntegrityError(KVCacheError):
    """Bytes parsed but do not match their checksum: never hand them on."""

    def __init__(self, message: str, *, expected: object = None, actual: object = None) -> None:
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class ErasureError(KVCacheError):
    """The erasure codec was asked for something it cannot do."""


class TooManyErasuresError(ErasureError):
    """Fewer than k shards of a stripe are available, so the block cannot be rebuilt."""

    def __init__(self, message: str, *, needed: int, available: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available


class StorageError(KVCacheError):
    """The local shard store failed.

    ``kind`` names how, for counters and replies: ``capacity``, ``quota``,
    ``map_full``, ``disk_full``, ``disk_io`` or ``storage`` (anything else).
    """

    def __init__(self, message: str, *, kind: str = "storage") -> None:
        super().__init__(message)
        self.kind = kind


class CapacityError(StorageError):
    """The store is full and eviction could not make enough room."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="capacity")


class QuotaError(StorageError):
    """A tenant is at its byte quota and evicting its own shards could not make room."""

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="quota")


class AuthError(KVCacheError):
    """Credentials were missing or refused: the session handshake failed (wrong tenant
    secret, unknown tenant) or an admin change came without the admin token."""


class ClusterError(KVCacheError):
    """Talking to the storage nodes failed."""


class NodeError(ClusterError):
    """One node answered with an error, or not at all."""

    def __init__(self, message: str, *, node: str) -> None:
        super().__init__(message)
        self.node = node


class NodeTimeoutError(NodeError):
    """One node did not answer before the deadline."""


class ExchangeAbortedError(NodeError):
    """The client cut the connection carrying this exchange (its reply, late, was no longer
    wanted): it says nothing about the node's health, which is not marked down for it."""


class ClosedError(KVCacheError):
    """A call on a client that was closed: it has no connections left, and a quiet miss
    would hide the bug. Open a new client."""
