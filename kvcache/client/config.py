"""Client configuration: one frozen object, loadable from TOML, environment and code."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.config import build_config, env_overrides, load_toml
from kvcache.errors import ConfigError
from kvcache.shard import check_class_name

__all__ = ["ClientConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientConfig:
    """How a client reaches and uses the cluster.

    ``hedge_ms`` is how long a load waits for its first ``k + 1`` shards per
    block before asking the last holders too; ``None`` derives it from observed
    latency. A node that does not answer within ``timeout_s`` is marked down and
    skipped for ``down_retry_s`` seconds, then probed again by normal traffic.
    """

    cluster_file: Path
    k: int = 10
    m: int = 2
    min_write_shards: int = 11
    traffic_class: str = "default"
    timeout_s: float = 2.0
    hedge_ms: float | None = None
    down_retry_s: float = 5.0
    max_batch_blocks: int = 256
    token: str = ""
    #: Let glibc reuse large freed buffers instead of mmap/munmap per batch (see kvcache.memtune).
    tune_malloc: bool = True

    def __post_init__(self) -> None:
        if not self.k >= 1 or not self.m >= 0 or self.k + self.m > 255:
            raise ConfigError(f"k={self.k}, m={self.m}: need k >= 1, m >= 0, k + m <= 255")
        if not self.k <= self.min_write_shards <= self.k + self.m:
            raise ConfigError(
                f"min_write_shards={self.min_write_shards} must lie in k..k+m "
                f"({self.k}..{self.k + self.m})"
            )
        check_class_name(self.traffic_class)
        if self.timeout_s <= 0 or self.down_retry_s < 0:
            raise ConfigError("timeout_s must be > 0 and down_retry_s >= 0")
        if self.hedge_ms is not None and self.hedge_ms < 0:
            raise ConfigError("hedge_ms must be >= 0")
        if not 1 <= self.max_batch_blocks <= 4096:
            raise ConfigError("max_batch_blocks must lie in 1..4096")

    @property
    def n(self) -> int:
        """Shards per stripe."""
        return self.k + self.m

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        overrides: Mapping[str, Any] | None = None,
    ) -> ClientConfig:
        """Defaults < TOML file (``[client]`` table or top level) < ``KVCACHE_CLIENT_*`` < overrides."""
        layers: list[Mapping[str, Any]] = []
        if path is not None:
            raw = load_toml(path)
            layers.append(raw.get("client", raw))
        layers.append(env_overrides(cls, "KVCACHE_CLIENT"))
        if "KVCACHE_TOKEN" in os.environ and not any("token" in layer for layer in layers):
            layers.append({"token": os.environ["KVCACHE_TOKEN"]})
        if overrides:
            layers.append(overrides)
        return build_config(cls, *layers, source=str(path or "client config"))
