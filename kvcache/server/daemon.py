"""Wiring one storage daemon: store, data service, admin server; start, serve, stop.

:func:`run_daemon` is what ``kvcache server`` runs, and what tests and
benchmarks use in-process. The thread that calls it owns the store and the
data socket; the admin server runs on a thread of its own.
"""

from __future__ import annotations

import gc
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from kvcache.memtune import tune_malloc
from kvcache.retention.policy import RetentionPolicy
from kvcache.server.admin import AdminServer, OffsetClock, build_app
from kvcache.server.config import ServerConfig
from kvcache.server.metrics import Metrics
from kvcache.server.service import DataService
from kvcache.server.store import Clock, ShardStore

__all__ = ["DaemonInfo", "DaemonThread", "run_daemon"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonInfo:
    """Where a started daemon listens (ports resolved) and what it serves."""

    node_id: str
    data_endpoint: str
    admin_url: str
    service: DataService

    def to_json(self) -> str:
        """Addresses as JSON (what ``--ready-file`` holds)."""
        return json.dumps(
            {"node_id": self.node_id, "data": self.data_endpoint, "admin": self.admin_url}
        )


def run_daemon(
    config: ServerConfig,
    stop: threading.Event,
    *,
    policy: RetentionPolicy | None = None,
    clock: Clock | None = None,
    on_ready: Callable[[DaemonInfo], None] | None = None,
    context: zmq.Context[Any] | None = None,
) -> None:
    """Serve until ``stop`` is set, then finish the request in flight and close LMDB.

    The loop notices ``stop`` within its idle poll (0.2 s); call
    ``info.service.wake()`` after setting it to stop at once.

    ``clock`` defaults to wall time; with ``allow_clock_override`` it is
    wrapped so ``POST /debug/clock`` can shift it. ``on_ready`` is called
    once both ports are bound.
    """
    tune_malloc()
    policy = policy or RetentionPolicy()
    offset_clock = OffsetClock(clock or time.time) if config.allow_clock_override else None
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
        touch_resolution_s=config.touch_resolution_s,
        touch_flush_s=config.touch_flush_s,
        max_reply_bytes=config.max_data_bytes,
    )
    admin: AdminServer | None = None
    service = DataService(store, config, Metrics(), context=context)
    try:
        endpoint = service.bind()
        app = build_app(service, config, configured_policy=policy, clock=offset_clock)
        admin = AdminServer(app, config.admin_listen)
        admin_url = admin.start()
        usage = store.usage()
        log.info(
            "kvcache server %s: data %s, admin %s, %d shards / %d bytes in %s, policy %s",
            config.node_id,
            endpoint,
            admin_url,
            usage["shards"],
            usage["used_bytes"],
            config.data_dir,
            store.policy.to_dict(),
        )
        if config.token is None and not _loopback(config.admin_listen):
            log.warning("admin API on %s has no token: anyone can change the policy", admin_url)
        if on_ready is not None:
            on_ready(
                DaemonInfo(
                    node_id=config.node_id,
                    data_endpoint=endpoint,
                    admin_url=admin_url,
                    service=service,
                )
            )
        _freeze_startup_objects()
        service.serve(stop)
    finally:
        if admin is not None:
            admin.stop()
        service.close()
        store.close()
        log.info("kvcache server %s stopped; LMDB closed", config.node_id)


class DaemonThread:
    """A daemon on a background thread, for tests and benchmarks in one process."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        policy: RetentionPolicy | None = None,
        clock: Clock | None = None,
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
                run_daemon(config, self.stop_event, policy=policy, clock=clock, on_ready=ready)
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
            self.info.service.wake()
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


def _loopback(listen: str) -> bool:
    host = listen.rpartition(":")[0].strip("[]")
    return host in ("127.0.0.1", "::1", "localhost")
