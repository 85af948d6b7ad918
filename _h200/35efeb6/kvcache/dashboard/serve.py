"""Serving the status page on its own (``kvcache dashboard``), away from any daemon."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from aiohttp import web

from kvcache.dashboard.auth import Access
from kvcache.dashboard.collector import Collector
from kvcache.dashboard.config import DashboardConfig
from kvcache.dashboard.web import PREFIX, add_dashboard
from kvcache.errors import ConfigError
from kvcache.server.config import parse_admin_listen

__all__ = ["build_dashboard_app", "serve_dashboard"]

log = logging.getLogger(__name__)


def build_dashboard_app(config: DashboardConfig) -> web.Application:
    """The stand-alone app: the page under ``/dashboard``, ``/`` redirecting to it, and
    ``/healthz``."""
    token = config.admin_token()
    collector = Collector(
        cluster_file=config.cluster_file,
        refresh_s=config.refresh_s,
        timeout_s=config.timeout_s,
        auth="open" if token is None else "token",
    )
    app = web.Application(client_max_size=64 << 10)
    add_dashboard(app, collector, Access(token))

    async def root(request: web.Request) -> web.Response:
        return web.Response(status=302, headers={"Location": f"{PREFIX}/"})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.router.add_get("/", root)
    app.router.add_get("/healthz", healthz)
    return app


async def _serve(config: DashboardConfig, on_ready: Callable[[str], None]) -> None:
    app = build_dashboard_app(config)
    host, port = parse_admin_listen(config.listen)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(f"cannot serve the status page on {config.listen}: {exc}") from None
        bound_host, bound_port = runner.addresses[0][:2]
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        on_ready(f"http://{shown}:{bound_port}{PREFIX}/")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("status page stopping")
    finally:
        await runner.cleanup()


def serve_dashboard(config: DashboardConfig, on_ready: Callable[[str], None]) -> None:
    """Serve until SIGINT or SIGTERM; ``on_ready`` gets the page's URL once bound."""
    asyncio.run(_serve(config, on_ready))
