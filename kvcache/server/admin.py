"""The admin HTTP server (aiohttp) on its own port and thread.

Reads: ``GET /healthz`` (200 only when a request through the data port is answered:
:mod:`kvcache.server.selfprobe`; 503 while starting, when the LMDB file is damaged, or
when the data path does not answer), ``GET /metrics`` (Prometheus text), ``GET /stats``
(JSON), ``GET /retention``, and the cluster status page under ``/dashboard``
(:mod:`kvcache.dashboard`: it needs the admin token when one is configured, and
shows the nodes of ``cluster_file``, or this node alone). Writes always need the admin token from the
cluster credentials (``Authorization: Bearer <token>``); without one
configured they are refused: ``PUT /retention`` (a policy as JSON),
``DELETE /retention`` (back to the configured policy), ``POST /scrub`` (start a
scrub pass now: :mod:`kvcache.server.scrub`) and, only with
``allow_clock_override``, ``POST /debug/clock``.

The admin thread never touches LMDB: reads use the store's thread-safe
snapshots, writes run on the loop thread through ``DataServer.submit``.

Admin connections share the daemon's file descriptors with the data path, so
they are bounded: at most ``MAX_ADMIN_CONNECTIONS`` open at once (more are
closed as they arrive), each for at most ``ADMIN_CONNECTION_MAX_S`` (a client
that sent half a header and waited held its connection for ever: 4,200 of them
used up the descriptors, and the data path stopped taking sessions).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kvcache.cluster import NodeInfo
from kvcache.dashboard import Access, Collector, LocalNode, add_dashboard
from kvcache.errors import ConfigError
from kvcache.retention.policy import RetentionPolicy
from kvcache.server.config import ServerConfig, parse_admin_listen
from kvcache.server.loop import DataServer
from kvcache.server.metrics import render_prometheus
from kvcache.server.removals import render_removals
from kvcache.server.selfprobe import SelfProbe

__all__ = ["AdminServer", "OffsetClock", "build_app"]

log = logging.getLogger(__name__)

_JSON_LIMIT = 64 << 10
#: How far a test may move or hold a daemon's clock: expiries must stay within a row's
#: whole seconds (u32, to 2106) with a decade of TTL on top.
_MAX_OFFSET_S = 1e9
_MAX_HELD_S = 3.7e9
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: Admin HTTP connections open at once, and the longest one may stay open (seconds).
MAX_ADMIN_CONNECTIONS = 128
ADMIN_CONNECTION_MAX_S = 60.0
#: Seconds between two log lines about failed accepts (out of descriptors, say).
_ACCEPT_WARN_EVERY_S = 10.0


class OffsetClock:
    """``time.time()`` plus an offset a test may move, or a time it holds still
    (``POST /debug/clock``)."""

    def __init__(self, base: Callable[[], float]) -> None:
        self._base = base
        self.offset_s = 0.0
        #: While set, the clock reads this and nothing else (a replay at a trace's own
        #: times: every daemon then stamps a request's writes alike).
        self.frozen_s: float | None = None

    def __call__(self) -> float:
        if self.frozen_s is not None:
            return self.frozen_s
        return self._base() + self.offset_s

    def realtime_offset_s(self) -> float | None:
        """The offset from wall time, when the base is wall time (else None: so is a
        frozen clock, which the native data plane, reading wall time, leaves to Python)."""
        return self.offset_s if self._base is time.time and self.frozen_s is None else None


def build_app(
    service: DataServer,
    config: ServerConfig,
    *,
    admin_token: str | None,
    configured_policy: RetentionPolicy,
    clock: OffsetClock | None = None,
    selfprobe: SelfProbe | None = None,
) -> web.Application:
    """The admin application; ``clock`` enables ``/debug/clock`` when the config allows it;
    ``selfprobe`` makes ``/healthz`` check the data path (else: serving and not damaged)."""
    store = service.handler.store

    def guarded(handler: _Handler) -> _Handler:
        async def check(request: web.Request) -> web.StreamResponse:
            if admin_token is None:
                service.metrics.error("admin_unauthorized")
                return _json(
                    {"error": "no admin_token in this daemon's credentials: changes are refused"},
                    status=403,
                )
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {admin_token}".encode()):
                service.metrics.error("admin_unauthorized")
                return _json({"error": "missing or wrong admin token"}, status=401)
            return await handler(request)

        return check

    async def healthz(request: web.Request) -> web.Response:
        # Healthy only when the data path answers: serving, the store not damaged, and a
        # real request through the data port answered (kvcache.server.selfprobe).
        body: dict[str, Any] = {"node_id": config.node_id}
        if not service.serving.is_set():
            return _json({**body, "status": "starting"}, status=503)
        if store.damaged is not None:
            return _json({**body, "status": "damaged", "reason": store.damaged}, status=503)
        if (failing := store.io_failing) is not None:
            return _json({**body, "status": "unhealthy", "reason": failing}, status=503)
        if selfprobe is not None:
            verdict = await asyncio.to_thread(selfprobe.verdict)
            if not verdict.ok:
                return _json({**body, "status": "unhealthy", "reason": verdict.reason}, status=503)
            body["probe_ms"] = round(verdict.latency_s * 1000, 3)
        return _json({**body, "status": "ok"})

    def retention_figures() -> tuple[list[dict[str, Any]], dict[tuple[str, str], float]]:
        """Removals by (tenant, class, cause) and the oldest live ages (both safe to read
        from this thread: a locked book, and one LMDB read transaction of its own)."""
        names = service.handler.tenant_names
        ages = {(names.get(t, t.hex()), c): ms / 1000 for (t, c), ms in store.oldest_live().items()}
        return store.removals.snapshot(names), ages

    async def metrics(request: web.Request) -> web.Response:
        text = render_prometheus(
            service.metrics,
            node_id=config.node_id,
            usage=store.usage(service.handler.tenant_names),
            store_counters=dict(store.counters),
            swa_directory=service.handler.swa_directory.stats(),
            scrub=None if service.handler.scrubber is None else service.handler.scrubber.stats(),
        )
        rows, ages = retention_figures()
        text += "\n".join(render_removals(rows, ages, prefix="kvcache_server")) + "\n"
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    def stats_document() -> dict[str, Any]:
        """``/stats``: the handler's counters and usage, and this daemon's watermarks."""
        doc = service.handler.stats()
        doc["watermarks"] = {"high": config.high_watermark, "low": config.low_watermark}
        rows, ages = retention_figures()
        doc["retention"] = {
            "removals": rows,
            "oldest_live_age_s": [
                {"tenant": t, "class": c, "age_s": a} for (t, c), a in sorted(ages.items())
            ],
        }
        return doc

    async def stats(request: web.Request) -> web.Response:
        return _json(stats_document())

    async def get_retention(request: web.Request) -> web.Response:
        return _json(store.policy.to_dict())

    async def put_retention(request: web.Request) -> web.Response:
        body = await _read_json(request)
        try:
            policy = RetentionPolicy.from_mapping(body, source="PUT /retention")
        except ConfigError as exc:
            return _json({"error": str(exc)}, status=400)
        await asyncio.wrap_future(service.submit(lambda: store.set_policy(policy)))
        log.info("retention policy set through the admin API: %s", policy.to_dict())
        return _json(policy.to_dict())

    async def delete_retention(request: web.Request) -> web.Response:
        await asyncio.wrap_future(service.submit(lambda: store.clear_policy(configured_policy)))
        log.info("retention policy reset to the configured one: %s", configured_policy.to_dict())
        return _json(configured_policy.to_dict())

    async def set_clock(request: web.Request) -> web.Response:
        if clock is None:
            raise web.HTTPNotFound()
        body = await _read_json(request)
        fields = body if isinstance(body, dict) else {}
        given = [k for k in ("offset_s", "at_s") if k in fields]
        value = fields.get(given[0]) if len(given) == 1 and len(fields) == 1 else None
        bound = _MAX_HELD_S if given and given[0] == "at_s" else _MAX_OFFSET_S
        low = 0.0 if given and given[0] == "at_s" else -_MAX_OFFSET_S
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or not low <= value <= bound
        ):
            return _json(
                {"error": 'body must be {"offset_s": seconds} (wall time plus that, within '
                 f'{_MAX_OFFSET_S:.0f} s) or {{"at_s": epoch seconds}} (the clock held there, '
                 f'0 to {_MAX_HELD_S:.0f})'},
                status=400,
            )  # fmt: skip
        if given[0] == "at_s":
            clock.frozen_s = float(value)
            log.warning("clock held at %.3f (test override)", clock.frozen_s)
        else:
            clock.offset_s, clock.frozen_s = float(value), None
            log.warning("clock offset set to %.3f s (test override)", clock.offset_s)
        service.wake()  # expiries the jump made due are swept now, not at the next idle poll
        return _json({"offset_s": clock.offset_s, "at_s": clock.frozen_s, "now": clock()})

    async def start_scrub(request: web.Request) -> web.Response:
        scrubber = service.handler.scrubber
        if scrubber is None or not scrubber.enabled:
            return _json(
                {"error": "scrubbing is off on this daemon (scrub_rate_bytes = 0)"}, status=409
            )
        return _json(await asyncio.wrap_future(service.submit(scrubber.start_now)))

    app = web.Application(client_max_size=_JSON_LIMIT)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/stats", stats)
    app.router.add_get("/retention", get_retention)
    app.router.add_put("/retention", guarded(put_retention))
    app.router.add_delete("/retention", guarded(delete_retention))
    app.router.add_post("/scrub", guarded(start_scrub))
    if clock is not None and config.allow_clock_override:
        app.router.add_post("/debug/clock", guarded(set_clock))
    collector = Collector(
        cluster_file=config.cluster_file,
        local=LocalNode(info=_local_node(config), stats=stats_document),
        served_by=config.node_id,
        auth="open" if admin_token is None else "token",
    )
    add_dashboard(
        app, collector, Access(admin_token), lambda: service.metrics.error("admin_unauthorized")
    )
    return app


def _local_node(config: ServerConfig) -> NodeInfo:
    """This daemon as the status page lists it when no cluster file names it."""
    try:
        return NodeInfo(id=config.node_id, data=config.listen)
    except ConfigError:  # a node_id the cluster map would not accept (spaces, ...)
        return NodeInfo(id="this-node", data=config.listen)


class AdminServer:
    """Runs the admin app on its own thread and event loop."""

    def __init__(
        self,
        app: web.Application,
        listen: str,
        *,
        max_connections: int = MAX_ADMIN_CONNECTIONS,
        connection_max_s: float = ADMIN_CONNECTION_MAX_S,
    ) -> None:
        self._app = app
        self._max_connections = max_connections
        self._connection_max_s = connection_max_s
        self._host, self._port = parse_admin_listen(listen)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvcache-admin", daemon=True)
        self._ready = threading.Event()
        self._runner: web.AppRunner | None = None
        self._error: BaseException | None = None
        self._listeners: list[socket.socket] = []
        self._tasks: list[asyncio.Task[None]] = []
        #: Open connections and when each opened (monotonic seconds).
        self._open: dict[asyncio.BaseTransport, float] = {}
        self._warned_at = -math.inf
        #: Connections closed on arrival (too many open), cut at their age, failed accepts.
        self.counters = {"refused": 0, "aged_out": 0, "accept_errors": 0}
        self.url = ""

    def start(self, timeout_s: float = 10.0) -> str:
        """Start serving; returns the base URL (port 0 resolved). Raises if it cannot bind."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise ConfigError(f"admin server did not start within {timeout_s} s")
        if self._error is not None:
            raise ConfigError(
                f"cannot serve admin HTTP on {self._host}:{self._port}: {self._error}"
            ) from self._error
        return self.url

    def stop(self) -> None:
        """Stop serving and join the thread (idempotent)."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._setup())
        except BaseException as exc:  # reported to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            for task in self._tasks:
                task.cancel()
            for listener in self._listeners:
                listener.close()
            if self._runner is not None:
                self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

    async def _setup(self) -> None:
        runner = web.AppRunner(self._app, access_log=None, handle_signals=False)
        await runner.setup()
        self._runner = runner
        # Every address the host resolves to, as aiohttp's own site binds them (a name like
        # localhost may be ::1 and 127.0.0.1); port 0 takes the first one's port for all.
        port = self._port
        seen: set[tuple[Any, ...]] = set()
        infos = socket.getaddrinfo(
            self._host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        for family, kind, proto, _, address in infos:
            if address in seen:
                continue
            seen.add(address)
            listener = socket.socket(family, kind, proto)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                listener.bind((address[0], port, *address[2:]))
                listener.listen(128)
                listener.setblocking(False)
            except OSError:
                listener.close()
                for other in self._listeners:
                    other.close()
                raise
            self._listeners.append(listener)
            port = listener.getsockname()[1]
        host = self._listeners[0].getsockname()[0]
        self.url = f"http://{_url_host(host)}:{port}"
        for listener in self._listeners:
            self._tasks.append(self._loop.create_task(self._accept(listener, runner)))
        self._tasks.append(self._loop.create_task(self._age_out()))

    async def _accept(self, listener: socket.socket, runner: web.AppRunner) -> None:
        """Hand accepted connections to aiohttp, within the bounds (module docstring)."""
        loop = self._loop
        server = runner.server
        assert server is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # out of descriptors, say: the data path needs them more
                self.counters["accept_errors"] += 1
                now = time.monotonic()
                if now - self._warned_at >= _ACCEPT_WARN_EVERY_S:
                    self._warned_at = now
                    log.warning("admin HTTP: accept failed (%s); %d open", exc, len(self._open))
                await asyncio.sleep(0.05)
                continue
            self._open = {t: at for t, at in self._open.items() if not t.is_closing()}
            if len(self._open) >= self._max_connections:
                self.counters["refused"] += 1
                conn.close()
                continue
            try:
                transport, _ = await loop.connect_accepted_socket(server, conn)
            except asyncio.CancelledError:
                conn.close()
                raise
            except Exception as exc:  # the loop must go on: the admin port would hang
                log.warning("admin HTTP: a connection could not be served: %s", exc)
                conn.close()
                continue
            self._open[transport] = time.monotonic()

    async def _age_out(self) -> None:
        """Cut connections open longer than ``connection_max_s``, checked a few times
        within it (one sweep, not a timer a connection: those kept closed connections)."""
        every = max(0.05, self._connection_max_s / 4)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for transport, opened in list(self._open.items()):
                if transport.is_closing():
                    del self._open[transport]
                elif now - opened > self._connection_max_s:
                    self.counters["aged_out"] += 1
                    transport.abort()  # type: ignore[attr-defined]
                    del self._open[transport]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


async def _read_json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise web.HTTPBadRequest(text="body must be JSON") from None


def _json(body: Any, *, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=lambda o: json.dumps(o, sort_keys=True))
