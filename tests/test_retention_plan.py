"""`kvcache retention plan` and `simulate` against real `kvcache up` clusters filled by
replaying a trace.

A half-day trace from the multi-day generator is planned for short TTLs (agent 1 h,
chat 3 h); then two 12-daemon clusters are started with `kvcache up`, one at the
planned capacity and one at half of it, and the trace is replayed through the client
(match, load, store the misses) with every daemon's clock held at the trace's time
(``POST /debug/clock``). With ``--replay-keys`` (expiry ties ordered by the replay's
block keys, as the daemons order them) the plan predicts each replay exactly: the
same hit rate and the same blocks evicted before their TTL (none at the planned
capacity), counted by every daemon. Without it (ties by a stand-in for the keys, all a
trace alone allows) the hit rate is within half a point.
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvcache.cli import main as kvcache_main
from kvcache.client import Client
from kvcache.layout import DType, KVLayout
from kvcache.retention.cli import main as retention_main
from kvcache.retention.policy import RetentionPolicy
from kvcache.retention.tracegen import TraceModel, generate_trace, write_trace
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import (
    TRACE_BLOCK_TOKENS,
    Request,
    payload_for_key,
    read_trace,
    replay_namespace,
    tokens_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

CLASSES = "agent=1h,chat=3h,default=1h"
MODEL = TraceModel(days=0.5, seed=5, agent_rate=2.0, chat_rate=4.0, return_min_s=600,
                   chat_return_max_s=6 * 3600, agent_return_max_s=3 * 3600)  # fmt: skip


def hold_clock(admin: str, token: str, at_s: float) -> None:
    req = urllib.request.Request(
        admin + "/debug/clock",
        data=json.dumps({"at_s": at_s}).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        resp.read()


def replay(cluster: LocalCluster, requests: list[Request], layout: KVLayout) -> dict[str, Any]:
    """The trace through the client, the daemons' clocks at the trace's time; the hit rate
    and the removals the daemons counted."""
    ns = replay_namespace(layout.payload_bytes)
    token = cluster.credentials().admin_token
    assert token is not None
    admins = [n.admin for n in cluster.nodes]
    # Every daemon's clock is held at the trace's time (whole seconds apart from it; the
    # 0.4 ms keeps the float's millisecond from rounding down), so all stamp a request's
    # writes and slides alike, whatever the machine's speed.
    base = math.floor(time.time()) - requests[0].timestamp_ms // 1000 + 0.0004
    hit = total = 0
    # The replay measures retention, not the machine: a loaded CI box must not have the
    # client mark slow daemons down (2 s by default) and lose stores and hits for it.
    with Client(cluster.client_config(timeout_s=30.0)) as client:
        for req in requests:
            for admin in admins:
                hold_clock(admin, token, base + req.timestamp_ms / 1000)
            tokens = tokens_for(req)
            match = client.match_prefix(ns, tokens)
            result = client.load(ns, match, traffic_class=req.traffic_class)
            missing = match.keys[result.blocks :]
            if missing:
                client.store(ns, tokens, [payload_for_key(k, layout.payload_bytes) for k in missing],
                             traffic_class=req.traffic_class, first_block=result.blocks)  # fmt: skip
            hit += min(result.blocks * TRACE_BLOCK_TOKENS, req.input_length)
            total += req.input_length
    removed: dict[str, int] = {}
    evicted_by_node = []
    for stats in cluster.node_stats():
        evicted_by_node.append(0)
        for row in stats["retention"]["removals"]:
            removed[row["cause"]] = removed.get(row["cause"], 0) + row["shards"]
            if row["cause"] == "evicted":
                evicted_by_node[-1] += row["shards"]
    return {"hit_rate": hit / total, "removed": removed, "evicted_by_node": evicted_by_node}


def up(root: Path, capacity: int, monkeypatch: pytest.MonkeyPatch) -> LocalCluster:
    monkeypatch.setenv("KVCACHE_SERVER_ALLOW_CLOCK_OVERRIDE", "true")
    monkeypatch.setenv("KVCACHE_RETENTION_CLASSES", CLASSES)
    monkeypatch.setenv("KVCACHE_RETENTION_DEFAULT_CLASS", "default")
    assert (
        kvcache_main(["up", "--dir", str(root), "--nodes", "12", "--capacity", str(capacity)]) == 0
    )
    return LocalCluster.attach(root)


def test_plan_against_real_clusters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    write_trace(generate_trace(MODEL), trace)
    requests = list(read_trace(trace))
    assert 150 <= len(requests) <= 600
    # A block size that puts half the planned capacity above a daemon's 1 MiB minimum.
    from kvcache.retention.plan import plan_capacity

    probe = plan_capacity(requests, RetentionPolicy.from_mapping({"classes": CLASSES}),
                          block_bytes=1 << 15)  # fmt: skip
    bytes_per_token = max(64, math.ceil((1.3 * 2**21 / probe.capacity_blocks) * 10 / 512 / 64) * 64)
    layout = KVLayout(tokens_per_block=TRACE_BLOCK_TOKENS, bytes_per_token=bytes_per_token,
                      dtype=DType.BFLOAT16, layers_in_block=1)  # fmt: skip
    block_bytes = str(layout.payload_bytes)

    def plan_json(*extra: str) -> dict[str, Any]:
        assert retention_main(["plan", "--trace", str(trace), "--classes", CLASSES, "--json",
                               "--block-bytes", block_bytes, *extra]) == 0  # fmt: skip
        out: dict[str, Any] = json.loads(capsys.readouterr().out)
        return out

    plan = plan_json("--replay-keys")  # ties ordered by the keys the replay below writes
    stand_in = plan_json()  # by a stand-in for them, all a trace alone allows
    [at75, at50] = plan["points"]
    assert at50["evicted_before_ttl"] > 0 and at50["node_bytes"] >= 1 << 20
    assert at50["hit_rate_lost_pp"] >= at75["hit_rate_lost_pp"] >= 0
    assert stand_in["capacity_blocks"] == plan["capacity_blocks"]
    # The text form says the same.
    assert retention_main(["plan", "--trace", str(trace), "--classes", CLASSES,
                           "--block-bytes", block_bytes, "--replay-keys"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert f"{plan['capacity_blocks']:,} blocks" in text and "at 50%" in text
    # `simulate` at the half capacity is the plan's 50 % point.
    assert retention_main(["simulate", "--trace", str(trace), "--classes", CLASSES, "--json",
                           "--block-bytes", block_bytes, "--replay-keys",
                           "--capacity-blocks", str(at50["capacity_blocks"])]) == 0  # fmt: skip
    [simulated] = json.loads(capsys.readouterr().out)["results"]
    assert (simulated["hit_rate"], simulated["evicted_before_ttl"]) == (
        at50["hit_rate"], at50["evicted_before_ttl"])  # fmt: skip

    full = up(tmp_path / "full", plan["node_bytes"], monkeypatch)
    try:
        got = replay(full, requests, layout)
    finally:
        full.stop()
    assert got["removed"].get("evicted", 0) == 0, got
    assert got["hit_rate"] == plan["hit_rate"], (got, plan["hit_rate"])

    half = up(tmp_path / "half", at50["node_bytes"], monkeypatch)
    try:
        got50 = replay(half, requests, layout)
    finally:
        half.stop()
    lost = 100 * (got["hit_rate"] - got50["hit_rate"])
    print(f"\nplan: {plan['capacity_blocks']} blocks, {plan['node_bytes']} B a node, hit "
          f"{plan['hit_rate']:.4f}; cluster at plan: hit {got['hit_rate']:.4f}, removed "
          f"{got['removed']}; at 50 %: plan hit {at50['hit_rate']:.4f}, lost "
          f"{at50['hit_rate_lost_pp']:.2f} pp, {at50['evicted_before_ttl']} blocks evicted "
          f"early (stand-in ties: hit {stand_in['points'][1]['hit_rate']:.4f}, "
          f"{stand_in['points'][1]['evicted_before_ttl']} evicted); cluster hit "
          f"{got50['hit_rate']:.4f}, lost {lost:.2f} pp, removed {got50['removed']}, "
          f"evicted shards by node {got50['evicted_by_node']}")  # fmt: skip
    # Issue 20: the simulator predicts the daemons exactly. Every daemon holds one shard of
    # every block (12 shards, 12 daemons), so each evicted exactly the blocks the plan did.
    assert got50["hit_rate"] == at50["hit_rate"], (got50, at50)
    assert got50["evicted_by_node"] == [at50["evicted_before_ttl"]] * 12, (got50, at50)
    # Without the keys, the hit rates are within half a point at both capacities.
    assert abs(stand_in["hit_rate"] - got["hit_rate"]) <= 0.005, (stand_in, got)
    assert abs(stand_in["points"][1]["hit_rate"] - got50["hit_rate"]) <= 0.005, (stand_in, got50)
