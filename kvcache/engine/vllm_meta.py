"""The vLLM connector's shared vocabulary: the geometry and namespace of a stored block,
the worker's page mapping, and every planning name in one place.

The concepts live in their own modules, re-exported here so that ``vllm_meta`` stays the
one import of the connector's pure parts:

- settings (:class:`ConnectorSettings`, :class:`LoadMode`, :func:`split_extra_config`):
  :mod:`kvcache.engine.settings`, shared with the SGLang backend;
- the scheduler half's plan (:class:`SchedulerBook`, span specs, :class:`StepPlan`):
  :mod:`kvcache.engine.vllm_plan`;
- fetch or recompute and lookups in flight (:class:`FetchPlanner`,
  :class:`PendingMatches`): :mod:`kvcache.engine.vllm_fetch`;
- counters (:class:`ConnectorStats`): :mod:`kvcache.engine.stats`.

Defined here: :class:`KVGeometry` and :func:`make_namespace` (the key namespace covers
the model, its revision, the KV geometry and packing, and the parallel rank, so
incompatible KV never shares keys), :func:`page_ids` and :func:`failed_block_ids`
(a load that brings back fewer blocks than planned reports every block from the first
missing one as failed; vLLM then recomputes them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.engine.settings import (
    ConnectorSettings,
    LoadMode,
    engine_namespace,
    namespace_dict,
    namespace_from_dict,
    parallel_name,
    split_extra_config,
)
from kvcache.engine.stats import ConnectorStats
from kvcache.engine.vllm_fetch import MIN_PREFILL_STEP_TOKENS, FetchPlanner, PendingMatches
from kvcache.engine.vllm_plan import (
    CachedReq,
    LoadSpec,
    NewReq,
    SaveSpec,
    SchedulerBook,
    StepPlan,
    external_tokens,
    loadable_blocks,
)
from kvcache.errors import ConfigError
from kvcache.keys import Namespace
from kvcache.layout import DType, KVLayout

__all__ = [
    "CachedReq",
    "ConnectorSettings",
    "ConnectorStats",
    "FetchPlanner",
    "LoadMode",
    "KVGeometry",
    "LoadSpec",
    "MIN_PREFILL_STEP_TOKENS",
    "NewReq",
    "PendingMatches",
    "SaveSpec",
    "SchedulerBook",
    "StepPlan",
    "external_tokens",
    "failed_block_ids",
    "loadable_blocks",
    "make_namespace",
    "namespace_dict",
    "namespace_from_dict",
    "page_ids",
    "parallel_name",
    "split_extra_config",
]


# ---------------------------------------------------------------------- namespace


@dataclass(frozen=True, slots=True, kw_only=True)
class KVGeometry:
    """The bytes of one vLLM block, as vLLM's KV cache spec describes them.

    ``page_bytes`` is one layer's share of a block; ``packing`` names how the
    attention backend lays K and V out inside it (layout name, heads, head
    sizes, quantisation), which the bytes alone do not tell.
    """

    block_size: int
    num_layers: int
    page_bytes: int
    dtype: DType
    packing: str
    #: A group whose pages differ in size (DeepSeek V4.1's MLA group, block-outermost):
    #: the bytes of its contiguous span per block, which replace ``num_layers x page_bytes``.
    span_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "page_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"KVGeometry.{name} must be a positive int, got {value!r}")
        if self.span_bytes is not None and self.span_bytes < 1:
            raise ConfigError(f"KVGeometry.span_bytes must be positive, got {self.span_bytes}")
        if self.payload_bytes % self.block_size:
            raise ConfigError(
                f"a block of {self.payload_bytes} bytes does not split into {self.block_size} "
                "equal tokens; this KV cache (padded pages?) is not supported by the kvcache "
                "connector"
            )

    @property
    def payload_bytes(self) -> int:
        """Bytes of one stored block: every layer's page (or the group's span)."""
        if self.span_bytes is not None:
            return self.span_bytes
        return self.num_layers * self.page_bytes

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token, every layer."""
        return self.payload_bytes // self.block_size

    def kv_layout(self) -> KVLayout:
        """The kvcache layout of one block (part of the key namespace)."""
        return KVLayout(
            tokens_per_block=self.block_size,
            bytes_per_token=self.payload_bytes // self.block_size,
            dtype=self.dtype,
            layers_in_block=self.num_layers,
        )


def make_namespace(
    *,
    model: str,
    revision: str | None,
    geometry: KVGeometry,
    parallel: str,
    tenant: str = "default",
) -> Namespace:
    """The key namespace of one vLLM worker's KV.

    The backend's packing goes into ``revision`` next to the model revision
    (``docs/spec/hashing.md``: anything that changes the KV bytes must be in a
    namespace field), the byte geometry into ``layout``.
    """
    return engine_namespace(
        engine="vllm",
        model=model,
        revision=revision,
        layout=geometry.kv_layout(),
        packing=geometry.packing,
        parallel=parallel,
        tenant=tenant,
    )


# ---------------------------------------------------------------------- worker side


def page_ids(block_ids: Sequence[int], pages_per_block: int) -> npt.NDArray[np.int64]:
    """The engine pages of each vLLM block, shape (blocks, pages_per_block).

    A backend whose kernel pages are smaller than vLLM's block (``pages_per_block``
    > 1) keeps block ``b`` in pages ``b*p .. b*p+p-1``.
    """
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1, 1)
    out: npt.NDArray[np.int64] = ids * pages_per_block + np.arange(pages_per_block)
    return out


def failed_block_ids(spec: LoadSpec, loaded: int) -> tuple[int, ...]:
    """vLLM blocks to report as failed when only ``loaded`` leading blocks of ``spec`` arrived.

    Everything from the first block that did not arrive is reported, including
    blocks after it that might have loaded: a prefix is only usable whole.
    """
    if not 0 <= loaded <= len(spec.block_ids):
        raise ValueError(f"loaded={loaded} outside 0..{len(spec.block_ids)}")
    return spec.block_ids[loaded:]
