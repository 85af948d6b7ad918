"""The SWA tier's configuration: one frozen object, from TOML, environment and code."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.config import build_config, env_overrides, load_toml, parse_size
from kvcache.errors import ConfigError
from kvcache.swa_local.store import DEFAULT_TTL_S
from kvcache.wire import parse_endpoint

__all__ = ["SwaConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SwaConfig:
    """How a worker keeps and serves SWA states.

    ``max_bytes`` bounds the states held in RAM (LRU under it), ``ttl_s`` is
    each state's life from when it was taken. Peers fetch states from
    ``listen`` (port 0: any free port); ``advertise`` is the endpoint put in
    directory records when ``listen`` is not reachable as written (a wildcard
    address). A fetch gives up after ``fetch_timeout_s`` (then the engine
    recomputes). Holder records go to the first ``directory_replicas``
    rendezvous holders of the state's block key, so one dead daemon loses none.
    A worker that stops withdraws its records (``withdraw_on_close``); one that
    does not (or dies) leaves records that resolve to clean misses until they expire.
    """

    max_bytes: int = 2 << 30
    ttl_s: float = DEFAULT_TTL_S
    listen: str = "tcp://127.0.0.1:0"
    advertise: str | None = None
    fetch_timeout_s: float = 0.5
    directory_replicas: int = 3
    connections_per_peer: int = 4
    max_connections: int = 256
    withdraw_on_close: bool = True

    def __post_init__(self) -> None:
        if self.max_bytes < 1:
            raise ConfigError(f"SwaConfig.max_bytes must be positive, got {self.max_bytes}")
        if not 0 < self.ttl_s <= 3600:
            raise ConfigError(f"SwaConfig.ttl_s must lie in (0, 3600], got {self.ttl_s}")
        if not 0 < self.fetch_timeout_s <= 3600:  # inf made every remote fetch raise
            raise ConfigError(
                f"SwaConfig.fetch_timeout_s must be > 0 and at most 3600 s, got {self.fetch_timeout_s}"
            )
        if not 1 <= self.directory_replicas <= 12:
            raise ConfigError("SwaConfig.directory_replicas must lie in 1..12")
        if not 1 <= self.connections_per_peer <= 64 or self.max_connections < 1:
            raise ConfigError("SwaConfig: connections_per_peer in 1..64, max_connections >= 1")
        for name in ("listen", "advertise"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                parse_endpoint(value)
            except ValueError as exc:
                raise ConfigError(f"SwaConfig.{name}: {exc}") from None
            if len(value) > 64:
                raise ConfigError(f"SwaConfig.{name} is longer than 64 characters: {value!r}")
        wildcard = parse_endpoint(self.listen)[0] in ("0.0.0.0", "::", "*")
        if wildcard and self.advertise is None:
            # Peers would dial the wildcard address itself, i.e. themselves: every remote
            # fetch of this worker's states a miss.
            raise ConfigError(
                f"SwaConfig.listen {self.listen!r} is a wildcard address: set advertise to "
                "the endpoint peers reach this worker at (tcp://host:port)"
            )
        if self.advertise is not None and parse_endpoint(self.advertise)[0] in ("0.0.0.0", "::"):
            raise ConfigError(f"SwaConfig.advertise {self.advertise!r} is not reachable by peers")

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        overrides: Mapping[str, Any] | None = None,
    ) -> SwaConfig:
        """Defaults < TOML file (``[swa]`` table or top level) < ``KVCACHE_SWA_*`` < overrides."""
        layers: list[Mapping[str, Any]] = []
        if path is not None:
            raw = load_toml(path)
            layers.append(dict(raw.get("swa", raw)))
        layers.append(env_overrides(cls, "KVCACHE_SWA"))
        if overrides:
            layers.append(overrides)
        source = str(path or "swa config")
        # Sizes may be written "8GiB".
        sized = [
            {
                k: parse_size(v, what=f"{source}: {k}") if k == "max_bytes" and v is not None else v
                for k, v in layer.items()
            }
            for layer in layers
        ]
        return build_config(cls, *sized, source=source)
