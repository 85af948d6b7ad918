"""What every engine adapter shares: its settings from the engine's extra config, and the
key namespace of its KV. Pure; used by the vLLM connector and the SGLang backend alike.

An engine hands kvcache one flat JSON object of settings (vLLM's
``kv_connector_extra_config``, SGLang's ``--hicache-storage-backend-extra-config``).
:func:`split_engine_config` cuts it into

- the adapter's own settings (a frozen dataclass deriving from :class:`EngineSettings`),
- :class:`~kvcache.client.ClientConfig` overrides (``cluster_file``, ``traffic_class``...),
- :class:`~kvcache.swa_local.SwaConfig` overrides, written ``swa_<field>``
  (``swa_max_bytes``, ``swa_ttl_s``, ``swa_listen``...),

and rejects any other key, naming the known ones, so a typo fails at start-up
instead of being ignored. Keys the engine itself reads from the same object
are passed over (``ignored``).

Namespaces: :func:`engine_namespace` puts the engine and the KV packing next
to the model revision (``docs/spec/hashing.md``: anything that changes the KV
bytes must be in a namespace field) and the byte geometry into the layout;
:func:`state_namespace` names the sliding-window state of the same worker.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvcache.client.config import ClientConfig
from kvcache.config import build_config
from kvcache.errors import ConfigError
from kvcache.keys import Namespace
from kvcache.layout import DType, KVLayout
from kvcache.swa_local.config import SwaConfig

__all__ = [
    "ConnectorSettings",
    "EngineSettings",
    "LoadMode",
    "SwaMode",
    "engine_namespace",
    "load_swa_config",
    "namespace_dict",
    "namespace_from_dict",
    "parallel_name",
    "split_engine_config",
    "split_extra_config",
    "state_namespace",
]

#: The longest a prefix lookup may take (a wait past what a thread's timeout can hold used
#: to pass start-up and kill the engine at its first request).
_MAX_MATCH_DEADLINE_MS = 3_600_000.0

_CLIENT_FIELDS = frozenset(ClientConfig.__dataclass_fields__)
_SWA_FIELDS = frozenset(f.name for f in dataclasses.fields(SwaConfig))

S = TypeVar("S", bound="EngineSettings")


class SwaMode(enum.Enum):
    """Whether to keep sliding-window state in the SWA tier."""

    #: When the model has sliding-window layers (a hybrid KV cache).
    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    """Settings every engine adapter takes.

    ``client_config`` names a TOML file for :class:`~kvcache.client.ClientConfig`;
    ClientConfig fields given directly override it. ``model_name`` and
    ``model_revision`` replace the engine's model path and revision in the key
    namespace (a path says little about the weights behind it). ``stats_dir``
    receives one JSON file of counters per process. ``swa`` turns the SWA tier
    on or off (``auto``: on for models with sliding-window layers);
    ``swa_config`` names a TOML file for :class:`~kvcache.swa_local.SwaConfig`,
    which ``swa_<field>`` keys override.
    """

    client_config: Path | None = None
    model_name: str | None = None
    model_revision: str | None = None
    tenant: str = "default"
    stats_dir: Path | None = None
    swa: SwaMode = SwaMode.AUTO
    swa_config: Path | None = None

    def __post_init__(self) -> None:
        for name in ("model_name", "model_revision"):
            value = getattr(self, name)
            if value is not None and not value:
                raise ConfigError(f"{name} must not be empty when given")


def split_engine_config(
    extra: Mapping[str, Any],
    cls: type[S],
    *,
    source: str,
    ignored: frozenset[str] = frozenset(),
    needs_cluster: bool = True,
) -> tuple[S, dict[str, Any], dict[str, Any]]:
    """(settings, ClientConfig overrides, SwaConfig overrides) from an engine's extra config.

    An empty ``model_name`` or ``model_revision`` means "the engine's own".
    """
    own_fields = {f.name for f in dataclasses.fields(cls)}
    own: dict[str, Any] = {}
    client: dict[str, Any] = {}
    swa: dict[str, Any] = {}
    for key, value in extra.items():
        name = key.replace("-", "_")
        if name in ignored:
            continue
        if name in own_fields:
            if name in ("model_name", "model_revision") and value == "":
                continue
            own[name] = value
            if name == "tenant":  # the namespace's tenant is the one the client authenticates as
                client[name] = value
        elif name in _CLIENT_FIELDS:
            client[name] = value
        elif name.startswith("swa_") and name[4:] in _SWA_FIELDS:
            swa[name[4:]] = value
        else:
            known = ", ".join(
                sorted(own_fields | _CLIENT_FIELDS | {f"swa_{f}" for f in _SWA_FIELDS})
            )
            raise ConfigError(f"{source}: unknown key {key!r} for kvcache; known: {known}")
    settings = build_config(cls, own, source=source)
    if needs_cluster and settings.client_config is None and "cluster_file" not in client:
        raise ConfigError(
            f"{source} needs 'cluster_file' (the cluster map written by `kvcache up`) or "
            "'client_config' (a client TOML file naming one)"
        )
    return settings, client, swa


def load_swa_config(settings: EngineSettings, overrides: Mapping[str, Any]) -> SwaConfig:
    """The SWA tier's configuration: the settings' ``swa_config`` file, then ``swa_*`` keys."""
    return SwaConfig.load(settings.swa_config, overrides=overrides)


# ---------------------------------------------------------------------- namespaces


def parallel_name(*, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """The namespace's ``parallel`` field: ``tp{r}of{n}``, with ``-pp{r}of{n}`` under PP."""
    if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
        raise ConfigError(f"bad parallel rank: tp {tp_rank}/{tp_size}, pp {pp_rank}/{pp_size}")
    name = f"tp{tp_rank}of{tp_size}"
    return name if pp_size == 1 else f"{name}-pp{pp_rank}of{pp_size}"


def engine_namespace(
    *,
    engine: str,
    model: str,
    revision: str | None,
    layout: KVLayout,
    packing: str,
    parallel: str,
    tenant: str = "default",
) -> Namespace:
    """The key namespace of one engine worker's KV: ``revision;engine=...;kv=packing``."""
    rev = f"{revision or 'unversioned'};engine={engine};kv={packing}"
    return Namespace(model=model, revision=rev, layout=layout, parallel=parallel, tenant=tenant)


def state_namespace(main: Namespace, *, window: int, layout: KVLayout, packing: str) -> Namespace:
    """The namespace of the sliding-window state kept beside ``main``'s blocks: the same model,
    revision, rank and tenant; the window, the state's layout and its layers' packing."""
    return Namespace(
        model=main.model,
        revision=f"{main.revision};swa={window};swa-kv={packing}",
        layout=layout,
        parallel=main.parallel,
        tenant=main.tenant,
    )


def namespace_dict(ns: Namespace) -> dict[str, Any]:
    """A namespace as JSON (for stats and logs): every field, and the seed in hex."""
    return {
        "model": ns.model,
        "revision": ns.revision,
        "layout": {
            "tokens_per_block": ns.layout.tokens_per_block,
            "bytes_per_token": ns.layout.bytes_per_token,
            "dtype": ns.layout.dtype.value,
            "layers_in_block": ns.layout.layers_in_block,
        },
        "parallel": ns.parallel,
        "tenant": ns.tenant,
        "seed": ns.seed.hex(),
    }


def namespace_from_dict(data: Mapping[str, Any]) -> Namespace:
    """Inverse of :func:`namespace_dict` (checks the seed, so a mismatch cannot go unnoticed)."""
    layout = data["layout"]
    ns = Namespace(
        model=data["model"],
        revision=data["revision"],
        layout=KVLayout(
            tokens_per_block=int(layout["tokens_per_block"]),
            bytes_per_token=int(layout["bytes_per_token"]),
            dtype=DType(layout["dtype"]),
            layers_in_block=int(layout["layers_in_block"]),
        ),
        parallel=data["parallel"],
        tenant=data["tenant"],
    )
    if "seed" in data and ns.seed.hex() != data["seed"]:
        raise ConfigError(f"namespace seed {ns.seed.hex()} differs from recorded {data['seed']}")
    return ns


# ---------------------------------------------------------------------- the vLLM connector


class LoadMode(enum.Enum):
    """When the worker half loads a hit (see ConnectorSettings.load_mode)."""

    ASYNC = "async"
    SYNC = "sync"


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorSettings(EngineSettings):
    """The connector's own settings from ``kv_connector_extra_config``.

    The fields every engine adapter shares (cluster, model name, tenant, stats,
    SWA tier) are :class:`~kvcache.engine.settings.EngineSettings`'. A fresh prefix
    lookup may block scheduling for ``match_wait_ms``; after that the
    scheduler is told to ask again next step, and after ``match_deadline_ms``
    the request is treated as a miss. Saves waiting to be written may hold at
    most ``max_pending_save_mb`` of host memory; beyond that new saves are
    dropped (a cache may forget; it must not stall the engine).
    """

    match_wait_ms: float = 20.0
    match_deadline_ms: float = 5000.0
    max_pending_save_mb: int = 256
    #: ``async``: a hit's blocks load while the request waits in WAITING_FOR_REMOTE_KVS and
    #: other requests compute; ``sync``: before the forward pass that needs them.
    load_mode: LoadMode = LoadMode.ASYNC
    #: Offer a hit only when loading it, times this margin, is predicted to take no longer
    #: than recomputing it (see FetchPlanner); 0 offers every hit.
    recompute_margin: float = 1.0
    #: Starting estimates until measured: load bandwidth of this worker (GB/s) and the
    #: engine's prefill rate (tokens/s). Unset: hits are offered until both are measured.
    load_gbps: float | None = None
    prefill_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        EngineSettings.__post_init__(self)
        if not (
            self.match_wait_ms >= 0
            and self.match_wait_ms <= self.match_deadline_ms <= _MAX_MATCH_DEADLINE_MS
        ):
            raise ConfigError(
                f"need 0 <= match_wait_ms <= match_deadline_ms <= {_MAX_MATCH_DEADLINE_MS:.0f} "
                f"(an hour), got {self.match_wait_ms} and {self.match_deadline_ms}"
            )
        if self.recompute_margin < 0:
            raise ConfigError(f"recompute_margin must be >= 0, got {self.recompute_margin}")
        for name in ("load_gbps", "prefill_tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0 when given, got {value}")
        if self.max_pending_save_mb < 1:
            raise ConfigError(f"max_pending_save_mb must be >= 1, got {self.max_pending_save_mb}")


def split_extra_config(
    extra: Mapping[str, Any],
) -> tuple[ConnectorSettings, dict[str, Any], dict[str, Any]]:
    """Split vLLM's extra config into connector settings, ClientConfig overrides and SwaConfig
    overrides (``swa_<field>``); see :func:`kvcache.engine.settings.split_engine_config`.

    Unknown keys are errors that list every known key, so a typo in a
    deployment's config fails at start-up instead of being ignored.
    """
    return split_engine_config(extra, ConnectorSettings, source="kv_connector_extra_config")
