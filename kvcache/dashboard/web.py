"""The status page's HTTP routes (aiohttp), mounted on a daemon's admin app or on
``kvcache dashboard``'s own.

Under ``/dashboard``: ``/`` the page (or a login form, 401), ``POST login`` and
``POST logout``, ``api/cluster`` the page's JSON (401 without the token),
``static/<file>`` its CSS, JS and icon. Everything the page loads comes from
these routes: a Content-Security-Policy of ``'self'`` forbids anything else, so
it works on a host with no internet and leaks nothing to one.
"""

from __future__ import annotations

import hashlib
import html
import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from aiohttp import web

from kvcache.dashboard.auth import COOKIE_NAME, Access
from kvcache.dashboard.collector import Collector

__all__ = ["PREFIX", "add_dashboard"]

PREFIX = "/dashboard"
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_TYPES = {
    ".html": "text/html",
    ".css": "text/css",
    ".js": "text/javascript",
    ".svg": "image/svg+xml",
}
_FORM_LIMIT = 4096


@dataclass(frozen=True, slots=True)
class _Asset:
    body: bytes
    content_type: str
    etag: str


def _load_assets() -> dict[str, _Asset]:
    """Every file of the package's ``static/`` folder, read once."""
    assets = {}
    for entry in (resources.files("kvcache.dashboard") / "static").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in _TYPES:
            body = entry.read_bytes()
            etag = '"' + hashlib.sha256(body).hexdigest()[:16] + '"'
            assets[entry.name] = _Asset(body, _TYPES[suffix], etag)
    return assets


def _secure(resp: web.StreamResponse, *, cache: str = "no-store") -> web.StreamResponse:
    resp.headers["Content-Security-Policy"] = _CSP
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "no-referrer"
    resp.headers["Cache-Control"] = cache
    return resp


def add_dashboard(
    app: web.Application,
    collector: Collector,
    access: Access,
    refused: Callable[[], None] | None = None,
) -> None:
    """Add the status page's routes to ``app`` (and close the collector with it).
    ``refused`` is called for each wrong token, and each data request without access (not
    for the login page a first visit gets): the daemon counts them as admin_unauthorized."""

    def refuse() -> None:
        if refused is not None:
            refused()

    assets = _load_assets()
    index = assets["index.html"].body
    login_template = assets["login.html"].body.decode()

    def login_page(message: str, status: int = 401) -> web.StreamResponse:
        body = login_template.replace("<!--MESSAGE-->", html.escape(message))
        return _secure(web.Response(text=body, content_type="text/html", status=status))

    def logged_in() -> web.StreamResponse:
        resp = _redirect(303)
        resp.set_cookie(
            COOKIE_NAME,
            access.cookie(),
            path=f"{PREFIX}/",
            httponly=True,
            samesite="Strict",
        )
        return _secure(resp)

    async def redirect(request: web.Request) -> web.StreamResponse:
        return _secure(_redirect(302))

    async def page(request: web.Request) -> web.StreamResponse:
        token = request.query.get("token")
        if token is not None:
            if access.token_ok(token):
                return logged_in()
            refuse()
            return login_page("That is not the admin token.")
        if not access.allows(request.headers, request.cookies):
            return login_page("")
        return _secure(web.Response(body=index, content_type="text/html", charset="utf-8"))

    async def login(request: web.Request) -> web.StreamResponse:
        if (request.content_length or 0) > _FORM_LIMIT:
            return login_page("Request too large.", status=413)
        form = await request.post()
        token = form.get("token")
        if isinstance(token, str) and access.token_ok(token.strip()):
            return logged_in()
        refuse()
        return login_page("That is not the admin token.")

    async def logout(request: web.Request) -> web.StreamResponse:
        resp = _redirect(303)
        resp.del_cookie(COOKIE_NAME, path=f"{PREFIX}/")
        return _secure(resp)

    async def api(request: web.Request) -> web.StreamResponse:
        if not access.allows(request.headers, request.cookies):
            refuse()
            return _secure(_json({"error": "the status page needs the admin token"}, status=401))
        return _secure(_json(await collector.view()))

    async def static(request: web.Request) -> web.StreamResponse:
        asset = assets.get(request.match_info["name"])
        if asset is None:
            raise web.HTTPNotFound()
        if request.headers.get("If-None-Match") == asset.etag:
            return _secure(web.Response(status=304, headers={"ETag": asset.etag}), cache="no-cache")
        resp = web.Response(body=asset.body, content_type=asset.content_type)
        resp.headers["ETag"] = asset.etag
        return _secure(resp, cache="no-cache")

    async def close_collector(app: web.Application) -> None:
        await collector.close()

    app.router.add_get(PREFIX, redirect)
    app.router.add_get(f"{PREFIX}/", page)
    app.router.add_post(f"{PREFIX}/login", login)
    app.router.add_post(f"{PREFIX}/logout", logout)
    app.router.add_get(f"{PREFIX}/api/cluster", api)
    app.router.add_get(f"{PREFIX}/static/{{name}}", static)
    app.on_cleanup.append(close_collector)


def _redirect(status: int) -> web.Response:
    return web.Response(status=status, headers={"Location": f"{PREFIX}/"})


def _json(body: Any, *, status: int = 200) -> web.Response:
    return web.json_response(body, status=status, dumps=lambda o: json.dumps(o, sort_keys=True))
