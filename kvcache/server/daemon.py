"""Wiring one storage daemon: credentials, store, request handler, socket loop, admin server.

:func:`run_daemon` is what ``kvcache server`` runs, and what tests and
benchmarks use in-process. The thread that calls it owns the store and the
data sockets; the admin server runs on a thread of its own.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import resource
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcache.cluster import read_cluster_file
from kvcache.credentials import Credentials
from kvcache.errors import ConfigError
from kvcache.memtune import tune_malloc
from kvcache.retention.policy import RetentionPolicy
from kvcache.server.admin import AdminServer, OffsetClock, build_app
from kvcache.server.admission import AdmissionLimits
from kvcache.server.config import ServerConfig
from kvcache.server.eviction import Quota
from kvcache.server.handler import RequestHandler
from kvcache.server.loop import DataServer
from kvcache.server.metrics import Metrics
from kvcache.server.scrub import Scrubber
from kvcache.server.selfprobe import SelfProbe
from kvcache.server.store import Clock, ShardStore
from kvcache.server.swa_directory import SwaDirectory

if TYPE_CHECKING:
    from kvcache.events.publisher import EventPublisher
    from kvcache.membership.agent import Registrar

__all__ = ["DaemonInfo", "DaemonThread", "load_credentials", "run_daemon"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonInfo:
    """Where a started daemon listens (ports resolved) and what it serves."""

    node_id: str
    data_endpoint: str
    admin_url: str
    server: DataServer
    #: The event stream's PUB and replay endpoints ("": off).
    events_endpoint: str = ""
    events_replay_endpoint: str = ""

    def to_json(self) -> str:
        """Addresses as JSON (what ``--ready-file`` holds)."""
        doc = {"node_id": self.node_id, "data": self.data_endpoint, "admin": self.admin_url}
        if self.events_endpoint:
            doc |= {"events": self.events_endpoint, "events_replay": self.events_replay_endpoint}
        return json.dumps(doc)


def load_credentials(config: ServerConfig) -> Credentials:
    """The daemon's credentials: the configured file, or ``credentials.toml`` in the data
    directory, generated there (mode 0600) on first start when no file was configured."""
    path = config.effective_credentials_file
    if config.credentials_file is None and not path.exists():
        creds = Credentials.generate()
        creds.write(path)
        log.warning(
            "generated credentials in %s (tenant 'default' and an admin token): clients need "
            "this file (credentials_file in their config) to connect",
            path,
        )
        return creds
    return Credentials.load(path)


def tls_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The data path's TLS context, when a certificate is configured."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot load TLS certificate {config.tls_cert} / key {config.tls_key}: {exc}"
        ) from None
    return context


def run_daemon(
    config: ServerConfig,
    stop: threading.Event,
    *,
    policy: RetentionPolicy | None = None,
    clock: Clock | None = None,
    on_ready: Callable[[DaemonInfo], None] | None = None,
    credentials: Credentials | None = None,
) -> None:
    """Serve until ``stop`` is set, then finish the request in hand and close LMDB.

    The loop notices ``stop`` within its idle poll (0.2 s); call
    ``info.server.wake()`` after setting it to stop at once.

    ``clock`` defaults to wall time; with ``allow_clock_override`` it is
    wrapped so ``POST /debug/clock`` can shift it. ``on_ready`` is called
    once both ports are bound. ``credentials`` default to :func:`load_credentials`.
    """
    tune_malloc()
    # Connections, handshakes, and the segment files (open twice: by the store and by the
    # native data plane), LMDB, sockets of the admin and events servers.
    _raise_fd_limit(config.max_connections + config.max_preauth + 1024)
    policy = policy or RetentionPolicy()
    offset_clock = OffsetClock(clock or time.time) if config.allow_clock_override else None
    ssl_context = tls_context(config)
    store = ShardStore(
        config.data_dir,
        capacity_bytes=config.capacity_bytes,
        policy=policy,
        clock=offset_clock or clock or time.time,
        high_watermark=config.high_watermark,
        low_watermark=config.low_watermark,
        map_size_bytes=config.effective_map_size,
        sync=config.sync,
        sync_interval_s=config.sync_interval_s,
        sweep_batch=config.sweep_batch,
        replace_after_s=config.replace_after_s,
        touch_resolution_s=config.touch_resolution_s,
        touch_flush_s=config.touch_flush_s,
        max_reply_bytes=config.max_data_bytes,
        sendfile_min_bytes=config.sendfile_min_bytes,
        max_readers=max(126, min(4096, 2 * config.max_connections)),
        damaged_file=config.damaged_file,
        writemap=config.lmdb_writemap,
    )
    registered: list[Registrar] = []

    def on_damaged(reason: str) -> None:
        # Called on the loop thread: leaving etcd (revoking the lease) may wait on etcd,
        # so it runs on a thread of its own. Clients then stop using this node.
        for registrar in registered:
            threading.Thread(target=registrar.stop, name="kvcache-leave", daemon=True).start()

    store.on_damaged = on_damaged
    admin: AdminServer | None = None
    server: DataServer | None = None
    registrar: Registrar | None = None
    events: EventPublisher | None = None
    try:
        creds = credentials if credentials is not None else load_credentials(config)
        if not creds.tenants:
            raise ConfigError(
                f"credentials {config.effective_credentials_file} list no tenant: every client "
                "would be refused; add a [tenants.NAME] table with a secret"
            )
        store.quotas = {
            t.id: Quota(total=t.quota_bytes, classes=dict(t.class_quotas), pins=t.pin_quota_bytes)
            for t in creds.tenants
        }
        handler = RequestHandler(
            store,
            Metrics(),
            node_id=config.node_id,
            tenant_names={t.id: t.name for t in creds.tenants},
            swa_directory=SwaDirectory(
                max_records=config.swa_directory_records,
                max_per_key=config.swa_directory_per_key,
                max_per_tenant=config.swa_directory_per_tenant,
            ),
        )
        handler.scrubber = Scrubber(
            store, rate_bytes=config.scrub_rate_bytes, interval_s=config.scrub_interval_s
        )
        server = DataServer(
            handler,
            listen=config.listen,
            credentials=creds,
            limits=config.limits,
            ssl_context=ssl_context,
            send_timeout_s=config.send_timeout_s,
            native_plane=config.native_plane,
            admission=AdmissionLimits(
                max_inflight_bytes=config.max_inflight_bytes,
                tenant_inflight_bytes=config.tenant_inflight_bytes,
                max_connections=config.max_connections,
                tenant_connections=config.tenant_connections,
                max_preauth=config.max_preauth,
                max_preauth_per_peer=config.max_preauth_per_peer,
                handshake_timeout_s=config.handshake_timeout_s,
                request_timeout_s=config.request_timeout_s,
                request_grace_s=config.request_grace_s,
                min_request_rate=config.min_request_rate,
            ),
        )
        endpoint = server.bind()
        if config.events_listen:
            events = _start_events(config, creds, handler, server)
        probe_tenant = creds.tenants[0]
        bound = server
        app = build_app(
            server,
            config,
            admin_token=creds.admin_token,
            configured_policy=policy,
            clock=offset_clock,
            selfprobe=SelfProbe(
                lambda: bound.endpoint,
                tenant=probe_tenant.name,
                secret=probe_tenant.secret,
                tls=ssl_context is not None,
            ),
        )
        admin = AdminServer(app, config.admin_listen)
        admin_url = admin.start()
        usage = store.usage()
        log.info(
            "kvcache server %s: data %s%s, admin %s, %d shards / %d bytes in %s, %d tenant(s), "
            "policy %s",
            config.node_id,
            endpoint,
            " (TLS)" if ssl_context else "",
            admin_url,
            usage["shards"],
            usage["used_bytes"],
            config.data_dir,
            len(creds.tenants),
            store.policy.to_dict(),
        )
        if creds.admin_token is None:
            log.warning("no admin_token in the credentials: admin changes are refused")
        if on_ready is not None:
            on_ready(
                DaemonInfo(
                    node_id=config.node_id,
                    data_endpoint=endpoint,
                    admin_url=admin_url,
                    server=server,
                    events_endpoint=events.endpoint if events else "",
                    events_replay_endpoint=events.replay_endpoint if events else "",
                )
            )
        registrar = _register(config, endpoint, admin_url)
        if registrar is not None:
            registered.append(registrar)
            if store.damaged is not None:
                on_damaged(store.damaged)
        _freeze_startup_objects()
        server.serve(stop)
    finally:
        if registrar is not None:
            registrar.stop()
        if admin is not None:
            admin.stop()
        if server is not None:
            server.close()
        if events is not None:
            events.close()
        store.close()
        log.info("kvcache server %s stopped; LMDB closed", config.node_id)


def _start_events(
    config: ServerConfig, creds: Credentials, handler: RequestHandler, server: DataServer
) -> EventPublisher:
    """The event publisher (kvcache.events), hooked where shards are stored (the handler's
    PUT replies), removed (the store's removal counters) and SWA records come and go."""
    from kvcache.events.publisher import EventPublisher, PublisherSettings

    directory = handler.swa_directory

    def expire_records() -> None:
        if server.serving.is_set():
            server.submit(directory.expire)

    events = EventPublisher(
        PublisherSettings(
            listen=config.events_listen,
            replay_listen=config.events_replay_listen,
            auth=config.events_auth,
            replay_batches=config.events_replay_batches,
            replay_bytes=config.events_replay_bytes,
            queue_entries=config.events_queue,
            batch_events=config.events_batch_events,
            hwm=config.events_hwm,
        ),
        tenants={t.id: (t.name, t.secret) for t in creds.tenants},
        admin_token=creds.admin_token,
        # SWA records expire in RAM with no request to notice: look once a second, on the
        # loop thread that owns the directory.
        tick=expire_records,
    )
    handler.events = events
    handler.store.removals.listener = events.removed

    def swa(tenant: bytes, record: bytes, cause: str | None) -> None:
        if cause is None:
            events.swa_stored(tenant, record)
        else:
            events.swa_removed(tenant, record, cause)

    directory.listener = swa
    return events


def _register(config: ServerConfig, endpoint: str, admin_url: str) -> Registrar | None:
    """Register in etcd under a lease when the cluster file names etcd (else None).

    The daemon serves before it is registered and keeps serving while etcd is
    unreachable (the registrar retries); clients that still have it in their
    map keep using it meanwhile.
    """
    if config.cluster_file is None:
        return None
    _static, etcd = read_cluster_file(config.cluster_file)
    if etcd is None:
        return None
    from kvcache.membership.agent import Registrar  # imports the etcd client: only when used
    from kvcache.membership.model import Registration

    registration = Registration(
        id=config.node_id,
        data=config.advertise or endpoint,
        admin=admin_url,
        domain=config.domain,
        weight=config.weight,
        capacity_bytes=config.capacity_bytes,
        started_ms=int(time.time() * 1000),
        pid=os.getpid(),
    )
    registrar = Registrar(etcd, registration, ttl_s=config.lease_ttl_s)
    registrar.start(wait_s=etcd.timeout_s)
    return registrar


class DaemonThread:
    """A daemon on a background thread, for tests and benchmarks in one process."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        policy: RetentionPolicy | None = None,
        clock: Clock | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.stop_event = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.info: DaemonInfo | None = None

        def ready(info: DaemonInfo) -> None:
            self.info = info
            self._ready.set()

        def target() -> None:
            try:
                run_daemon(
                    config,
                    self.stop_event,
                    policy=policy,
                    clock=clock,
                    on_ready=ready,
                    credentials=credentials,
                )
            except BaseException as exc:
                self._error = exc
                self._ready.set()

        self._thread = threading.Thread(target=target, name=f"kvcache-{config.node_id}")

    def __enter__(self) -> DaemonInfo:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 30.0) -> DaemonInfo:
        """Start and wait until both ports are bound."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"daemon did not start within {timeout_s} s")
        if self._error is not None:
            raise self._error
        assert self.info is not None  # set together with _ready
        return self.info

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop and join; re-raises what the daemon thread died of."""
        self.stop_event.set()
        if self.info is not None:
            self.info.server.wake()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"daemon did not stop within {timeout_s} s")
        if self._error is not None:
            raise self._error


def _freeze_startup_objects() -> None:
    """Keep the cyclic GC from re-scanning every module and startup object, forever.

    Every request allocates a few hundred short-lived tuples and buffers, so
    the collector runs every few requests, and each older-generation pass
    walked all objects alive since startup (numpy, zmq, aiohttp, ...): measured
    as 18 % of a GET batch's time (10-15 % of the service thread's CPU in
    ``perf``). Objects created later are still collected. Process-wide, like
    ``tune_malloc``: an in-process daemon freezes its host's objects too.
    """
    gc.collect()
    gc.freeze()


def _raise_fd_limit(wanted: int) -> None:
    """Raise the soft open-files limit towards ``wanted`` (connections, authenticated and
    waiting for their handshake, plus LMDB and the admin server), up to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit to %d: %s", target, exc)
