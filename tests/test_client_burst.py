"""The client's native burst (TcpTransport.burst, kv_get_burst in kvcache/native/kvfast.c).

A load's first GETs, one per node, are sent and received in one native call. Loads must
come back byte for byte the same with it and without it, and a reply the burst cannot
finish (here: held back by a proxy inside its header, its items or its data, or a daemon
stopped outright) must be carried on by the socket loop from where the burst left it:
the load completes, its landings are all accounted for (a miscount would hang the load's
close), and the next load works.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from stall_proxy import StallProxy

from kvcache import native
from kvcache.client import Client, ClientConfig
from kvcache.cluster import read_cluster_file
from kvcache.testing.localcluster import LocalCluster

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason="needs the native helpers")

P = 114_688  # DeepSeek V4.1 Flash's prefix-cacheable block
N = 64


def _blocks(n: int, seed: int) -> tuple[list[bytes], np.ndarray]:
    rng = np.random.default_rng(seed)
    keys = [rng.integers(0, 256, 16, dtype=np.uint8).tobytes() for _ in range(n)]
    return keys, rng.integers(0, 256, (n, P), dtype=np.uint8)


def _counters(client: Client) -> dict[str, int]:
    return dict(client._core.transport.counters)  # type: ignore[attr-defined]


def _accounted(counters: dict[str, int]) -> bool:
    """Every exchange a burst took was finished by it or left to the loop, counted once."""
    left = sum(v for name, v in counters.items() if name.startswith("burst_left_"))
    return counters["burst_done"] + left == counters["burst_taken"]


def test_loads_are_the_same_with_and_without_the_burst(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = cluster_factory()
    keys, payloads = _blocks(N, 1)
    with Client(cluster.client_config()) as writer:
        assert writer.store_keys(keys, payloads, payload_len=P).written == N
    outs = []
    for burst in (True, False):
        with Client(cluster.client_config(burst=burst)) as client:
            out = np.zeros((N, P), np.uint8)
            for _ in range(3):
                out[:] = 0
                loaded = client.load_keys(keys, payload_len=P, out=out)
                assert loaded.blocks == N
            outs.append(out.copy())
            counters = _counters(client)
            if burst:  # every load but the first, which opened the connections
                assert counters["burst_taken"] == 2 * 12
                # A burst returns once every block has k = 10 shards, from 10 nodes at least:
                # a straggler is finished by the loop.
                assert counters["burst_done"] >= 2 * 10
                assert _accounted(counters)
            else:
                assert counters["burst_taken"] == 0
    assert np.array_equal(outs[0], payloads) and np.array_equal(outs[1], payloads)


@pytest.mark.parametrize("connections", [1, 2])
def test_several_chunks_at_once_take_one_exchange_per_connection(
    cluster_factory: Callable[..., LocalCluster], connections: int
) -> None:
    """With several chunks open at once a node is asked several times: the burst takes one
    exchange per idle connection and the others go through the loop, pipelined behind it."""
    cluster = cluster_factory()
    keys, payloads = _blocks(N, 5)
    with Client(cluster.client_config()) as writer:
        assert writer.store_keys(keys, payloads, payload_len=P).written == N
    config = cluster.client_config(chunk_bytes=8 * P, window=4, connections_per_node=connections)
    with Client(config) as client:
        out = np.zeros((N, P), np.uint8)
        for _ in range(3):
            out[:] = 0
            assert client.load_keys(keys, payload_len=P, out=out).blocks == N
            assert np.array_equal(out, payloads)
        counters = _counters(client)
        # Four chunks of 8 blocks open at once: 4 asks per node, one per connection burst.
        assert counters["burst_taken"] == 2 * 12 * connections
        assert counters["burst_done"] >= 2 * 10
        assert _accounted(counters)


def _proxied_config(cluster: LocalCluster, node: int, proxy: StallProxy, tmp: Path) -> ClientConfig:
    """The cluster's client config with node ``node`` reached through ``proxy``."""
    cmap, _etcd = read_cluster_file(cluster.cluster_file)
    assert cmap is not None
    nodes = list(cmap.nodes)
    nodes[node] = replace(nodes[node], data=proxy.endpoint)
    path = tmp / "proxied-cluster.toml"
    path.write_text(replace(cmap, nodes=tuple(nodes)).to_toml())
    return replace(cluster.client_config(), cluster_file=path)


def _address(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


@pytest.mark.parametrize(
    ("stall_at", "left"),
    [(0, "head"), (20, "head"), (48 + 100, "items"), (48 + 8 * 59 + 30_000, "data")],
    ids=["before-header", "in-header", "in-items", "in-data"],
)
def test_a_reply_held_back_is_carried_on_by_the_socket_loop(
    cluster_factory: Callable[..., LocalCluster], tmp_path: Path, stall_at: int, left: str
) -> None:
    cluster = cluster_factory()
    keys, payloads = _blocks(N, 2)
    with Client(cluster.client_config()) as writer:
        assert writer.store_keys(keys, payloads, payload_len=P).written == N
    with StallProxy(_address(cluster.nodes[0].data)) as proxy:
        config = _proxied_config(cluster, 0, proxy, tmp_path)
        with Client(replace(config, hedge_ms=50.0, timeout_s=1.0)) as client:
            out = np.zeros((N, P), np.uint8)
            assert client.load_keys(keys, payload_len=P, out=out).blocks == N  # connections up
            before = _counters(client)
            proxy.hold_after(stall_at)
            out[:] = 0
            loaded = client.load_keys(keys, payload_len=P, out=out)
            assert loaded.blocks == N
            assert np.array_equal(out, payloads)
            after = _counters(client)
            taken = after["burst_taken"] - before["burst_taken"]
            done = after["burst_done"] - before["burst_done"]
            assert taken == 12 and done == 11  # the proxied node's reply was left to the loop
            # Where it was left: at the hold, or (the burst returns once every block has k
            # shards, which the other nodes give) short of it if its bytes came late.
            order = ["head", "items", "data"]
            moved = [s for s in order if after[f"burst_left_{s}"] != before[f"burst_left_{s}"]]
            assert len(moved) == 1 and order.index(moved[0]) <= order.index(left)
            assert _accounted(after)
            assert proxy.wait_held()
            proxy.release()
            for _ in range(2):
                out[:] = 0
                assert client.load_keys(keys, payload_len=P, out=out).blocks == N
                assert np.array_equal(out, payloads)


@pytest.mark.parametrize("attempt", range(3))
def test_one_of_a_node_s_connections_failing_leaves_its_other_exchange_whole(
    cluster_factory: Callable[..., LocalCluster], tmp_path: Path, attempt: int
) -> None:
    """Two exchanges of one node in a burst (two connections, several chunks open); one
    connection is cut. The node's reset must not take the other exchange's bookkeeping
    with it, whatever order the two come back in: the load completes, every landing is
    released (else the load's close would hang) and the next loads work."""
    cluster = cluster_factory()
    keys, payloads = _blocks(N, 6 + attempt)
    with Client(cluster.client_config()) as writer:
        assert writer.store_keys(keys, payloads, payload_len=P).written == N
    with StallProxy(_address(cluster.nodes[0].data)) as proxy:
        config = _proxied_config(cluster, 0, proxy, tmp_path)
        config = replace(config, chunk_bytes=8 * P, window=4, connections_per_node=2)
        with Client(replace(config, hedge_ms=50.0, timeout_s=1.0)) as client:
            out = np.zeros((N, P), np.uint8)
            assert client.load_keys(keys, payload_len=P, out=out).blocks == N  # connections up
            before = _counters(client)
            proxy.cut_next()
            out[:] = 0
            assert client.load_keys(keys, payload_len=P, out=out).blocks == N
            assert np.array_equal(out, payloads)
            assert proxy.cut == 1
            after = _counters(client)
            assert after["burst_taken"] - before["burst_taken"] == 2 * 12
            assert _accounted(after)
            for _ in range(2):
                out[:] = 0
                assert client.load_keys(keys, payload_len=P, out=out).blocks == N
                assert np.array_equal(out, payloads)


def test_a_stopped_daemon_s_exchange_is_left_to_the_loop(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = cluster_factory()
    keys, payloads = _blocks(N, 3)
    config = replace(cluster.client_config(), hedge_ms=50.0, timeout_s=1.0)
    with Client(config) as client:
        assert client.store_keys(keys, payloads, payload_len=P).written == N
        out = np.zeros((N, P), np.uint8)
        assert client.load_keys(keys, payload_len=P, out=out).blocks == N
        cluster.pause(3)
        try:
            out[:] = 0
            assert client.load_keys(keys, payload_len=P, out=out).blocks == N
            assert np.array_equal(out, payloads)
        finally:
            cluster.resume(3)
        out[:] = 0
        assert client.load_keys(keys, payload_len=P, out=out).blocks == N
        assert np.array_equal(out, payloads)
