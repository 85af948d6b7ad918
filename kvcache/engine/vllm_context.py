"""What both halves of the vLLM connector derive from vLLM's configuration, identically.

The scheduler half and the worker half run in different processes and share
nothing but the per-step metadata. Each builds a :class:`ConnectorContext`
from the same ``VllmConfig`` and ``KVCacheConfig``: the settings, which KV
cache group goes where (:func:`group_roles`), the byte geometry of the
full-attention group's blocks, the hybrid layout of the sliding-window groups,
and the key namespaces, so the two agree on every key without talking.

vLLM objects are read by attribute here (no vLLM import), so the translation
is tested with plain stand-ins.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

from kvcache.client import Client, ClientConfig
from kvcache.engine.block_span import GroupSpan, group_span, is_block_outermost
from kvcache.engine.hybrid import HybridLayout
from kvcache.engine.paged import kv_dtype
from kvcache.engine.settings import (
    SwaMode,
    load_swa_config,
    namespace_dict,
    state_namespace,
)
from kvcache.engine.stats import StatsFile
from kvcache.engine.vllm_meta import (
    ConnectorSettings,
    ConnectorStats,
    KVGeometry,
    make_namespace,
    parallel_name,
    split_extra_config,
)
from kvcache.errors import ConfigError
from kvcache.keys import Namespace
from kvcache.swa_local.config import SwaConfig
from kvcache.swa_local.state import state_namespace_id

__all__ = [
    "ConnectorContext",
    "GroupRoles",
    "group_roles",
    "group_spans",
    "kv_geometry",
    "layer_specs",
]

_FULL = ("FullAttentionSpec",)
_SLIDING = ("SlidingWindowSpec",)
_RING = ("CircularBufferSpec",)


@dataclass(frozen=True, slots=True)
class GroupRoles:
    """Index of the full-attention group, of each sliding-window group (and their window),
    of each ring group (one block per request: DeepSeek V4.1's compressor ring), and the
    tokens vLLM replays after a hit loaded without its window (0: no bounded replay)."""

    main: int
    swa: tuple[int, ...] = ()
    window: int = 0
    ring: tuple[int, ...] = ()
    replay_tokens: int = 0


def layer_specs(spec: Any) -> list[Any]:
    """The per-layer specs of a group's spec: those of a ``UniformTypeKVCacheSpecs``
    (the worker half's view of a mixed-page group), else the spec itself."""
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, dict) and inner else [spec]


def first_spec(spec: Any) -> Any:
    """The group's first layer spec: what the scheduler half sees of it (vLLM's
    ``generate_scheduler_kv_cache_config`` flattens ``UniformTypeKVCacheSpecs`` to it)."""
    return layer_specs(spec)[0]


def is_mla(spec: Any) -> bool:
    """Whether every layer of a group is MLA (one latent KV, identical on every TP rank)."""
    return all(
        any(c.__name__ == "MLAAttentionSpec" for c in type(layer).__mro__)
        for layer in layer_specs(spec)
    )


def _kind(spec: Any) -> str:
    """``full``, ``sliding`` or ``ring`` for the specs the connector knows, else the name."""
    kinds = set()
    for layer in layer_specs(spec):
        kind = type(layer).__name__
        for cls in type(layer).__mro__:
            if cls.__name__ in _SLIDING:
                kind = "sliding"
                break
            if cls.__name__ in _FULL:
                kind = "full"
                break
            if cls.__name__ in _RING:
                kind = "ring"
                break
        kinds.add(kind)
    return kinds.pop() if len(kinds) == 1 else type(spec).__name__


def group_roles(kv_cache_config: Any) -> GroupRoles:
    """Which vLLM KV cache group is the block store's and which are the SWA tier's.

    Supported: one full-attention group (any model vLLM runs with uniform
    attention, or with its hybrid manager off; MLA groups with pages of several
    sizes count as one), optionally with sliding-window groups of one window (a
    hybrid model), and with ring groups only beside sliding-window groups
    (DeepSeek V4.1: 4-7 ``SlidingWindowMLASpec`` groups, the MLA group and one
    ``CircularBufferSpec`` group). Anything else is refused by name.
    """
    groups = kv_cache_config.kv_cache_groups
    kinds = [_kind(g.kv_cache_spec) for g in groups]
    full = [i for i, k in enumerate(kinds) if k == "full"]
    sliding = [i for i, k in enumerate(kinds) if k == "sliding"]
    ring = [i for i, k in enumerate(kinds) if k == "ring"]
    other = [k for k in kinds if k not in ("full", "sliding", "ring")]
    if other or len(full) != 1 or (ring and not sliding):
        raise ConfigError(
            "the kvcache connector supports one full-attention KV cache group, optionally with "
            f"sliding-window groups (and ring groups beside them); this model has {kinds}"
        )
    specs = [first_spec(groups[i].kv_cache_spec) for i in sliding]
    windows = {int(s.sliding_window) for s in specs}
    if len(windows) > 1:
        raise ConfigError(f"sliding-window groups with different windows {sorted(windows)}")
    replays = {int(getattr(groups[i].kv_cache_spec, "prefix_replay_tokens", 0)) for i in sliding}
    if len(replays) > 1:
        raise ConfigError(f"sliding-window groups with different replay windows {sorted(replays)}")
    return GroupRoles(
        full[0],
        tuple(sliding),
        windows.pop() if windows else 0,
        tuple(ring),
        replays.pop() if replays else 0,
    )


def group_spans(kv_cache_config: Any) -> dict[int, GroupSpan]:
    """Each group's span per block when vLLM packed blocks outermost (BLHNC), else {}."""
    tensors = list(getattr(kv_cache_config, "kv_cache_tensors", None) or ())
    if not is_block_outermost(tensors):
        return {}
    return {
        i: group_span(tensors, list(g.layer_names))
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    }


def _packing(spec: Any, layout: str | None, span: GroupSpan | None = None) -> str:
    """The record format of a group, for the namespace: spec class, layout, heads, head
    sizes, quantisation; for a packed (block-outermost) group also its first layer's cache
    dtype (``nvfp4_ds_mla``, ``fp8_ds_mla``...) and its pages in byte order, which tell
    the indexer's fp8 and MXFP4 records (and 528- from 584-byte SWA records) apart."""
    spec = first_spec(spec)
    quant = getattr(spec, "kv_quant_mode", None)
    head_size = getattr(spec, "head_size", "?")
    parts = [
        type(spec).__name__,
        f"layout={layout or 'default'}",
        f"heads={getattr(spec, 'num_heads', getattr(spec, 'num_kv_heads', '?'))}",
        f"k={head_size}",
        f"v={getattr(spec, 'head_size_v', head_size)}",
        f"quant={getattr(quant, 'name', quant)}",
    ]
    if span is not None:
        parts += [f"rec={getattr(spec, 'cache_dtype_str', None)}", f"pages={span.describe()}"]
    return ",".join(parts)


def _layout(vllm_config: Any, kv_cache_config: Any) -> str | None:
    return kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout  # type: ignore[no-any-return]


def kv_geometry(vllm_config: Any, kv_cache_config: Any, group: int = 0) -> KVGeometry:
    """The byte geometry and packing of one block of KV cache group ``group``.

    Both halves compute it from the same ``KVCacheConfig``, so they agree on
    the key namespace without talking; the worker half then checks it against
    the tensors it is given.
    """
    g = kv_cache_config.kv_cache_groups[group]
    spec = first_spec(g.kv_cache_spec)
    span = group_spans(kv_cache_config).get(group)
    return KVGeometry(
        block_size=int(spec.block_size),
        num_layers=len(g.layer_names),
        page_bytes=int(spec.page_size_bytes),
        dtype=kv_dtype(spec.dtype),
        packing=_packing(spec, _layout(vllm_config, kv_cache_config), span),
        span_bytes=None if span is None else span.nbytes,
    )


def hybrid_layout(vllm_config: Any, kv_cache_config: Any, roles: GroupRoles) -> HybridLayout:
    """The sliding-window groups' part of a hybrid model's KV cache."""
    groups = kv_cache_config.kv_cache_groups
    main_block = int(first_spec(groups[roles.main].kv_cache_spec).block_size)
    specs = [first_spec(groups[i].kv_cache_spec) for i in roles.swa]
    swa_blocks = {int(s.block_size) for s in specs}
    if len(swa_blocks) != 1 or main_block % next(iter(swa_blocks)):
        raise ConfigError(
            f"sliding-window groups of blocks {sorted(swa_blocks)} under full-attention blocks "
            f"of {main_block}: they must share one size that divides the full group's"
        )
    spans = group_spans(kv_cache_config)

    def block_bytes(i: int) -> int:
        if i in spans:
            return spans[i].nbytes
        return int(first_spec(groups[i].kv_cache_spec).page_size_bytes) * len(groups[i].layer_names)

    packing = _packing(specs[0], _layout(vllm_config, kv_cache_config), spans.get(roles.swa[0]))
    if roles.ring:
        packing += ",ring=" + "+".join(str(block_bytes(i)) for i in roles.ring)
    return HybridLayout(
        block_size=main_block,
        window=roles.window,
        main_group=roles.main,
        swa_groups=roles.swa,
        swa_block_bytes=tuple(block_bytes(i) for i in roles.swa),
        swa_layers=sum(len(groups[i].layer_names) for i in roles.swa),
        dtype=kv_dtype(specs[0].dtype),
        packing=packing,
        swa_block_size=swa_blocks.pop(),
        ring_groups=roles.ring,
        ring_block_bytes=tuple(block_bytes(i) for i in roles.ring),
        replay_tokens=roles.replay_tokens,
    )


def replica_ranks(ranks: dict[str, int], replicas: int) -> tuple[dict[str, int], bool]:
    """The ranks that name the stored KV, and whether this rank writes it.

    vLLM's ``kv_tp_replicas`` counts consecutive TP ranks that hold identical KV for
    every layer (MLA: all of them). Such a group stores its KV once: the namespace
    names the group (``tp{rank // replicas}of{size // replicas}``), its first rank
    writes, and every rank loads the same blocks.
    """
    size = ranks.get("tp_size", 1)
    if replicas <= 1 or size % replicas:
        return ranks, True
    rank = ranks.get("tp_rank", 0)
    out = dict(ranks)
    out["tp_rank"], out["tp_size"] = rank // replicas, size // replicas
    return out, rank % replicas == 0


@dataclass
class ConnectorContext:
    """Settings, geometry, namespaces, stats: what both halves share (module docstring)."""

    settings: ConnectorSettings
    client_overrides: dict[str, Any]
    swa_overrides: dict[str, Any]
    roles: GroupRoles
    geometry: KVGeometry
    hybrid: HybridLayout | None
    namespace: Namespace
    state_namespace: Namespace | None
    load: bool
    save: bool
    stats: ConnectorStats
    stats_file: StatsFile
    #: Each group's span per block when vLLM packed blocks outermost (BLHNC), else empty.
    spans: dict[int, GroupSpan] = field(default_factory=dict)
    #: Whether this rank writes the store's blocks: under tensor parallelism a group of
    #: ``kv_tp_replicas`` ranks holds identical KV (MLA), which the first of them writes.
    writes_blocks: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def build(
        cls,
        vllm_config: Any,
        kv_cache_config: Any,
        *,
        role: str,
        ranks: dict[str, int],
    ) -> ConnectorContext:
        """Everything one half needs, from vLLM's configuration (``role``: scheduler|worker)."""
        xfer = vllm_config.kv_transfer_config
        settings, overrides, swa_overrides = split_extra_config(xfer.kv_connector_extra_config)
        roles = group_roles(kv_cache_config)
        hybrid = None
        if roles.swa:
            if settings.swa is SwaMode.OFF:
                raise ConfigError(
                    "swa = 'off' but this model has sliding-window layers: the connector cannot "
                    "fill them without the SWA tier. Use swa = 'auto', or turn vLLM's hybrid "
                    "KV cache manager off (--disable-hybrid-kv-cache-manager)"
                )
            hybrid = hybrid_layout(vllm_config, kv_cache_config, roles)
        elif settings.swa is SwaMode.ON:
            raise ConfigError("swa = 'on' but this model has no sliding-window KV cache group")
        geometry = kv_geometry(vllm_config, kv_cache_config, roles.main)
        model = vllm_config.model_config
        replicas = int(getattr(kv_cache_config, "kv_tp_replicas", 1) or 1)
        if is_mla(kv_cache_config.kv_cache_groups[roles.main].kv_cache_spec):
            replicas = ranks.get("tp_size", 1)  # MLA's latent KV is the same on every TP rank
        stored_ranks, writes = replica_ranks(ranks, replicas)
        namespace = make_namespace(
            model=settings.model_name or str(model.model),
            revision=settings.model_revision or model.revision,
            geometry=geometry,
            parallel=parallel_name(**stored_ranks),
            tenant=settings.tenant,
        )
        state_ns = None
        if hybrid is not None:
            state_ns = state_namespace(
                namespace,
                window=hybrid.window,
                layout=hybrid.state_layout(),
                packing=hybrid.packing,
            )
        stats = ConnectorStats(role=role, pid=os.getpid(), namespace=namespace_dict(namespace))
        stats.load_gbps_estimate = settings.load_gbps
        stats.prefill_tokens_per_s_estimate = settings.prefill_tokens_per_s
        return cls(
            settings=settings,
            client_overrides=overrides,
            swa_overrides=swa_overrides,
            roles=roles,
            geometry=geometry,
            hybrid=hybrid,
            namespace=namespace,
            state_namespace=state_ns,
            load=bool(xfer.is_kv_consumer),
            save=bool(xfer.is_kv_producer),
            stats=stats,
            stats_file=StatsFile(settings.stats_dir, role, stats.pid),
            spans=group_spans(kv_cache_config),
            writes_blocks=writes,
        )

    @property
    def block_size(self) -> int:
        """Tokens per vLLM block (and per kvcache block)."""
        return self.geometry.block_size

    @property
    def state_ns_id(self) -> bytes:
        """The 8-byte id of the state namespace (hybrid models only)."""
        if self.state_namespace is None:
            raise ConfigError("this model keeps no sliding-window state")
        return state_namespace_id(self.state_namespace)

    def make_client(self) -> Client:
        """A kvcache client from the settings."""
        return Client(
            ClientConfig.load(self.settings.client_config, overrides=self.client_overrides)
        )

    def swa_config(self) -> SwaConfig:
        """The SWA tier's configuration."""
        return load_swa_config(self.settings, self.swa_overrides)

    def write_stats(self, *, force: bool = False) -> None:
        """Write the counters (when they changed)."""
        with self.lock:
            snapshot = self.stats.to_dict()
        self.stats_file.write(snapshot, force=force)
