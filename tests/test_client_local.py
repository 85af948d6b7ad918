"""The client's decisions through the in-process transport: real stores and handlers,
no sockets, and node faults under the test's control (slow, stopped, dead)."""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvcache.client import Client, ClientConfig
from kvcache.client.local import LocalNode, LocalTransport
from kvcache.cluster import ClusterMap, NodeInfo
from kvcache.credentials import tenant_id
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.server.handler import RequestHandler
from kvcache.server.metrics import Metrics
from kvcache.server.store import ShardStore
from kvcache.workload import payload_for_key

LAYOUT = KVLayout(
    tokens_per_block=64, bytes_per_token=1792, dtype=DType.BFLOAT16, layers_in_block=7
)
P = LAYOUT.payload_bytes
NS = Namespace(model="local", revision="1", layout=LAYOUT)
T = tenant_id("default")


class Cluster:
    def __init__(self, root: Path, nodes: int = 12) -> None:
        self.infos = tuple(
            NodeInfo(id=f"node-{i:02d}", data=f"tcp://127.0.0.1:{20000 + i}") for i in range(nodes)
        )
        self.map = ClusterMap(epoch=1, nodes=self.infos)
        self.stores = [ShardStore(root / f"n{i}", capacity_bytes=256 << 20) for i in range(nodes)]
        self.nodes = [
            LocalNode(RequestHandler(s, Metrics(), node_id=f"node-{i:02d}", tenant_names={T: "d"}))
            for i, s in enumerate(self.stores)
        ]
        self.transports: list[LocalTransport] = []
        self.root = root

    def client(self, **overrides: object) -> Client:
        transport = LocalTransport(self.infos, self.nodes, tenant=T)
        self.transports.append(transport)
        config = ClientConfig(cluster_file=self.root / "unused.toml", **overrides)  # type: ignore[arg-type]
        return Client(config, cluster=self.map, transport=transport)

    def close(self) -> None:
        for t in self.transports:
            t.close()
        for s in self.stores:
            s.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    yield c
    c.close()


def prompt(blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, blocks * 64).astype(np.uint32)


def payloads(tokens: np.ndarray) -> list[np.ndarray]:
    return [payload_for_key(k, P) for k in block_keys(NS, tokens)]


def identical(client: Client, tokens: np.ndarray) -> int:
    """Blocks loaded, each checked byte for byte."""
    result = client.load_prefix(NS, tokens)
    for got, want in zip(result.payloads, payloads(tokens), strict=False):
        assert np.array_equal(got, want)
    return result.blocks


def test_round_trip_through_the_in_process_transport(cluster: Cluster) -> None:
    tokens = prompt(6, 1)
    with cluster.client() as client:
        assert client.store(NS, tokens, payloads(tokens)).written == 6
        assert identical(client, tokens) == 6
        assert client.counters["blocks_rebuilt"] == 0
    assert sum(s.usage()["shards"] for s in cluster.stores) == 6 * 12


def test_a_stopped_node_costs_a_rebuild_not_a_wait(cluster: Cluster) -> None:
    """A node that holds requests (SIGSTOP): loads finish in a small part of the timeout,
    rebuilding the blocks whose data shard it holds; after the timeout it is reset and
    marked down."""
    tokens = prompt(32, 2)
    with cluster.client(timeout_s=3.0) as client:
        client.store(NS, tokens, payloads(tokens))
        cluster.nodes[4].stop()
        try:
            for _ in range(3):
                started = time.monotonic()
                assert identical(client, tokens) == 32
                assert time.monotonic() - started < 1.0
            assert client.counters["blocks_rebuilt"] > 0
        finally:
            cluster.nodes[4].resume()


def test_loads_past_a_stopped_node_do_not_keep_their_buffers(cluster: Cluster) -> None:
    """Every load leaves an ask queued on a stopped node until it is marked down; that ask
    must not keep the load's buffers (about a payload per block, each load) alive."""
    tokens = prompt(8, 7)
    with cluster.client(timeout_s=30.0) as client:
        client.store(NS, tokens, payloads(tokens))
        assert identical(client, tokens) == 8
        cluster.nodes[4].stop()
        try:
            tracemalloc.start()
            try:
                for _ in range(20):
                    assert client.load_prefix(NS, tokens).blocks == 8
                gc.collect()
                held, _peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
        finally:
            cluster.nodes[4].resume()
    # 20 loads of 8 blocks of 112 KiB are 18 MB of payloads: 2.2 MB was left (the client's
    # own state), 23.6 MB when the asks queued on the stopped node kept their assemblies.
    assert held < 10 << 20, f"{held / 1e6:.1f} MB still held after the loads"


def test_a_slow_node_never_turns_a_stored_block_into_a_miss(cluster: Cluster) -> None:
    """Blocks stored with two nodes down hold 10 shards. Then one of their holders answers
    slowly, far past the hedge time: the match waits for it instead of reporting 9 of 10."""
    tokens = prompt(8, 3)
    with cluster.client(min_write_shards=10, timeout_s=2.0, hedge_ms=5.0) as writer:
        cluster.nodes[0].kill()
        cluster.nodes[1].kill()
        assert writer.store(NS, tokens, payloads(tokens)).written == 8
    cluster.nodes[0].dead = cluster.nodes[1].dead = False
    cluster.nodes[2].delay_s = 0.2
    with cluster.client(timeout_s=2.0, hedge_ms=5.0) as reader:
        assert reader.match_prefix(NS, tokens).hit_blocks == 8
        assert identical(reader, tokens) == 8


def test_a_dead_node_is_marked_down_and_skipped(cluster: Cluster) -> None:
    tokens = prompt(8, 4)
    with cluster.client(timeout_s=2.0) as client:
        client.store(NS, tokens, payloads(tokens))
        cluster.nodes[7].kill()
        assert identical(client, tokens) == 8
        assert client.core.health.down_nodes() == ["node-07"]
        before = client.counters["node_errors"]
        assert identical(client, tokens) == 8
        assert client.counters["node_errors"] == before  # skipped, not asked again


def test_a_long_store_decides_again_what_it_may_replace(cluster: Cluster) -> None:
    """On the careful path (HAS first: here for every store, with ask_before_store), chunks
    written more than EXPECT_FRESH_S after the store's first HAS ask the holders again (one
    more HAS round per late chunk), so a slow store never replaces a stripe another writer
    finished meanwhile. (A store that asks nothing names nothing to replace.)"""
    from kvcache.client.storing import EXPECT_FRESH_S

    tokens = prompt(6, 5)
    for node in cluster.nodes:
        node.delay_s = EXPECT_FRESH_S / 2 + 0.1  # each PUT round takes over half of it
    metrics = cluster.nodes[0].handler.metrics
    with cluster.client(
        chunk_bytes=2 * P, window=1, timeout_s=10.0, ask_before_store=True
    ) as client:
        before = metrics.snapshot()["requests"].get("has", 0)
        assert client.store(NS, tokens, payloads(tokens)).written == 6
        has_rounds = metrics.snapshot()["requests"].get("has", 0) - before
        # The first HAS, and again before each of the chunks that started late.
        assert has_rounds >= 2
        for node in cluster.nodes:
            node.delay_s = 0.0
        assert identical(client, tokens) == 6
