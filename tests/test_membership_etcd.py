"""Membership in a real etcd: daemons register under leases, clients watch the map.

Each test starts its own etcd process and 12 (or 13) ``kvcache server``
processes through :class:`LocalCluster` (``kvcache up --etcd``), and talks to
them through the shipped client and the ``kvcache node`` command.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvcache.cli import main as kvcache_main
from kvcache.client import Client
from kvcache.cluster import NodeState
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.membership.localetcd import etcd_binary
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key

LAYOUT = KVLayout(tokens_per_block=16, bytes_per_token=512, dtype=DType.BFLOAT16, layers_in_block=4)
P = LAYOUT.payload_bytes
TTL_S = 2

try:
    etcd_binary()
    HAVE_ETCD = True
except Exception:
    HAVE_ETCD = False

pytestmark = pytest.mark.skipif(
    not HAVE_ETCD, reason="etcd is not installed (scripts/install.sh installs etcd-server)"
)


def ns(name: str) -> Namespace:
    return Namespace(model=name, revision="1", layout=LAYOUT)


def prompt(blocks: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50_000, blocks * LAYOUT.tokens_per_block).astype(np.uint32)


def payloads(space: Namespace, tokens: np.ndarray) -> list[np.ndarray]:
    return [payload_for_key(k, P) for k in block_keys(space, tokens)]


def assert_identical(client: Client, space: Namespace, tokens: np.ndarray, blocks: int) -> None:
    result = client.load_prefix(space, tokens)
    assert result.blocks == blocks
    for got, want in zip(result.payloads, payloads(space, tokens), strict=False):
        assert np.array_equal(got, want)


def wait_for(what: str, cond: Callable[[], bool], timeout_s: float = 30.0) -> float:
    """Poll ``cond`` until true; seconds it took (fails the test after ``timeout_s``)."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(tmp_path / "cluster").start(
        nodes=12, capacity="64MiB", etcd=True, lease_ttl_s=TTL_S
    )
    try:
        yield cluster
    finally:
        cluster.stop()


def node_live(client: Client, node_id: str) -> bool:
    view = client.core.view()
    return any(n.id == node_id and bool(view.live[i]) for i, n in enumerate(view.nodes))


def test_kill_drain_out_in(etcd_cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = etcd_cluster
    space = ns("membership")
    a, b, c = prompt(30, 1), prompt(30, 2), prompt(20, 3)
    with Client(cluster.client_config()) as client:
        # The map came from etcd: 12 members, all live.
        assert len(client.core.cluster.nodes) == 12
        assert all(node_live(client, f"node-{i:02d}") for i in range(12))
        assert client.store(space, a, payloads(space, a)).written == 30

        # kill -9: the lease runs out, etcd deletes the registration, the client's watch
        # sees it and the node stops being used; no map change.
        epoch = client.core.cluster.epoch
        cluster.kill(3)
        took = wait_for("node-03 to turn not live", lambda: not node_live(client, "node-03"))
        assert took <= TTL_S + 2.0, f"took {took:.2f} s with a {TTL_S} s lease"
        assert client.core.cluster.epoch == epoch

        # Writes go on: node-03's shards go to the next node in each key's order.
        before = client.counters["shards_redirected"]
        stored = client.store(space, b, payloads(space, b))
        assert (stored.written, stored.failed) == (30, 0)
        assert client.counters["shards_redirected"] > before
        assert_identical(client, space, a, 30)
        assert_identical(client, space, b, 30)

        # Back with its data: it registers again and is used again.
        cluster.restart(3)
        wait_for("node-03 live again", lambda: node_live(client, "node-03"))
        assert_identical(client, space, a, 30)
        assert_identical(client, space, b, 30)

        # drain through the CLI: a map change every client sees without a restart.
        cf = str(cluster.cluster_file)
        assert kvcache_main(["node", "drain", "node-05", "--cluster-file", cf]) == 0
        wait_for("the drain to reach the client", lambda: client.core.cluster.epoch > epoch)
        drained = {n.id: n.state for n in client.core.cluster.nodes}
        assert drained["node-05"] is NodeState.DRAIN
        node5 = client.core.view().nodes.index(
            next(n for n in client.core.view().nodes if n.id == "node-05")
        )
        targets, _redirected, _order = client.core.view().targets(
            block_keys(space, c), np.ones(len(client.core.view().nodes), bool)
        )
        assert not (targets == node5).any(), "a drained node got new shards"
        assert client.store(space, c, payloads(space, c)).written == 20
        for tokens, blocks in ((a, 30), (b, 30), (c, 20)):
            assert_identical(client, space, tokens, blocks)

        # out: not read either; blocks lose at most one shard and stay readable.
        assert kvcache_main(["node", "out", "node-05", "--cluster-file", cf]) == 0
        wait_for(
            "out to reach the client",
            lambda: {n.id: n.state for n in client.core.cluster.nodes}["node-05"] is NodeState.OUT,
        )
        for tokens, blocks in ((a, 30), (b, 30), (c, 20)):
            assert_identical(client, space, tokens, blocks)
        assert kvcache_main(["node", "in", "node-05", "--cluster-file", cf]) == 0
        wait_for(
            "in to reach the client",
            lambda: {n.id: n.state for n in client.core.cluster.nodes}["node-05"] is NodeState.UP,
        )
        assert client.counters["map_changes"] >= 3

    # The CLI's list shows the states and liveness etcd holds.
    capsys.readouterr()
    assert kvcache_main(["node", "list", "--cluster-file", cf]) == 0
    listing = capsys.readouterr().out
    assert "node-05" in listing and "up" in listing
    # Removing a node that is up is refused with a message saying what to do.
    assert kvcache_main(["node", "remove", "node-07", "--cluster-file", cf]) != 0
    assert "take it out first" in capsys.readouterr().err


def test_join_re_places_without_restart(etcd_cluster: LocalCluster) -> None:
    cluster = etcd_cluster
    space = ns("join")
    prompts = [prompt(8, 100 + i) for i in range(12)]
    with Client(cluster.client_config()) as client:
        for tokens in prompts:
            assert client.store(space, tokens, payloads(space, tokens)).written == 8
        changes = client.counters["map_changes"]
        joined = cluster.add_node()
        wait_for(
            "the 13th node in the client's map",
            lambda: any(n.id == joined.id for n in client.core.cluster.nodes),
        )
        assert client.counters["map_changes"] > changes
        # Every block is still found: reads ask the holders under the previous map too.
        for tokens in prompts:
            assert_identical(client, space, tokens, 8)
        # New writes use the new node.
        fresh = [prompt(8, 200 + i) for i in range(12)]
        for tokens in fresh:
            assert client.store(space, tokens, payloads(space, tokens)).written == 8
        keys = [k for tokens in fresh for k in block_keys(space, tokens)]
        view = client.core.view()
        new_index = next(i for i, n in enumerate(view.nodes) if n.id == joined.id)
        assert (view.holders(keys) == new_index).any()
        for tokens in fresh:
            assert_identical(client, space, tokens, 8)
