"""Hybrid models (sliding-window and full attention layers) in the vLLM connector. Pure.

vLLM 0.32's hybrid KV-cache manager keeps one block table per *group* of
layers: full-attention groups hold every block of a request, sliding-window
groups only the blocks inside the window of the next token (the others are
the null block, id 0, and are freed and reused while the request runs). The
connector splits the work by group:

- the **full-attention group** goes to the block store, as for any model
  (its blocks are the store's blocks; their namespace describes only its layers);
- the **sliding-window groups** go to the SWA tier: the *state* at position
  ``P`` is those groups' blocks that hold tokens ``P - window + 1 .. P - 1``
  (:func:`~kvcache.swa_local.window_blocks`), group after group, block after
  block, every layer's page in each. It is taken once per request, in the step
  whose forward pass completes the prompt's last full block (``P`` = that
  block's end), right after the pass and before the window can move on: the
  blocks are freed and reused as decoding goes on, so the copy must come first.

A hit is offered only where it can be served exactly: the longest prefix of
whole blocks that the store holds *and* after which some worker holds the
state (:func:`state_hit`); anything else is recomputed by vLLM. vLLM checks
nothing the connector fills, so every non-null block of every group up to the
hit must be written: the full group's from the store, the sliding-window
groups' from the state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvcache.errors import ConfigError
from kvcache.keys import TokenArray
from kvcache.layout import DType, KVLayout
from kvcache.swa_local.protocol import HolderRecord
from kvcache.swa_local.state import StateKey, window_blocks

__all__ = [
    "HybridLayout",
    "SwaLoadSpec",
    "SwaSaveSpec",
    "state_hit",
    "state_position",
    "window_ids",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class HybridLayout:
    """Which KV cache groups hold what, and the bytes of a state.

    ``swa_block_bytes[i]`` is one block of sliding-window group ``swa_groups[i]``,
    every layer of the group (its pages back to back). ``swa_block_size`` is those
    groups' tokens per block (0: the main group's ``block_size``); DeepSeek V4.1 has
    32-token sliding-window blocks under 128-token main blocks. ``ring_groups`` are
    groups of one block per request (V4.1's compressor ring, ``CircularBufferSpec``)
    whose block is part of every state. ``replay_tokens`` > 0 says that vLLM runs
    bounded replay for this model (the sliding-window specs declare
    ``prefix_replay_tokens``): a hit loaded without its window is not lost, vLLM
    recomputes its last ``replay_tokens`` tokens.
    """

    block_size: int
    window: int
    main_group: int
    swa_groups: tuple[int, ...]
    swa_block_bytes: tuple[int, ...]
    swa_layers: int
    dtype: DType
    packing: str
    swa_block_size: int = 0
    ring_groups: tuple[int, ...] = ()
    ring_block_bytes: tuple[int, ...] = ()
    replay_tokens: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.window < 2:
            raise ConfigError(f"bad hybrid layout: block {self.block_size}, window {self.window}")
        if not self.swa_groups or len(self.swa_groups) != len(self.swa_block_bytes):
            raise ConfigError("a hybrid layout needs sliding-window groups and their block sizes")
        if self.main_group in self.swa_groups or self.main_group in self.ring_groups:
            raise ConfigError("the full-attention group cannot also be a sliding-window group")
        if len(self.ring_groups) != len(self.ring_block_bytes):
            raise ConfigError("each ring group needs its block size")
        swa_block = self.swa_tokens_per_block
        if swa_block < 1 or self.block_size % swa_block:
            raise ConfigError(
                f"sliding-window blocks of {swa_block} tokens do not divide main blocks of "
                f"{self.block_size}"
            )

    @property
    def swa_tokens_per_block(self) -> int:
        """Tokens per sliding-window block."""
        return self.swa_block_size or self.block_size

    @property
    def state_groups(self) -> tuple[int, ...]:
        """The groups a state fills: the sliding-window groups, then the ring groups."""
        return (*self.swa_groups, *self.ring_groups)

    def window_blocks(self, position: int) -> tuple[int, int]:
        """Sliding-window blocks ``[first, end)`` of the state at ``position``."""
        return window_blocks(position, window=self.window, block_size=self.swa_tokens_per_block)

    def state_bytes(self, position: int) -> int:
        """Bytes of the state at ``position``."""
        first, end = self.window_blocks(position)
        return (end - first) * sum(self.swa_block_bytes) + sum(self.ring_block_bytes)

    def state_layout(self) -> KVLayout:
        """The layout of a state's sliding-window blocks (part of the state namespace; the
        ring's bytes are named in the packing)."""
        total = sum(self.swa_block_bytes)
        block = self.swa_tokens_per_block
        if total % block:
            raise ConfigError(
                f"sliding-window blocks of {total} bytes do not split into {block} tokens"
            )
        return KVLayout(
            tokens_per_block=block,
            bytes_per_token=total // block,
            dtype=self.dtype,
            layers_in_block=self.swa_layers,
        )


def state_position(prompt_tokens: int, block_size: int) -> int:
    """Where a request's state is taken: the end of its prompt's last full block (0: none)."""
    return (prompt_tokens // block_size) * block_size


def state_hit(
    *,
    hit_blocks: int,
    loadable: int,
    local_tokens: int,
    block_size: int,
    positions: Iterable[int],
) -> int:
    """Blocks a hybrid request may take from the store: the most, up to the store's hit and
    what is loadable, at whose end some worker holds a state (``positions``), beyond what
    vLLM already has locally; 0 when there is no such point."""
    limit = min(hit_blocks, loadable)
    local_blocks = -(-local_tokens // block_size)
    best = 0
    for position in positions:
        if position % block_size:
            continue
        blocks = position // block_size
        if local_blocks < blocks <= limit:
            best = max(best, blocks)
    return best


@dataclass(frozen=True, slots=True)
class SwaLoadSpec:
    """Fill the sliding-window groups of a hit from the state ``key``.

    ``block_ids[g]`` are group ``g``'s vLLM blocks ``first_block .. first_block + n - 1``
    (the state's rows); rows before ``write_from`` are blocks vLLM already holds
    (a local prefix hit) and are not written. A load planned without a state
    (``key`` None) fails, and vLLM recomputes the request.
    """

    key: StateKey | None
    holders: tuple[HolderRecord, ...]
    first_block: int
    write_from: int
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class SwaSaveSpec:
    """Take the state at ``position`` of request ``req_id`` from its sliding-window groups'
    blocks ``block_ids[g]`` (blocks ``first_block ..``); ``tokens`` are the prompt's first
    ``position`` tokens (the key of their last block names the state)."""

    req_id: str
    tokens: TokenArray
    position: int
    first_block: int
    block_ids: tuple[tuple[int, ...], ...]


def window_ids(
    groups: Sequence[Sequence[int]], first: int, end: int, *, rings: int = 0
) -> tuple[tuple[int, ...], ...] | None:
    """Each group's block ids ``first .. end - 1``, or None when a group does not have them
    all (too few tracked, or a null block among them: the window was already freed).

    The last ``rings`` groups are ring groups: their one block (index 0) is taken whole.
    """
    out = []
    split = len(groups) - rings
    for ids in groups[split:] if rings else ():
        if len(ids) < 1 or ids[0] == 0:
            return None
    for ids in groups[:split]:
        if len(ids) < end:
            return None
        window = tuple(ids[first:end])
        if any(b == 0 for b in window):
            return None
        out.append(window)
    for ids in groups[split:] if rings else ():
        out.append((ids[0],))
    return tuple(out)
