"""Where one vLLM block of a KV cache group lies in the engine's memory. Pure.

vLLM 0.32 describes its KV cache allocation with ``KVCacheTensor`` records:
layer ``layers[l]``'s page of block ``b`` starts ``offset + l * layer_stride +
b * block_stride`` bytes into one backing allocation that every group shares
(``vllm/v1/kv_cache_interface.py``). Two layouts come out of it:

- *layer-outermost* (the default for uniform models): each layer owns a
  contiguous region, ``block_stride`` is its page; the connector then reads
  each layer's page (:class:`~kvcache.engine.PagedKVAdapter` over per-layer tensors);
- *block-outermost* (BLHNC, the only one DeepSeek V4.1's indexer backend allows):
  every block packs all layers' pages of a group side by side, groups overlay
  each other from byte 0, and one ``block_stride`` (the largest group's block)
  separates blocks. A group's block is then one contiguous byte range
  ``[start, end)`` at ``block_id * block_stride``: its :class:`GroupSpan`.

Pages of one group may differ in size (V4.1's MLA group: three 18,432-byte
compressed-KV pages, three 4,608-byte indexer pages, a 36,864 and an 8,704),
which is why the geometry comes from these records and not from
``page_size_bytes x layers``: the scheduler half sees the group's spec
flattened to its first layer's (``generate_scheduler_kv_cache_config``), the
worker half the real one, and both see the same ``KVCacheTensor`` list.

vLLM objects are read by attribute (no vLLM import), so this is tested with
plain stand-ins as well as with vLLM's own records.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvcache.errors import ConfigError

__all__ = ["GroupSpan", "LayerPlace", "group_span", "is_block_outermost", "layer_places"]


@dataclass(frozen=True, slots=True)
class LayerPlace:
    """Where one layer's page of block 0 starts in the backing allocation, and its size."""

    name: str
    offset: int
    page_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupSpan:
    """One group's block: bytes ``[start, end)`` of block 0, repeated every ``block_stride``.

    ``pages`` are its layers' page sizes in byte order (part of the key namespace:
    they tell record formats apart that have the same total).
    """

    start: int
    end: int
    block_stride: int
    pages: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end or self.end - self.start > self.block_stride:
            raise ConfigError(
                f"a group span [{self.start}, {self.end}) does not fit a block stride of "
                f"{self.block_stride} bytes"
            )

    @property
    def nbytes(self) -> int:
        """Bytes of one block of the group (the stored payload)."""
        return self.end - self.start

    def describe(self) -> str:
        """The page sizes, run-length coded: ``18432x3+4608x3+36864+8704``."""
        parts: list[str] = []
        run: list[int] = []
        for page in (*self.pages, -1):
            if run and page != run[0]:
                parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}x{len(run)}")
                run = []
            run.append(page)
        return "+".join(parts)


def is_block_outermost(tensors: Sequence[Any]) -> bool:
    """Whether vLLM packed every block's layers side by side (BLHNC-like layouts)."""
    if not tensors:
        return False
    return all(
        int(t.layer_stride) * len(t.layers) <= int(t.block_stride) and len(t.layers) >= 1
        for t in tensors
    ) and any(int(t.block_stride) > int(t.layer_stride) for t in tensors)


def layer_places(tensors: Iterable[Any]) -> dict[str, LayerPlace]:
    """Every layer's place in a block-outermost allocation (its page is ``layer_stride``)."""
    out: dict[str, LayerPlace] = {}
    for t in tensors:
        stride = int(t.layer_stride)
        for i, name in enumerate(t.layers):
            out[name] = LayerPlace(name, int(t.offset) + i * stride, stride)
    return out


def group_span(tensors: Sequence[Any], layer_names: Sequence[str]) -> GroupSpan:
    """The contiguous span of ``layer_names``' pages in each block (block-outermost only).

    Refused when the group's pages do not tile one contiguous range (a gap or an
    overlap between them), or when its layers are not all described.
    """
    places = layer_places(tensors)
    missing = [name for name in layer_names if name not in places]
    if missing:
        raise ConfigError(f"no KVCacheTensor places layers {missing}")
    strides = {int(t.block_stride) for t in tensors if set(t.layers) & set(layer_names)}
    if len(strides) != 1:
        raise ConfigError(f"a group's layers with different block strides {sorted(strides)}")
    ordered = sorted((places[name] for name in layer_names), key=lambda p: p.offset)
    cursor = ordered[0].offset
    for place in ordered:
        if place.offset != cursor:
            raise ConfigError(
                f"layer {place.name} starts at byte {place.offset} of its block, not {cursor}: "
                "the group's pages are not one contiguous span"
            )
        cursor += place.page_bytes
    return GroupSpan(
        start=ordered[0].offset,
        end=cursor,
        block_stride=strides.pop(),
        pages=tuple(p.page_bytes for p in ordered),
    )
