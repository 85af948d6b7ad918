"""Prefix-chained block keys.

``key_0 = H(seed, tokens[0:B])`` and ``key_i = H(key_{i-1}, tokens[iB:(i+1)B])``
where ``H`` is xxh3-128 over a domain tag, the 16-byte parent and the block's
token ids as little-endian uint32, except that a block whose index is not a
multiple of the namespace's placement group keeps its parent's first
:data:`PLACEMENT_TAG_BYTES` bytes: the placement tag. A key therefore names a
block *and everything before it*, and the blocks of one group (about 8 MiB of
consecutive blocks of a prompt) share their holders (:mod:`kvcache.placement`),
so a call for a prompt's blocks asks a dozen nodes, not a dozen per block. The seed is derived from a :class:`Namespace`, which
covers everything that makes KV bytes incompatible, so two models, layouts,
ranks or tenants never share a key.

WARNING: these functions define every key in every cluster. Changing a tag,
a field order or an encoding silently turns every stored block into garbage
nobody can find. ``tests/test_keys.py`` pins golden vectors; a change that
breaks them needs a new domain tag version (``v2``), never an edit of ``v1``.
See ``docs/spec/hashing.md``.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType, cast

import numpy as np
import numpy.typing as npt
import xxhash

from kvcache import native
from kvcache.errors import ArgumentError, ConfigError
from kvcache.layout import KVLayout

__all__ = [
    "BLOCK_TAG",
    "BLOCK_TAG_V1",
    "PLACEMENT_TAG_BYTES",
    "KEY_BYTES",
    "NAMESPACE_TAG",
    "BlockKey",
    "Namespace",
    "TokenArray",
    "are_block_keys",
    "as_token_array",
    "block_keys",
    "full_blocks",
    "group_blocks_for",
    "placement_group_blocks",
]

#: Domain tag hashed in front of every block key (version 2: placement groups).
BLOCK_TAG = b"kvcache:block:v2\x00"
#: Version 1's tag: keys without placement groups (docs/spec/hashing.md, section 5).
BLOCK_TAG_V1 = b"kvcache:block:v1\x00"
#: Domain tag hashed in front of every namespace seed.
NAMESPACE_TAG = b"kvcache:namespace:v1\x00"
#: Length of a block key and of a namespace seed in bytes.
KEY_BYTES = 16

#: Leading bytes of a block key that decide where it is placed: shared by a placement group.
PLACEMENT_TAG_BYTES = 4
#: Payload bytes of blocks a placement group aims at (a power of two of blocks within it).
PLACEMENT_GROUP_BYTES = 8 << 20
#: Most blocks in one placement group.
MAX_PLACEMENT_GROUP_BLOCKS = 64

BlockKey = NewType("BlockKey", bytes)
#: Prompts of at least this many blocks are keyed in one native call (shorter ones pay
#: less for the Python loop than for the call).
_NATIVE_CHAIN_MIN = 4
TokenArray = npt.NDArray[np.uint32]


def are_block_keys(keys: Sequence[object]) -> bool:
    """Whether every item of ``keys`` is a block key: bytes (or a bytes subclass) of
    :data:`KEY_BYTES`. Judged by type and length over the whole list at once (``map`` of
    builtins), not a Python step per key: a 64-block call checks its keys on every load."""
    types = set(map(type, keys))
    return all(issubclass(t, bytes) for t in types) and set(map(len, keys)) <= {KEY_BYTES}  # type: ignore[arg-type]


_MAX_FIELD = 1024
_U32_CODE = "I" if array.array("I").itemsize == 4 else "L"
_NATIVE_IS_LE = sys.byteorder == "little"


def _field_bytes(name: str, value: str) -> bytes:
    if not isinstance(value, str):
        raise ConfigError(f"Namespace.{name} must be a str, got {type(value).__name__} {value!r}")
    raw = value.encode("utf-8")
    if not value or len(raw) > _MAX_FIELD:
        raise ConfigError(f"Namespace.{name} must be 1..{_MAX_FIELD} UTF-8 bytes, got {value!r}")
    return len(raw).to_bytes(4, "little") + raw


@dataclass(frozen=True, slots=True, kw_only=True)
class Namespace:
    """Everything that makes KV bytes incompatible: blocks of two namespaces never match.

    ``parallel`` names the slice of the model this worker's KV covers, e.g.
    ``"tp0of8"`` for a tensor-parallel rank or ``"layers0-31"`` for a layer group.
    """

    model: str
    revision: str
    layout: KVLayout
    parallel: str = "tp0of1"
    tenant: str = "default"
    seed: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.layout, KVLayout):
            raise ConfigError(f"Namespace.layout must be a KVLayout, got {self.layout!r}")
        encoded = b"".join(
            _field_bytes(name, value)
            for name, value in (
                ("model", self.model),
                ("revision", self.revision),
                ("layout", self.layout.describe()),
                ("parallel", self.parallel),
                ("tenant", self.tenant),
            )
        )
        object.__setattr__(self, "seed", xxhash.xxh3_128_digest(NAMESPACE_TAG + encoded))

    @property
    def tokens_per_block(self) -> int:
        """Tokens in one block of this namespace."""
        return self.layout.tokens_per_block

    @property
    def group_blocks(self) -> int:
        """Blocks in one placement group of this namespace (:func:`placement_group_blocks`)."""
        return placement_group_blocks(self.layout)


def as_token_array(tokens: Sequence[int] | npt.NDArray[np.integer]) -> TokenArray:
    """Token ids as a contiguous little-endian uint32 array; rejects ids outside 0..2**32-1."""
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.ndim != 1:
            raise ArgumentError(f"tokens must be one-dimensional, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise ArgumentError(f"tokens must be integers, got dtype {arr.dtype}")
        if arr.dtype != np.dtype("<u4"):
            if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
                raise ArgumentError("token ids must lie in 0..2**32-1")
            arr = arr.astype("<u4")
        return np.ascontiguousarray(arr)
    if isinstance(tokens, str | bytes | bytearray | memoryview):
        # array.array would read bytes as raw machine words and a str is no token list.
        raise ArgumentError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    try:
        # array.array converts and range-checks in C, ~2x faster than numpy for lists.
        packed = array.array(_U32_CODE, tokens)
    except (TypeError, OverflowError) as exc:
        raise ArgumentError(f"tokens must be ints in 0..2**32-1: {exc}") from exc
    out = np.frombuffer(packed, dtype=np.uint32)
    return out if _NATIVE_IS_LE else out.astype("<u4")


def placement_group_blocks(layout: KVLayout) -> int:
    """Blocks in one placement group of ``layout``: the largest power of two of blocks whose
    payload fits :data:`PLACEMENT_GROUP_BYTES`, at most :data:`MAX_PLACEMENT_GROUP_BLOCKS`,
    at least 1 (64 for DeepSeek-V4.1's 112 KiB blocks, 4 for 2 MiB ones).

    A group's blocks share their 12 holders: a call for a prompt's blocks touches about a
    dozen nodes per group whatever the cluster's size (issue 21). Every prompt that shares a
    group's first block shares those holders for the whole group, where it differs too:
    conversations opening with one system prompt put their first groups on one dozen
    nodes (``bench/hot_prefix.py``)."""
    return group_blocks_for(layout.payload_bytes)


def group_blocks_for(block_bytes: int) -> int:
    """:func:`placement_group_blocks` for blocks of ``block_bytes`` payload bytes."""
    fit = max(1, PLACEMENT_GROUP_BYTES // max(1, block_bytes))
    return min(MAX_PLACEMENT_GROUP_BLOCKS, 1 << (fit.bit_length() - 1))


def full_blocks(n_tokens: int, tokens_per_block: int) -> int:
    """Number of full blocks in ``n_tokens`` tokens; a partial tail block has no key."""
    return n_tokens // tokens_per_block


def block_keys(
    namespace: Namespace,
    tokens: Sequence[int] | npt.NDArray[np.integer],
    *,
    max_blocks: int | None = None,
) -> list[BlockKey]:
    """The chained keys of every full block of ``tokens`` (at most ``max_blocks``)."""
    if not isinstance(namespace, Namespace):
        raise ArgumentError(
            f"namespace must be a kvcache Namespace, got {type(namespace).__name__}"
        )
    arr = as_token_array(tokens)
    block = namespace.tokens_per_block
    count = full_blocks(arr.size, block)
    if max_blocks is not None:
        count = min(count, max_blocks)
    raw = arr[: count * block].tobytes()
    step = block * 4
    group = namespace.group_blocks
    if count >= _NATIVE_CHAIN_MIN and native.AVAILABLE:
        # One native call for the whole chain: 2.6 ms of Python for a 4,096-block prompt.
        return cast(
            list[BlockKey],
            native.chain_keys(
                namespace.seed, BLOCK_TAG, raw, step, count, group, PLACEMENT_TAG_BYTES
            ),
        )
    parent = namespace.seed
    keys: list[BlockKey] = []
    append = keys.append
    digest = xxhash.xxh3_128_digest
    tag = PLACEMENT_TAG_BYTES
    # One C call per block (not per token); concatenating is cheaper than a streaming hasher.
    for i, start in enumerate(range(0, count * step, step)):
        own = digest(BLOCK_TAG + parent + raw[start : start + step])
        parent = own if i % group == 0 else parent[:tag] + own[tag:]
        append(BlockKey(parent))
    return keys
