"""`kvcache up` / `status` / `down` as a user runs them, and the demo's JSON summary."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvcache.cli import main
from kvcache.client import Client, ClientConfig
from kvcache.cluster import ClusterMap
from kvcache.keys import Namespace, block_keys
from kvcache.layout import REFERENCE_LAYOUT
from kvcache.workload import payload_for_key


def test_up_status_down(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "local"
    assert (
        main(
            [
                "--log-level",
                "WARNING",
                "up",
                "--dir",
                str(root),
                "--nodes",
                "12",
                "--capacity",
                "64MiB",
            ]
        )
        == 0
    )
    try:
        space = Namespace(model="cli", revision="1", layout=REFERENCE_LAYOUT)
        tokens = np.arange(REFERENCE_LAYOUT.tokens_per_block * 3, dtype=np.uint32)
        assert (root / "credentials.toml").stat().st_mode & 0o777 == 0o600
        with Client(ClientConfig.load(root / "client.toml")) as client:
            client.store(
                space,
                tokens,
                [payload_for_key(k, 114688) for k in block_keys(space, tokens)],
                traffic_class="agent",
            )
            assert client.load_prefix(space, tokens, traffic_class="agent").blocks == 3
        capsys.readouterr()
        assert main(["status", "--dir", str(root)]) == 0
        out = capsys.readouterr().out
        rows = [line for line in out.splitlines() if line.startswith("node-")]
        assert len(rows) == 12 and all(" yes " in r for r in rows)
        assert all("agent: 3 / " in r for r in rows)  # each node holds one shard of each block
        hits = sum(int(r.rsplit("/ ", 1)[1]) for r in rows)
        assert hits >= 30  # at least k shards served per block
        served = 0
        for node in ClusterMap.load(root / "cluster.toml").nodes:
            with urllib.request.urlopen(f"{node.admin}/metrics", timeout=5) as resp:
                for line in resp.read().decode().splitlines():
                    if line.startswith('kvcache_server_hits_total{kind="get",class="agent"}'):
                        served += int(float(line.split()[-1]))
        assert served == hits
    finally:
        assert main(["down", "--dir", str(root)]) == 0
    assert main(["status", "--dir", str(root)]) == 1


def test_demo_writes_a_verified_summary(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    assert (
        main(
            [
                "--log-level",
                "WARNING",
                "demo",
                "--limit",
                "12",
                "--nodes",
                "12",
                "--json",
                str(out),
                "--capacity",
                "256MiB",
            ]
        )
        == 0
    )
    summary = json.loads(out.read_text())
    for key in (
        "hit_rate",
        "ideal_hit_rate",
        "wrong_bytes",
        "load_gbps",
        "load_p50_ms",
        "load_p99_ms",
        "requests",
    ):
        assert key in summary
    assert summary["requests"] == 12
    assert summary["wrong_bytes"] == 0
    assert summary["hit_rate"] == pytest.approx(summary["ideal_hit_rate"])
    assert summary["hit_tokens"] > 0


def test_demo_rejects_a_bad_fault(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--fault", "explode:1", "--limit", "1"]) == 1
    assert "--fault must be" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["server", "--data-dir", "{file}"], "not a directory"),
        (["server", "--data-dir", "{file}/sub"], "not a directory"),
        (["server", "--data-dir", "/proc/kvcache-test"], "data directory"),
        (["server", "--data-dir", "{dir}/d", "--capacity", "1e30"], "capacity"),
        (["server", "--data-dir", "{dir}/d", "--capacity", "9999999TiB"], "out of range"),
        (["server", "--data-dir", "{dir}/d", "--listen", "udp://x"], "listen"),
        (["server", "--data-dir", "{dir}/d", "--credentials", "{dir}/none.toml"], "does not exist"),
        (["server", "--config", "{dir}/missing.toml"], "does not exist"),
        (["up", "--dir", "{file}"], "not a directory"),
        (["status", "--dir", "{dir}/nowhere"], "no local cluster"),
        (["down", "--dir", "{dir}/nowhere"], "no local cluster"),
    ],
)
def test_user_mistakes_get_a_message_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    file = tmp_path / "a-file"
    file.write_text("x")
    argv = [a.format(file=file, dir=tmp_path) for a in args]
    assert main(["--log-level", "ERROR", *argv]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert needle in err


def test_credentials_readable_by_others_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcache.credentials import Credentials

    path = Credentials.generate().write(tmp_path / "creds.toml")
    path.chmod(0o644)
    argv = ["server", "--data-dir", str(tmp_path / "d"), "--credentials", str(path)]
    assert main(["--log-level", "ERROR", *argv]) == 1
    assert "chmod 600" in capsys.readouterr().err


def test_down_signals_only_our_daemons_and_restart_keeps_settings(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from kvcache.testing.localcluster import LocalCluster

    cluster = LocalCluster(tmp_path / "c").start(nodes=2, capacity="96MiB")
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # Restart keeps every flag: capacity and credentials included.
        cluster.kill(1)
        cluster.restart(1)
        stats = cluster.node_stats()
        assert all(s["up"] and s["usage"]["capacity_bytes"] == 96 << 20 for s in stats)
        # A stale record pointing at another program's pid: down must leave it alone.
        records = json.loads((tmp_path / "c" / "nodes.json").read_text())
        records["node-00"]["pid"] = bystander.pid
        (tmp_path / "c" / "nodes.json").write_text(json.dumps(records))
        assert main(["--log-level", "ERROR", "down", "--dir", str(tmp_path / "c")]) == 0
        assert bystander.poll() is None  # still running
    finally:
        bystander.kill()
        bystander.wait()
        cluster.stop()
