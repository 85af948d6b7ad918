"""The status page over HTTP against real daemons: access, assets, polling, ``kvcache dashboard``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.cookies import SimpleCookie
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from server_fixtures import DaemonProcess, http, wait_until

from kvcache.cluster import ClusterMap, NodeInfo
from kvcache.credentials import Credentials
from kvcache.dashboard import Collector
from kvcache.dashboard.auth import COOKIE_NAME
from kvcache.testing.localcluster import LocalCluster, free_ports


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def fetch(
    url: str,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    form: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body), redirects not followed."""
    data = urllib.parse.urlencode(form).encode() if form is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with _OPENER.open(request, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def session_cookie(headers: dict[str, str]) -> SimpleCookie:
    cookie: SimpleCookie = SimpleCookie()
    cookie.load(headers["Set-Cookie"])
    return cookie


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("dash-daemon")) as d:
        yield d


def test_page_and_data_need_the_token_and_the_cookie_opens_only_them(
    daemon: DaemonProcess,
) -> None:
    base, token = daemon.admin + "/dashboard", daemon.admin_token

    def refused() -> int:
        return int(daemon.stats()["errors"].get("admin_unauthorized", 0))

    before = refused()
    status, headers, _ = fetch(base)
    assert status == 302 and headers["Location"] == "/dashboard/"
    status, headers, body = fetch(base + "/")
    assert status == 401 and b'id="login"' in body and b"test-node" not in body
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert refused() == before  # the login page a first visit gets is not a refusal
    status, _, body = fetch(base + "/api/cluster")
    assert status == 401 and b"test-node" not in body
    assert fetch(base + "/?token=" + "0" * 64)[0] == 401
    assert fetch(base + "/login", method="POST", form={"token": "0" * 64})[0] == 401
    assert refused() == before + 3  # the data without access and both wrong tokens
    assert fetch(base + "/", headers={"Authorization": f"Bearer {token}"})[0] == 200

    status, headers, _ = fetch(base + "/login", method="POST", form={"token": token})
    assert status == 303 and headers["Location"] == "/dashboard/"
    cookie = session_cookie(headers)[COOKIE_NAME]
    assert cookie.value and token not in cookie.value
    assert cookie["httponly"] and cookie["samesite"] == "Strict" and cookie["path"] == "/dashboard/"
    status, headers, _ = fetch(base + "/?token=" + urllib.parse.quote(token))
    assert status == 303 and session_cookie(headers)[COOKIE_NAME].value == cookie.value

    with_cookie = {"Cookie": f"{COOKIE_NAME}={cookie.value}"}
    status, _, body = fetch(base + "/", headers=with_cookie)
    assert status == 200 and b'id="nodes"' in body
    status, headers, body = fetch(base + "/api/cluster", headers=with_cookie)
    assert status == 200 and headers["Cache-Control"] == "no-store"
    view = json.loads(body)
    assert [n["id"] for n in view["nodes"]] == ["test-node"]
    assert view["nodes"][0]["health"] == "healthy" and view["auth"] == "token"
    assert view["cluster"]["source"].startswith("this node only")
    # The cookie is for the page: admin changes still need the token itself.
    status, _, _ = fetch(daemon.admin + "/retention", method="PUT", headers=with_cookie)
    assert status == 401
    status, headers, _ = fetch(base + "/logout", method="POST", headers=with_cookie)
    assert status == 303 and session_cookie(headers)[COOKIE_NAME].value == ""


def test_assets_are_served_from_the_package_and_name_nothing_outside(
    daemon: DaemonProcess,
) -> None:
    static = resources.files("kvcache.dashboard") / "static"
    names = sorted(p.name for p in static.iterdir() if p.is_file())
    assert names == ["dashboard.css", "dashboard.js", "favicon.svg", "index.html", "login.html"]
    for name in names:
        text = (static / name).read_text()
        # No CDN, no web fonts: no absolute URL other than the SVG namespace.
        urls = set(re.findall(r"https?://[^\s\"')]+", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, (name, urls)
        assert "@import" not in text and "@font-face" not in text
    status, headers, body = fetch(daemon.admin + "/dashboard/static/dashboard.js")
    assert status == 200 and headers["Content-Type"].startswith("text/javascript")
    assert body == (static / "dashboard.js").read_bytes()
    assert (
        fetch(
            daemon.admin + "/dashboard/static/dashboard.js",
            headers={"If-None-Match": headers["ETag"]},
        )[0]
        == 304
    )
    assert fetch(daemon.admin + "/dashboard/static/credentials.toml")[0] == 404
    assert fetch(daemon.admin + "/dashboard/static/..%2Fweb.py")[0] == 404
    # The page's own references resolve under /dashboard/.
    page = (static / "index.html").read_text()
    for ref in re.findall(r'(?:src|href)="([^"]+)"', page):
        assert fetch(urllib.parse.urljoin(daemon.admin + "/dashboard/", ref))[0] == 200, ref


def test_stats_carry_watermarks_and_latency_histograms(daemon: DaemonProcess) -> None:
    stats = daemon.stats()
    assert stats["watermarks"] == {"high": 0.9, "low": 0.8}
    latency = stats["latency"]
    assert len(latency["ops"]["get"]["buckets"]) == len(latency["bounds_s"]) + 1
    assert stats["misses"] == {"get": {}, "touch": {}}


def test_without_an_admin_token_the_page_is_open_and_says_so(tmp_path: Path) -> None:
    creds = Credentials(tenants=Credentials.generate().tenants)
    with DaemonProcess(tmp_path, credentials=creds) as d:
        status, _, body = fetch(d.admin + "/dashboard/api/cluster")
        assert status == 200 and json.loads(body)["auth"] == "open"


def test_collector_rereads_the_map_and_marks_dead_nodes(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    (closed,) = free_ports(1)  # nothing listens here
    live = NodeInfo(id="test-node", data=daemon.data, admin=daemon.admin, domain="rack-1")
    dead = NodeInfo(id="gone", data="tcp://127.0.0.1:1", admin=f"http://127.0.0.1:{closed}")
    path = tmp_path / "cluster.toml"
    path.write_text(ClusterMap(epoch=1, nodes=(live, dead)).to_toml())
    now = [1000.0]
    collector = Collector(cluster_file=path, clock=lambda: now[0], timeout_s=2.0)

    async def scenario() -> tuple[dict[str, Any], ...]:
        try:
            first, again = await asyncio.gather(collector.view(), collector.view())
            path.write_text(ClusterMap(epoch=2, nodes=(live,)).to_toml())
            cached = await collector.view()  # within half a refresh: no new poll
            now[0] += 5.0
            fresh = await collector.view()
            path.write_text("not toml [")
            now[0] += 5.0
            broken = await collector.view()
            return first, again, cached, fresh, broken
        finally:
            await collector.close()

    first, again, cached, fresh, broken = asyncio.run(scenario())
    assert first is again is cached  # one poll served all three
    health = {n["id"]: n["health"] for n in first["nodes"]}
    assert health == {"test-node": "healthy", "gone": "unreachable"}
    assert "connection refused" in first["nodes"][1]["error"]
    assert first["nodes"][0]["domain"] == "rack-1"
    assert [n["id"] for n in fresh["nodes"]] == ["test-node"] and fresh["cluster"]["epoch"] == 2
    assert fresh["window"]["seconds"] == 5.0
    assert broken["cluster"]["error"] and broken["nodes"] == []


@pytest.fixture
def dashboard_process() -> Iterator[Callable[..., tuple[subprocess.Popen[str], str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvcache.cli", "dashboard", "--listen", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        started.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the process prints its URL once it is bound
        match = re.search(r"(http://\S+/dashboard/)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        return proc, match.group(1)

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_kvcache_dashboard_serves_a_cluster(
    cluster_factory: Callable[..., LocalCluster],
    dashboard_process: Callable[..., tuple[subprocess.Popen[str], str]],
) -> None:
    cluster = cluster_factory(nodes=3)
    token = cluster.credentials().admin_token
    proc, url = dashboard_process("--dir", str(cluster.root), "--refresh", "0.5")
    assert fetch(url + "api/cluster")[0] == 401
    status, _, body = fetch(url + "api/cluster", headers={"Authorization": f"Bearer {token}"})
    view = json.loads(body)
    assert status == 200 and view["refresh_ms"] == 500 and view["served_by"] == "kvcache dashboard"
    assert [n["health"] for n in view["nodes"]] == ["healthy"] * 3
    root = url.removesuffix("dashboard/")
    assert fetch(root)[1]["Location"] == "/dashboard/" and http("GET", root + "healthz")[0] == 200
    cluster.kill(1)

    def node_1_down() -> bool:
        body = fetch(url + "api/cluster", headers={"Authorization": f"Bearer {token}"})[2]
        return json.loads(body)["nodes"][1]["health"] == "unreachable"

    wait_until(node_1_down, timeout_s=10, what="node-01 unreachable on the page")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


def test_kvcache_dashboard_refuses_to_serve_without_a_token(tmp_path: Path) -> None:
    cluster_file = tmp_path / "cluster.toml"
    cluster_file.write_text(
        ClusterMap(epoch=1, nodes=(NodeInfo(id="a", data="tcp://h:1"),)).to_toml()
    )
    env = {k: v for k, v in os.environ.items() if k != "KVCACHE_ADMIN_TOKEN"}
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "dashboard", "--cluster", str(cluster_file)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 1
    assert "needs the admin token" in result.stderr and "Traceback" not in result.stderr


def test_kvcache_dashboard_no_auth_is_open(
    tmp_path: Path, dashboard_process: Callable[..., tuple[subprocess.Popen[str], str]]
) -> None:
    cluster_file = tmp_path / "cluster.toml"
    (closed,) = free_ports(1)
    node = NodeInfo(id="a", data="tcp://127.0.0.1:1", admin=f"http://127.0.0.1:{closed}")
    cluster_file.write_text(ClusterMap(epoch=1, nodes=(node,)).to_toml())
    _, url = dashboard_process("--cluster", str(cluster_file), "--no-auth")
    status, _, body = fetch(url + "api/cluster")
    view = json.loads(body)
    assert status == 200 and view["auth"] == "open"
    assert view["nodes"][0]["health"] == "unreachable"
