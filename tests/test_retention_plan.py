"""`kvcache retention plan` against real `kvcache up` clusters filled by replaying a trace.

A half-day trace from the multi-day generator is planned for short TTLs (agent 1 h,
chat 3 h); then two 12-daemon clusters are started with `kvcache up`, one at the
planned capacity and one at half of it, and the trace is replayed through the client
(match, load, store the misses) with every daemon's clock stepped to the trace's time
(``POST /debug/clock``). At the planned capacity no daemon evicts a shard before its
TTL and the hit rate is the plan's; at half of it evictions before TTL happen, are
counted by every daemon, and the hit rate lost matches the plan within a point.
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
from kvcache.keys import Namespace
from kvcache.layout import DType, KVLayout
from kvcache.retention.cli import main as retention_main
from kvcache.retention.policy import RetentionPolicy
from kvcache.retention.tracegen import TraceModel, generate_trace, write_trace
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import TRACE_BLOCK_TOKENS, Request, payload_for_key, read_trace, tokens_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

CLASSES = "agent=1h,chat=3h,default=1h"
MODEL = TraceModel(days=0.5, seed=5, agent_rate=2.0, chat_rate=4.0, return_min_s=600,
                   chat_return_max_s=6 * 3600, agent_return_max_s=3 * 3600)  # fmt: skip


def post_clock(admin: str, token: str, offset_s: float) -> None:
    req = urllib.request.Request(
        admin + "/debug/clock",
        data=json.dumps({"offset_s": offset_s}).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        resp.read()


def replay(cluster: LocalCluster, requests: list[Request], layout: KVLayout) -> dict[str, Any]:
    """The trace through the client, the daemons' clocks at the trace's time; the hit rate
    and the removals the daemons counted."""
    ns = Namespace(model="plan", revision="1", layout=layout)
    token = cluster.credentials().admin_token
    assert token is not None
    admins = [n.admin for n in cluster.nodes]
    base = time.time() - requests[0].timestamp_ms / 1000
    hit = total = 0
    # The replay measures retention, not the machine: a loaded CI box must not have the
    # client mark slow daemons down (2 s by default) and lose stores and hits for it.
    with Client(cluster.client_config(timeout_s=30.0)) as client:
        for req in requests:
            offset = base + req.timestamp_ms / 1000 - time.time()
            for admin in admins:
                post_clock(admin, token, offset)
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
    for stats in cluster.node_stats():
        for row in stats["retention"]["removals"]:
            removed[row["cause"]] = removed.get(row["cause"], 0) + row["shards"]
    return {"hit_rate": hit / total, "removed": removed}


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
    assert retention_main(["plan", "--trace", str(trace), "--classes", CLASSES, "--json",
                           "--block-bytes", str(layout.payload_bytes)]) == 0  # fmt: skip
    plan = json.loads(capsys.readouterr().out)
    [at75, at50] = plan["points"]
    assert at50["evicted_before_ttl"] > 0 and at50["node_bytes"] >= 1 << 20
    assert at50["hit_rate_lost_pp"] >= at75["hit_rate_lost_pp"] >= 0
    # The text form says the same.
    assert retention_main(["plan", "--trace", str(trace), "--classes", CLASSES,
                           "--block-bytes", str(layout.payload_bytes)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert f"{plan['capacity_blocks']:,} blocks" in text and "at 50%" in text

    full = up(tmp_path / "full", plan["node_bytes"], monkeypatch)
    try:
        got = replay(full, requests, layout)
    finally:
        full.stop()
    assert got["removed"].get("evicted", 0) == 0, got
    assert abs(got["hit_rate"] - plan["hit_rate"]) <= 0.005, (got, plan["hit_rate"])

    half = up(tmp_path / "half", at50["node_bytes"], monkeypatch)
    try:
        got50 = replay(half, requests, layout)
    finally:
        half.stop()
    assert got50["removed"].get("evicted", 0) > 0, got50
    lost = 100 * (got["hit_rate"] - got50["hit_rate"])
    print(f"\nplan: {plan['capacity_blocks']} blocks, {plan['node_bytes']} B a node, hit "
          f"{plan['hit_rate']:.4f}; cluster at plan: hit {got['hit_rate']:.4f}, removed "
          f"{got['removed']}; at 50 %: plan lost {at50['hit_rate_lost_pp']:.2f} pp, "
          f"{at50['evicted_before_ttl']} blocks evicted early; cluster lost {lost:.2f} pp, "
          f"removed {got50['removed']}")  # fmt: skip
    # Issue 20's target is 1 pp. The replay used to drift with the machine's load, 0.35 pp
    # alone to 2.6 pp beside a busy core: a drain to the low watermark waited for the
    # daemons' next maintenance, so the next requests sometimes found, and slid, shards it
    # was about to take. The loop now drains a batch right after the crossing PUT is
    # answered (ShardStore.drain_after_crossing), and beside a busy core the replay gave
    # 9.00 pp against the plan's 8.69 in every run; 7.99 since loads refresh the shards
    # they do not ask for (GET_REFRESHED) and evictions interleave classes by expiry.
    tolerance = 1.0
    assert abs(lost - at50["hit_rate_lost_pp"]) <= tolerance, (lost, at50)
