"""Retention hints end to end: a client's per-request class, TTL and pin, on every daemon of a
real cluster; the pin quota; a pin that survives a daemon restart."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from retention_fixtures import shard_retention

from kvcache.client import Client
from kvcache.credentials import Credentials, TenantCredentials
from kvcache.errors import ArgumentError
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.retention import Hint
from kvcache.retention.decide import write_expiry
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key

LAYOUT = KVLayout(tokens_per_block=64, bytes_per_token=256, dtype=DType.BFLOAT16, layers_in_block=1)
NS = Namespace(model="hints", revision="1", layout=LAYOUT)
DAY_MS = 86_400_000
PIN_QUOTA = 40_000  # bytes per node: a few blocks' shards


def prompt(blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, blocks * 64).astype(np.uint32)


def payloads(tokens: np.ndarray) -> list[np.ndarray]:
    return [payload_for_key(k, LAYOUT.payload_bytes) for k in block_keys(NS, tokens)]


def expiries_once_slid(cluster: LocalCluster, tokens: np.ndarray, least_ms: int) -> list[int]:
    """Every live shard's expiry of ``tokens``' blocks, once all are at least ``least_ms``
    or 20 s passed. Hits are written by each daemon's touch flusher (within
    touch_flush_s), so a slide shows a little after the load."""
    deadline = time.monotonic() + 20
    while True:
        held = shard_retention(cluster, block_keys(NS, tokens))
        expiries = [e for shards in held.values() for _, e, _ in shards]
        if min(expiries) >= least_ms or time.monotonic() > deadline:
            return expiries
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    creds = Credentials(
        tenants=(
            TenantCredentials(
                name="default", secret=secrets.token_bytes(32), pin_quota_bytes=PIN_QUOTA
            ),
        ),
        admin_token=secrets.token_hex(32),
    )
    c = LocalCluster(tmp_path_factory.mktemp("hints")).start(
        nodes=6, capacity="64MiB", credentials=creds
    )
    yield c
    c.stop()


def test_two_requests_of_different_classes_keep_their_own_expiries(cluster: LocalCluster) -> None:
    a, b = prompt(3, 1), prompt(3, 2)
    with Client(cluster.client_config()) as client:
        before = int(time.time() * 1000)
        client.store(NS, a, payloads(a), hint=Hint(traffic_class="agent", ttl_s=3600))
        client.store(NS, b, payloads(b), hint=Hint(traffic_class="chat"))
        after = int(time.time() * 1000)
    held = shard_retention(cluster, [*block_keys(NS, a), *block_keys(NS, b)])
    for key in block_keys(NS, a):
        shards = held[key]
        assert len(shards) == 12
        for _node, expiry, cls in shards:
            assert cls == "agent"
            assert before + 3_600_000 <= expiry <= write_expiry(after, 3600)
    for key in block_keys(NS, b):
        shards = held[key]
        assert len(shards) == 12
        for _node, expiry, cls in shards:
            assert cls == "chat"
            assert before + 7 * DAY_MS <= expiry <= write_expiry(after, 7 * DAY_MS // 1000)


def test_store_false_writes_nothing_and_a_bad_hint_is_a_clear_error(cluster: LocalCluster) -> None:
    c = prompt(2, 3)
    with Client(cluster.client_config()) as client:
        assert client.store(NS, c, payloads(c), hint=Hint(store=False)).written == 0
        assert client.match_prefix(NS, c).hit_blocks == 0
        with pytest.raises(ArgumentError, match="unknown field"):
            Hint.from_mapping({"ttll": "1h"})
        with pytest.raises(ArgumentError, match="hint must be"):
            client.store(NS, c, payloads(c), hint={"pin": True})  # type: ignore[arg-type]


def test_pins_are_held_within_the_pin_quota_and_survive_a_restart(cluster: LocalCluster) -> None:
    pinned = prompt(1, 10)
    with Client(cluster.client_config()) as client:
        client.store(NS, pinned, payloads(pinned), hint=Hint(traffic_class="chat", pin=True))
        [key] = block_keys(NS, pinned)
        assert {cls for _, _, cls in shard_retention(cluster, [key])[key]} == {"+chat"}
        # A PUT's pin is granted whole or not at all: one past the quota is dropped (counted),
        # its blocks still stored; a small one that fits is pinned.
        many = prompt(12, 11)
        assert client.store(NS, many, payloads(many), hint=Hint(pin=True)).written == 12
        one = prompt(1, 12)
        client.store(NS, one, payloads(one), hint=Hint(pin=True))
    held = shard_retention(cluster, [*block_keys(NS, many), *block_keys(NS, one)])
    assert {c for k in block_keys(NS, many) for _, _, c in held[k]} == {"default"}
    assert {c for k in block_keys(NS, one) for _, _, c in held[k]} == {"+default"}
    stats = cluster.node_stats()
    assert sum(s["gc"]["pins_refused"] for s in stats) > 0
    for s in stats:
        pinned = sum(v["bytes"] for c, v in s["usage"]["classes"].items() if c.startswith("+"))
        assert 0 < pinned <= PIN_QUOTA
    cluster.kill(0)  # kill -9: the pin is in the committed LMDB record
    cluster.restart(0)
    node0 = cluster.nodes[0].id
    after = [cls for node, _, cls in shard_retention(cluster, [key])[key] if node == node0]
    assert after and set(after) == {"+chat"}


def test_a_hit_with_a_ttl_hint_slides_to_it(cluster: LocalCluster, tmp_path: Path) -> None:
    d = prompt(2, 20)
    with Client(cluster.client_config()) as client:
        client.store(NS, d, payloads(d), hint=Hint(traffic_class="agent", ttl_s=600))
        match = client.match_prefix(NS, d)
        before = int(time.time() * 1000)
        result = client.load(NS, match, hint=Hint(traffic_class="agent", ttl_s=7200))
        assert result.blocks == 2
    expiries = expiries_once_slid(cluster, d, before + 7_200_000 - 1000)
    # Every shard slid: the 11 of 12 a load asks for, and the one it did not, which the
    # client refreshed with a TOUCH because a holder flagged the hit as moving the expiry.
    assert len(expiries) == 2 * 12
    assert all(e >= before + 7_200_000 - 1000 for e in expiries), sorted(expiries)


def _touches(cluster: LocalCluster) -> int:
    return sum(stats["requests"].get("touch", 0) for stats in cluster.node_stats())


def test_a_refresh_never_waits_for_a_stopped_holder(cluster: LocalCluster) -> None:
    """A hit that moves no expiry sends no TOUCH. One that does, while a holder is stopped:
    the load hedges around it and returns without waiting for its refresh (it used to
    TOUCH the holder it had given up on and wait the client timeout for it), and once the
    holder runs again every shard has slid."""
    d = prompt(2, 30)
    with Client(cluster.client_config(timeout_s=5.0)) as client:
        client.store(NS, d, payloads(d), hint=Hint(traffic_class="agent", ttl_s=600))
        match = client.match_prefix(NS, d)
        touches = _touches(cluster)
        assert client.load(NS, match, hint=Hint(traffic_class="agent", ttl_s=600)).blocks == 2
        assert _touches(cluster) == touches  # no slide due: nothing flagged, nothing sent
        before = int(time.time() * 1000)
        cluster.pause(0)
        try:
            start = time.monotonic()
            result = client.load(NS, match, hint=Hint(traffic_class="agent", ttl_s=7200))
            took = time.monotonic() - start
        finally:
            cluster.resume(0)
        assert result.blocks == 2
        assert took < 2.5, f"the load took {took:.2f} s with a holder stopped"
    expiries = expiries_once_slid(cluster, d, before + 7_200_000 - 1000)
    assert len(expiries) == 2 * 12
    assert all(e >= before + 7_200_000 - 1000 for e in expiries), sorted(expiries)
