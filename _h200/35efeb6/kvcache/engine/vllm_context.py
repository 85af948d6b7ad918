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

__all__ = ["ConnectorContext", "GroupRoles", "group_roles", "kv_geometry"]

_FULL = ("FullAttentionSpec",)
_SLIDING = ("SlidingWindowSpec",)


@dataclass(frozen=True, slots=True)
class GroupRoles:
    """Index of the full-attention group, and of each sliding-window group (and its window)."""

    main: int
    swa: tuple[int, ...] = ()
    window: int = 0


def _kind(spec: Any) -> str:
    """``full`` or ``sliding`` for the attention specs the connector knows, else the name."""
    for cls in type(spec).__mro__:
        if cls.__name__ in _SLIDING:
            return "sliding"
        if cls.__name__ in _FULL:
            return "full"
    return type(spec).__name__


def group_roles(kv_cache_config: Any) -> GroupRoles:
    """Which vLLM KV cache group is the block store's and which are the SWA tier's.

    Supported: one full-attention group (any model vLLM runs with uniform
    attention, or with its hybrid manager off), optionally with sliding-window
    groups of one window (a hybrid model). Anything else is refused by name.
    """
    groups = kv_cache_config.kv_cache_groups
    kinds = [_kind(g.kv_cache_spec) for g in groups]
    full = [i for i, k in enumerate(kinds) if k == "full"]
    sliding = [i for i, k in enumerate(kinds) if k == "sliding"]
    other = [k for k in kinds if k not in ("full", "sliding")]
    if other or len(full) != 1:
        raise ConfigError(
            "the kvcache connector supports one full-attention KV cache group, optionally with "
            f"sliding-window groups; this model has {kinds}"
        )
    windows = {int(groups[i].kv_cache_spec.sliding_window) for i in sliding}
    if len(windows) > 1:
        raise ConfigError(f"sliding-window groups with different windows {sorted(windows)}")
    return GroupRoles(full[0], tuple(sliding), windows.pop() if windows else 0)


def _packing(spec: Any, layout: str | None) -> str:
    quant = getattr(spec, "kv_quant_mode", None)
    head_size = getattr(spec, "head_size", "?")
    return ",".join(
        [
            type(spec).__name__,
            f"layout={layout or 'default'}",
            f"heads={getattr(spec, 'num_heads', getattr(spec, 'num_kv_heads', '?'))}",
            f"k={head_size}",
            f"v={getattr(spec, 'head_size_v', head_size)}",
            f"quant={getattr(quant, 'name', quant)}",
        ]
    )


def _layout(vllm_config: Any, kv_cache_config: Any) -> str | None:
    return kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout  # type: ignore[no-any-return]


def kv_geometry(vllm_config: Any, kv_cache_config: Any, group: int = 0) -> KVGeometry:
    """The byte geometry and packing of one block of KV cache group ``group``.

    Both halves compute it from the same ``KVCacheConfig``, so they agree on
    the key namespace without talking; the worker half then checks it against
    the tensors it is given.
    """
    g = kv_cache_config.kv_cache_groups[group]
    spec = g.kv_cache_spec
    return KVGeometry(
        block_size=int(spec.block_size),
        num_layers=len(g.layer_names),
        page_bytes=int(spec.page_size_bytes),
        dtype=kv_dtype(spec.dtype),
        packing=_packing(spec, _layout(vllm_config, kv_cache_config)),
    )


def hybrid_layout(vllm_config: Any, kv_cache_config: Any, roles: GroupRoles) -> HybridLayout:
    """The sliding-window groups' part of a hybrid model's KV cache."""
    groups = kv_cache_config.kv_cache_groups
    main_block = int(groups[roles.main].kv_cache_spec.block_size)
    specs = [groups[i].kv_cache_spec for i in roles.swa]
    if any(int(s.block_size) != main_block for s in specs):
        raise ConfigError("sliding-window groups with another block size than the full group's")
    return HybridLayout(
        block_size=main_block,
        window=roles.window,
        main_group=roles.main,
        swa_groups=roles.swa,
        swa_block_bytes=tuple(
            int(groups[i].kv_cache_spec.page_size_bytes) * len(groups[i].layer_names)
            for i in roles.swa
        ),
        swa_layers=sum(len(groups[i].layer_names) for i in roles.swa),
        dtype=kv_dtype(specs[0].dtype),
        packing=_packing(specs[0], _layout(vllm_config, kv_cache_config)),
    )


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
        namespace = make_namespace(
            model=settings.model_name or str(model.model),
            revision=settings.model_revision or model.revision,
            geometry=geometry,
            parallel=parallel_name(**ranks),
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
