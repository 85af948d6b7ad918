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
        tokens = np.arange(512 * 3, dtype=np.uint32)
        with Client(ClientConfig(cluster_file=root / "cluster.toml")) as client:
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
