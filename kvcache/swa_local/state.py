"""What an SWA state is and what names it: the key, the digest, the window's blocks. Pure.

A model with sliding-window attention layers needs, to continue a sequence
from token position ``P``, only those layers' KV of the last ``window - 1``
tokens before ``P``: the *state* at ``P``. It serves exactly one
continuation point, so it is named by three things (:class:`StateKey`):

- the *state namespace* (8 bytes): everything that makes state bytes
  incompatible (model, revision, which layers, window, block size, dtype,
  packing, parallel rank, tenant), derived from a :class:`~kvcache.Namespace`;
- the chained block key of the prefix the state follows (the key of block
  ``P / B - 1`` in the main store's namespace: it names every token before
  ``P``, so two prompts share a state only when they share the whole prefix);
- the position ``P`` itself.

A state's bytes are opaque to the tier; they are checked end to end by an
xxh3-128 digest under a domain tag, computed by the worker that took the
state and carried in its directory record.

WARNING: the tags below define every state key and digest; changing one
turns every held state and directory record into a miss. Golden vectors in
``tests/test_swa_store.py`` pin them. See ``docs/spec/swa.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from kvcache.errors import ArgumentError
from kvcache.keys import KEY_BYTES, BlockKey, Namespace

__all__ = [
    "DIGEST_BYTES",
    "STATE_DIGEST_TAG",
    "STATE_NS_BYTES",
    "STATE_NS_TAG",
    "StateKey",
    "state_digest",
    "state_hasher",
    "state_namespace_id",
    "window_blocks",
]

#: Domain tag of the 8-byte state namespace id.
STATE_NS_TAG = b"kvcache:swa-ns:v1\x00"
#: Domain tag hashed in front of a state's bytes for its digest.
STATE_DIGEST_TAG = b"kvcache:swa-state:v1\x00"
STATE_NS_BYTES = 8
DIGEST_BYTES = 16
MAX_POSITION = 2**32 - 1


def state_namespace_id(namespace: Namespace) -> bytes:
    """The 8-byte id of a state namespace (a Namespace describing the SWA layers' state)."""
    return xxhash.xxh3_64_digest(STATE_NS_TAG + namespace.seed)


def state_hasher() -> xxhash.xxh3_128:
    """A hasher that gives :func:`state_digest` of the bytes it is fed, piece by piece
    (a fetch hashes each piece of a state while it is still in cache)."""
    return xxhash.xxh3_128(STATE_DIGEST_TAG)


def state_digest(data: bytes | bytearray | memoryview) -> bytes:
    """The 16-byte xxh3-128 digest of a state's bytes (no copy of ``data``)."""
    hasher = state_hasher()
    hasher.update(data)
    return hasher.digest()


@dataclass(frozen=True, slots=True, kw_only=True)
class StateKey:
    """Names one SWA state: namespace id, the block key of its prefix, its position."""

    namespace: bytes
    block: BlockKey
    position: int

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, bytes) or len(self.namespace) != STATE_NS_BYTES:
            raise ArgumentError(f"StateKey.namespace must be {STATE_NS_BYTES} bytes")
        if not isinstance(self.block, bytes) or len(self.block) != KEY_BYTES:
            raise ArgumentError(f"StateKey.block must be a {KEY_BYTES}-byte block key")
        if (
            isinstance(self.position, bool)
            or not isinstance(self.position, int)
            or not 1 <= self.position <= MAX_POSITION
        ):
            raise ArgumentError(f"StateKey.position must be 1..2**32-1, got {self.position!r}")


def window_blocks(position: int, *, window: int, block_size: int) -> tuple[int, int]:
    """Blocks ``[first, end)`` holding the tokens a continuation from ``position`` attends to
    in a sliding-window layer of ``window`` tokens (the token itself included): tokens
    ``max(0, position - window + 1) .. position - 1``.

    This is what vLLM keeps (and needs filled) for a hit of ``position`` tokens.
    """
    if window < 1 or block_size < 1 or position < 0:
        raise ArgumentError(
            f"need window >= 1, block_size >= 1, position >= 0; got {window}, {block_size}, "
            f"{position}"
        )
    first = max(0, position - window + 1) // block_size
    end = -(-position // block_size)
    return first, max(first, end)
