"""``ServerConfig``: everything one storage daemon is told, frozen and validated when built.

Loaded from TOML (``[server]`` and ``[retention]`` tables), then environment
variables ``KVCACHE_SERVER_<FIELD>`` / ``KVCACHE_RETENTION_<FIELD>``, then
command-line flags, later layers winning (see :func:`load_server_config`).
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.config import build_config, env_overrides, load_toml, parse_size
from kvcache.errors import ConfigError
from kvcache.retention.policy import RetentionPolicy
from kvcache.wire import Limits, parse_endpoint

__all__ = [
    "ServerConfig",
    "DamagedFile",
    "SyncMode",
    "default_map_size",
    "load_server_config",
    "parse_admin_listen",
    "parse_size",
]

ENV_PREFIX = "KVCACHE_SERVER"
RETENTION_ENV_PREFIX = "KVCACHE_RETENTION"
_SIZE_FIELDS = (
    "capacity_bytes",
    "map_size_bytes",
    "max_data_bytes",
    "max_inflight_bytes",
    "tenant_inflight_bytes",
    "scrub_rate_bytes",
    "events_replay_bytes",
    "sendfile_min_bytes",
)


class SyncMode(enum.Enum):
    """When LMDB's writes are forced to disk.

    Every mode survives ``kill -9`` of the daemon (committed pages are in the
    OS page cache). They differ on a machine crash or power loss:
    ``commit`` loses nothing acknowledged; ``periodic`` may lose (and, as LMDB
    does not order unsynced writes, may damage) what was written since the
    last sync; ``none`` leaves flushing to the OS entirely.
    """

    COMMIT = "commit"
    PERIODIC = "periodic"
    NONE = "none"


class DamagedFile(enum.Enum):
    """What a daemon does when its LMDB file fails the start-up check
    (:mod:`kvcache.server.lmdb_check`: cut short, or meta pages that are not LMDB's).

    ``quarantine`` (the default) renames the file aside (``data.mdb.damaged``, replacing
    an older one) and starts empty: the store is a cache, so the node loses only hits,
    which read repair and ``kvcache repair`` put back, while a node that refuses to start
    costs every block one shard of redundancy until someone acts. ``refuse`` exits with
    a non-zero status and leaves the file untouched, for operators who want to look first.
    """

    QUARANTINE = "quarantine"
    REFUSE = "refuse"


def default_map_size(capacity_bytes: int) -> int:
    """LMDB map size for a capacity: 1.5 x capacity + 64 MiB (see ``effective_map_size``)."""
    return int(capacity_bytes * 1.5) + (64 << 20)


#: Duration settings that must be above zero.
_POSITIVE_DURATIONS = (
    "sync_interval_s",
    "touch_flush_s",
    "handshake_timeout_s",
    "send_timeout_s",
    "request_timeout_s",
    "request_grace_s",
)
#: The longest duration setting: a year (threading's waits overflow near 292 years).
_MAX_DURATION_S = 365 * 86_400.0
#: ZMQ's high-water marks are C ints (the replay socket's is events_replay_batches + 2).
_MAX_ZMQ_HWM = (1 << 31) - 3
#: Top-level tables of a config file shared between the components.
_SHARED_TABLES = frozenset({"server", "retention", "client", "swa", "dashboard"})


def parse_admin_listen(value: str) -> tuple[str, int]:
    """``host:port`` → (host, port); raises ConfigError naming the value."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"admin_listen must be host:port, got {value!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    """One storage daemon's settings. Sizes in bytes, durations in seconds."""

    #: Name of this node in logs, metrics and STATS.
    node_id: str = "node-0"
    #: Directory of the LMDB environment (created if missing).
    data_dir: Path = Path("kvcache-data")
    #: Endpoint the data path listens on (TCP). Port 0 picks a free port.
    listen: str = "tcp://127.0.0.1:7400"
    #: host:port of the admin HTTP server. Port 0 picks a free port.
    admin_listen: str = "127.0.0.1:7480"
    #: Bytes of shard records (header + body) this node keeps at most.
    capacity_bytes: int = 8 << 30
    #: Above this fraction of capacity, eviction starts ...
    high_watermark: float = 0.90
    #: ... and runs until usage is below this fraction.
    low_watermark: float = 0.80
    #: LMDB map size; 0 derives it from capacity (1.5 x capacity + 64 MiB).
    map_size_bytes: int = 0
    #: When writes are forced to disk (see SyncMode).
    sync: SyncMode = SyncMode.PERIODIC
    #: A data file that fails the start-up check is quarantined or refused (see DamagedFile).
    damaged_file: DamagedFile = DamagedFile.QUARANTINE
    #: Seconds between syncs in ``periodic`` mode.
    sync_interval_s: float = 5.0
    #: LMDB writes through its map (``writemap``), the data file allocated ahead of every
    #: write transaction so a full disk is a refused write, not a SIGBUS (see
    #: kvcache.server.lmdb_env). Off, or where the file system cannot have it: LMDB's pages
    #: are written back with ``pwrite`` at each commit.
    lmdb_writemap: bool = True
    #: Tenants' secrets, quotas and the admin token (see kvcache.credentials). Empty: the
    #: file ``credentials.toml`` in ``data_dir``, generated there on first start.
    credentials_file: Path | None = None
    #: TLS on the data path: certificate chain and key (PEM). Both or neither.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: Most items in one request.
    max_items: int = 16384
    #: Most bytes in one data section (request or reply).
    max_data_bytes: int = 256 << 20
    #: A GET reply's records that lie together on disk, at least this many bytes, are
    #: sent with ``sendfile`` from the segment file (no copy through the daemon); shorter
    #: runs, and every reply under TLS, are sent from the file's mapping. 0: never.
    sendfile_min_bytes: int = 64 << 10
    #: Answer quiet GETs and HAS of plain-TCP connections in the native data plane
    #: (kvcache.server.native_plane) when it is built; off: every request in Python.
    native_plane: bool = True
    #: Most data-path connections at once; more are closed as they arrive.
    max_connections: int = 1024
    #: Seconds a new connection has to finish the session handshake.
    handshake_timeout_s: float = 10.0
    #: A reply that makes no progress for this long closes its connection (peer not reading).
    send_timeout_s: float = 30.0
    #: Request bytes received and not yet stored, across connections, before the daemon
    #: stops starting new requests (a tenant holding none may always start one).
    max_inflight_bytes: int = 1 << 30
    #: The most of those one tenant's half-received requests may hold.
    tenant_inflight_bytes: int = 256 << 20
    #: Authenticated data-path connections one tenant may hold.
    tenant_connections: int = 512
    #: Connections waiting for their session handshake; when full the oldest makes room.
    max_preauth: int = 1024
    #: ... of those, from one peer address.
    max_preauth_per_peer: int = 512
    #: A request still arriving after this long is cut off.
    request_timeout_s: float = 120.0
    #: ... and one arriving slower than ``min_request_rate`` bytes/s once this long passed.
    request_grace_s: float = 5.0
    min_request_rate: int = 256 << 10
    #: Most shards one sweep or eviction transaction deletes (bounds how long it holds the writer).
    sweep_batch: int = 512
    #: A hit moving an expiry by less than this is not written (saves writes on hot blocks).
    touch_resolution_s: float = 60.0
    #: Hits are written in batches at least this often.
    touch_flush_s: float = 1.0
    #: A stored shard of another write may be replaced (PUT with ``expect``) only once it is
    #: this old: longer than any writer takes to finish a block, so none is overwritten mid-way.
    replace_after_s: float = 10.0
    #: SWA holder records kept in RAM (DIR_PUT / HAS_DIR), in all and per block key.
    swa_directory_records: int = 1 << 18
    swa_directory_per_key: int = 8
    #: ... and per tenant: one tenant's DIR_PUT flood evicts only its own records.
    swa_directory_per_tenant: int = 1 << 17
    #: The cluster map the status page (``/dashboard``) shows, read again at every poll so an
    #: edited file shows without a restart. Unset: the page shows this node alone.
    cluster_file: Path | None = None
    #: Failure domain (host, rack) this node registers with when the cluster file names etcd;
    #: empty: the node id. Placement puts no more of a block's shards in one domain than needed.
    domain: str = ""
    #: Placement weight this node registers with (relative share of shards).
    weight: float = 1.0
    #: Seconds of this node's etcd lease: clients stop using a node that stopped renewing it
    #: (crashed, cut off) within this time. etcd's minimum is 2.
    lease_ttl_s: int = 10
    #: Data endpoint clients should use, registered in etcd (when ``listen`` binds a wildcard
    #: address such as tcp://0.0.0.0:7400). Empty: the bound endpoint.
    advertise: str = ""
    #: Scrub (kvcache.server.scrub): stored shards re-verified per second at most, in
    #: bytes ("32MiB" in TOML or flags); 0 turns scrubbing off.
    scrub_rate_bytes: int = 32 << 20
    #: Seconds from the start of one scrub pass to the next (the first: after start-up).
    scrub_interval_s: float = 7 * 24 * 3600.0
    #: The event stream for routers (kvcache.events, docs/spec/events.md): the PUB endpoint
    #: to bind, e.g. tcp://127.0.0.1:7490 (port 0: any free one). Empty (the default): off.
    events_listen: str = ""
    #: Its replay (ROUTER) endpoint; empty: the PUB port + 1 (any free port when that is 0).
    events_replay_listen: str = ""
    #: Subscribers authenticate (ZMQ PLAIN: tenant name + a token derived from its secret) and
    #: see their own tenant's events only. Off is allowed on loopback or ipc endpoints only.
    events_auth: bool = True
    #: Batches kept per tenant for replay, and their bytes at most ("64MiB" in TOML or flags).
    events_replay_batches: int = 10_000
    events_replay_bytes: int = 64 << 20
    #: Entries waiting for the publisher thread; beyond it they are dropped and counted, so
    #: the serving loop never waits (subscribers see a gap and resync).
    events_queue: int = 1 << 16
    #: Most events in one published batch.
    events_batch_events: int = 1024
    #: The PUB socket's send high-water mark (messages queued per slow subscriber).
    events_hwm: int = 100_000
    #: Test only: allow ``POST /debug/clock`` to shift the daemon's clock (admin-token-guarded).
    allow_clock_override: bool = False

    def __post_init__(self) -> None:
        if (
            not self.node_id
            or len(self.node_id.encode("utf-8")) > 128  # what a session HELLO carries
            or not self.node_id.isprintable()
        ):
            raise ConfigError(
                f"node_id must be 1-128 printable characters (128 bytes UTF-8), got "
                f"{self.node_id!r}"
            )
        try:
            parse_endpoint(self.listen)
        except ValueError as exc:
            raise ConfigError(f"listen: {exc}") from None
        parse_admin_listen(self.admin_listen)
        if self.capacity_bytes < 1 << 20:
            raise ConfigError(f"capacity_bytes must be at least 1 MiB, got {self.capacity_bytes}")
        if not 0.0 < self.low_watermark < self.high_watermark <= 1.0:
            raise ConfigError(
                "watermarks must satisfy 0 < low_watermark < high_watermark <= 1, got "
                f"low={self.low_watermark} high={self.high_watermark}"
            )
        if self.map_size_bytes and self.map_size_bytes < 1 << 20:
            raise ConfigError(
                f"map_size_bytes must be 0 (derived) or >= 1 MiB, got {self.map_size_bytes}"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key go together: set both or neither")
        for name in (
            "max_items",
            "max_data_bytes",
            "sweep_batch",
            "max_connections",
            "max_inflight_bytes",
            "tenant_inflight_bytes",
            "tenant_connections",
            "max_preauth",
            "max_preauth_per_peer",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.min_request_rate < 0:
            raise ConfigError(f"min_request_rate must be >= 0, got {self.min_request_rate}")
        for name in _POSITIVE_DURATIONS:
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        # A thread's wait past threading.TIMEOUT_MAX is an OverflowError.
        for name in (*_POSITIVE_DURATIONS, "replace_after_s", "scrub_interval_s",
                     "touch_resolution_s"):  # fmt: skip
            if getattr(self, name) > _MAX_DURATION_S:
                raise ConfigError(
                    f"{name} must be at most {_MAX_DURATION_S:.0f} s (a year), "
                    f"got {getattr(self, name)}"
                )
        if self.replace_after_s < 0:
            raise ConfigError(f"replace_after_s must be >= 0, got {self.replace_after_s}")
        if self.swa_directory_per_tenant < 1:
            raise ConfigError(
                f"swa_directory_per_tenant must be >= 1, got {self.swa_directory_per_tenant}"
            )
        if self.swa_directory_records < 1 or self.swa_directory_per_key < 1:
            raise ConfigError(
                "swa_directory_records and swa_directory_per_key must be >= 1, got "
                f"{self.swa_directory_records} and {self.swa_directory_per_key}"
            )
        if self.scrub_rate_bytes < 0:
            raise ConfigError(f"scrub_rate_bytes must be >= 0, got {self.scrub_rate_bytes}")
        if not self.scrub_interval_s > 0:
            raise ConfigError(f"scrub_interval_s must be > 0, got {self.scrub_interval_s}")
        if self.touch_resolution_s < 0:
            raise ConfigError(f"touch_resolution_s must be >= 0, got {self.touch_resolution_s}")
        if not isinstance(self.lease_ttl_s, int) or self.lease_ttl_s < 2:
            raise ConfigError(f"lease_ttl_s must be an integer >= 2 (etcd), got {self.lease_ttl_s}")
        if not self.weight > 0:
            raise ConfigError(f"weight must be > 0, got {self.weight}")
        if self.advertise:
            try:
                parse_endpoint(self.advertise)
            except ValueError as exc:
                raise ConfigError(f"advertise: {exc}") from None
        self._check_events()

    def _check_events(self) -> None:
        for name in ("events_listen", "events_replay_listen"):
            value = getattr(self, name)
            if value and not value.startswith(("tcp://", "ipc://")):
                raise ConfigError(f"{name} must be tcp://host:port or ipc://path, got {value!r}")
        for name in ("events_replay_batches", "events_replay_bytes", "events_queue",
                     "events_batch_events", "events_hwm"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("events_replay_batches", "events_hwm"):  # ZMQ high-water marks: C ints
            if getattr(self, name) > _MAX_ZMQ_HWM:
                raise ConfigError(
                    f"{name} must be at most {_MAX_ZMQ_HWM}, got {getattr(self, name)}"
                )
        if self.events_replay_listen and not self.events_listen:
            raise ConfigError(
                "events_replay_listen is set but events_listen is not: set events_listen to "
                "publish the event stream (the replay endpoint serves it)"
            )
        if self.events_listen and not self.events_auth:
            for value in (self.events_listen, self.events_replay_listen):
                if value and not _local_endpoint(value):
                    raise ConfigError(
                        f"events_auth = false lets anyone who reaches {value} read every "
                        "tenant's block keys: allowed on loopback (tcp://127.0.0.1, "
                        "tcp://[::1], tcp://localhost) or ipc:// endpoints only"
                    )

    @property
    def limits(self) -> Limits:
        """The wire limits requests are decoded with."""
        return Limits(max_items=self.max_items, max_data_bytes=self.max_data_bytes)

    @property
    def effective_map_size(self) -> int:
        """The LMDB map size used: explicit, or 1.5 x capacity + 64 MiB of slack.

        LMDB keeps the pages of the last snapshot until the next commit and
        stores an 11.5 KB value in three 4 KiB overflow pages, so the map needs
        room beyond the logical capacity.
        """
        return self.map_size_bytes or default_map_size(self.capacity_bytes)

    @property
    def effective_credentials_file(self) -> Path:
        """The credentials file used: the configured one, or ``credentials.toml`` in data_dir."""
        return self.credentials_file or self.data_dir / "credentials.toml"

    def redacted(self) -> dict[str, Any]:
        """The settings as plain values for the start-up log, the token hidden."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, enum.Enum):
                value = value.value
            elif isinstance(value, Path):
                value = str(value)
            out[f.name] = value
        return out


def load_server_config(
    path: str | Path | None = None,
    *,
    flags: Mapping[str, Any] | None = None,
    environ: bool = True,
) -> tuple[ServerConfig, RetentionPolicy]:
    """Config and retention policy from TOML < environment < flags.

    The TOML file may hold a ``[server]`` table (ServerConfig fields) and a
    ``[retention]`` table (see :meth:`RetentionPolicy.from_mapping`). Sizes may
    be written ``"64GiB"``. Flags whose value is None are ignored.
    """
    table: dict[str, Any] = load_toml(path) if path is not None else {}
    unknown = set(table) - _SHARED_TABLES
    if unknown:  # the other components' tables of a shared file are let be
        raise ConfigError(
            f"{path}: unknown table(s) {sorted(unknown)}; the daemon reads [server] and "
            "[retention] (a shared file may also hold [client], [swa] and [dashboard])"
        )
    layers: list[tuple[str, Mapping[str, Any]]] = [(str(path), table.get("server", {}))]
    if environ:
        layers.append(("environment", env_overrides(ServerConfig, ENV_PREFIX)))
    layers.append(("flags", {k: v for k, v in (flags or {}).items() if v is not None}))
    converted: list[Mapping[str, Any]] = []
    for source, layer in layers:
        if not isinstance(layer, Mapping):
            raise ConfigError(f"{source}: [server] must be a table")
        converted.append(
            {
                k: parse_size(v, what=f"{source}: {k}") if k in _SIZE_FIELDS else v
                for k, v in layer.items()
            }
        )
    sources = ", ".join(source for source, layer in layers if layer)
    config = build_config(ServerConfig, *converted, source=sources or "defaults")
    raw_retention = table.get("retention", {})
    if not isinstance(raw_retention, Mapping):
        raise ConfigError(
            f'{path}: [retention] must be a table (like [retention.classes] agent = "3d"), '
            f"got {raw_retention!r}"
        )
    retention: dict[str, Any] = dict(raw_retention)
    if environ:
        retention.update(_retention_env())
    policy = RetentionPolicy.from_mapping(retention, source=str(path or "retention"))
    return config, policy


def _retention_env() -> dict[str, str]:
    out: dict[str, str] = {}
    for name in ("classes", "default_class"):
        key = f"{RETENTION_ENV_PREFIX}_{name.upper()}"
        if key in os.environ:
            out[name] = os.environ[key]
    return out


def _local_endpoint(endpoint: str) -> bool:
    """An ipc endpoint, or tcp on a loopback address."""
    if endpoint.startswith("ipc://"):
        return True
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")
