"""Client configuration: one frozen object, loadable from TOML, environment and code."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcache.config import build_config, env_overrides, load_toml
from kvcache.credentials import DEFAULT_TENANT, Credentials, check_tenant_name, parse_secret
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

    Credentials: the cluster refuses clients without them. ``tenant`` names
    whose blocks this client reads and writes; its secret comes from ``secret``
    (hex) or from the tenant's entry in ``credentials_file`` (mode 0600).

    Throughput: a load or store is cut into chunks of about ``chunk_bytes`` of
    payload (at most ``max_batch_blocks`` blocks), one request per node each,
    with ``window`` chunks in flight over ``connections_per_node`` connections
    to every node.
    """

    cluster_file: Path
    tenant: str = DEFAULT_TENANT
    credentials_file: Path | None = None
    secret: str = field(default="", repr=False)
    #: Encrypt the data path with TLS, trusting this CA (PEM); empty: plain TCP.
    tls_ca: Path | None = None
    k: int = 10
    m: int = 2
    min_write_shards: int = 11
    traffic_class: str = "default"
    timeout_s: float = 2.0
    hedge_ms: float | None = None
    down_retry_s: float = 5.0
    max_batch_blocks: int = 256
    chunk_bytes: int = 32 << 20
    window: int = 4
    connections_per_node: int = 2
    #: A call waiting for its replies runs the transport's socket loop itself (off: the
    #: I/O thread receives everything and hands each batch of replies over, as until
    #: 2026-12-03; see kvcache.client.transport, "Who runs the loop").
    caller_drives: bool = True
    #: A load's first GETs, one per node, go out and come back in one native call (the
    #: transport's burst, kvcache/native/kvfast.c) when the native helpers are loaded and
    #: the caller drives; off: each through the socket loop as any exchange.
    burst: bool = True
    #: Worker processes that move the bytes of loads and stores (0: this process does).
    #: With N > 0, buffers from ``Client.alloc_buffer`` are written and read by the workers
    #: directly (shared memory); see kvcache.client.pool.
    io_processes: int = 0
    #: An I/O worker silent this long while a request waits on it is taken for stopped and
    #: killed; its requests fail as a dead worker's do. At least 5x ``timeout_s``; a busy
    #: worker sends a heartbeat every quarter of it.
    io_stall_s: float = 10.0
    #: Put back shards a load found bad or missing on their holders (read repair; see
    #: repair_down_after_s for holders that are down), and drop a stripe that no k of its
    #: shards rebuild, so that any client's next store rewrites it.
    read_repair: bool = True
    #: How long a holder must have been marked down (without answering since) before read
    #: repair rebuilds its shards on stand-in nodes; a node the membership source reports
    #: dead (its lease ran out) qualifies at once. 0: at once. Shorter outages (a restart,
    #: a pause) leave no stand-in copies behind; the down holder's shards are rebuilt from
    #: parity for each load meanwhile.
    repair_down_after_s: float = 60.0
    #: Ask the holders what they have (HAS) before every store, as stores did until
    #: 2026-12. Off: a store's PUTs go out at once, and only blocks some holder answers
    #: CONFLICT for (another stripe is stored there) are stored again after a HAS.
    ask_before_store: bool = False
    #: Let glibc reuse large freed buffers instead of mmap/munmap per batch (see kvcache.memtune).
    tune_malloc: bool = True
    #: Bytes of parity scratch a process keeps from one load to the next, so a load's
    #: parity shards land in pages already faulted in (see kvcache.client.scratch); 0: none.
    scratch_cache_bytes: int = 256 << 20
    #: Hold Python's cyclic garbage collector off while a load, store or match runs; it is
    #: switched back on when the last call ends (see kvcache.gc_pause).
    pause_gc: bool = True

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
        if not self.repair_down_after_s >= 0:
            raise ConfigError(
                f"repair_down_after_s must be >= 0 seconds, got {self.repair_down_after_s!r}"
            )
        if self.hedge_ms is not None and self.hedge_ms < 0:
            raise ConfigError("hedge_ms must be >= 0")
        if not 1 <= self.max_batch_blocks <= 4096:
            raise ConfigError("max_batch_blocks must lie in 1..4096")
        if self.chunk_bytes < 1 or not 1 <= self.window <= 64:
            raise ConfigError("chunk_bytes must be >= 1 and window in 1..64")
        if not 0 <= self.io_processes <= 64:
            raise ConfigError("io_processes must lie in 0..64")
        if not 0 < self.io_stall_s <= 86_400:
            raise ConfigError(f"io_stall_s must lie in (0, 86400], got {self.io_stall_s!r}")
        if self.scratch_cache_bytes < 0:
            raise ConfigError(f"scratch_cache_bytes must be >= 0, got {self.scratch_cache_bytes!r}")
        if not 1 <= self.connections_per_node <= 16:
            raise ConfigError("connections_per_node must lie in 1..16")
        check_tenant_name(self.tenant)
        if self.secret:
            parse_secret(self.secret, what="ClientConfig.secret")

    @property
    def n(self) -> int:
        """Shards per stripe."""
        return self.k + self.m

    def secret_bytes(self) -> bytes:
        """This client's tenant secret; ConfigError saying what to set when there is none."""
        if self.secret:
            return parse_secret(self.secret, what="ClientConfig.secret")
        if self.credentials_file is not None:
            tenant = Credentials.load(self.credentials_file).tenant(self.tenant)
            if tenant is None:
                raise ConfigError(
                    f"credentials file {self.credentials_file} has no tenant {self.tenant!r}"
                )
            return tenant.secret
        raise ConfigError(
            "no credentials: the cluster refuses clients without them. Set credentials_file "
            "(e.g. the credentials.toml that `kvcache up` wrote) or secret in the client config, "
            "or KVCACHE_CLIENT_CREDENTIALS_FILE / KVCACHE_CLIENT_SECRET"
        )

    def chunk_blocks(self, payload_len: int) -> int:
        """Blocks per chunk for payloads of ``payload_len`` bytes."""
        return max(1, min(self.max_batch_blocks, self.chunk_bytes // max(1, payload_len)))

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
            table = dict(raw.get("client", raw))
            # Relative paths in a file are relative to that file.
            for name in ("cluster_file", "credentials_file", "tls_ca"):
                if isinstance(table.get(name), str) and not Path(table[name]).is_absolute():
                    table[name] = str(Path(path).parent / table[name])
            layers.append(table)
        layers.append(env_overrides(cls, "KVCACHE_CLIENT"))
        if overrides:
            layers.append(overrides)
        return build_config(cls, *layers, source=str(path or "client config"))
