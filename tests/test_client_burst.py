"""The client's native burst (TcpTransport.burst, kv_get_burst in kvcache/native/kvfast.c).

A load's first GETs, one per node, are sent and received in one native call. Loads must
come back byte for byte the same with it and without it, and a reply the burst cannot
finish (here: held back by a proxy inside its header, its items or its data, or a daemon
stopped outright) must be carried on by the socket loop from where the burst left it:
the load completes, its landings are all accounted for (a miscount would hang the load's
close), and the next load works.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

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


@contextlib.contextmanager
def _behind_proxy(
    cluster: LocalCluster, tmp: Path, seed: int, *, warm: bool = True, **overrides: Any
) -> Iterator[tuple[StallProxy, Client, list[bytes], np.ndarray]]:
    """N blocks stored, then a client (``overrides`` on its config) that reaches node 0
    through a StallProxy; with ``warm``, one load first, so its connections are up."""
    keys, payloads = _blocks(N, seed)
    with Client(cluster.client_config()) as writer:
        assert writer.store_keys(keys, payloads, payload_len=P).written == N
    with StallProxy(_address(cluster.nodes[0].data)) as proxy:
        config = replace(_proxied_config(cluster, 0, proxy, tmp), **overrides)
        with Client(config) as client:
            if warm:
                out = np.zeros((N, P), np.uint8)
                assert client.load_keys(keys, payload_len=P, out=out).blocks == N
            yield proxy, client, keys, payloads


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
    proxied = _behind_proxy(cluster, tmp_path, 2, hedge_ms=50.0, timeout_s=1.0)
    with proxied as (proxy, client, keys, payloads):
        out = np.zeros((N, P), np.uint8)
        before = _counters(client)
        proxy.hold_after(stall_at)
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


def test_a_late_reply_stalled_while_landing_is_cut_after_a_hedge_time(
    cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    """A holder's reply stops in its data section, already landing in the caller's buffer,
    while the other holders gave every block k shards: the load does not wait for it to its
    timeout (its chunk cannot be verified while it writes), it cuts that connection a hedge
    time later, rebuilds, and hands back every block right. The node is not marked down,
    and the next loads, once the holder sends again, use it."""
    cluster = cluster_factory()
    proxied = _behind_proxy(cluster, tmp_path, 12, hedge_ms=50.0, timeout_s=30.0)
    with proxied as (proxy, client, keys, payloads):
        out = np.zeros((N, P), np.uint8)
        proxy.hold_after(48 + 8 * 59 + 30_000)  # inside the data section
        started = time.monotonic()
        loaded = client.load_keys(keys, payload_len=P, out=out)
        took = time.monotonic() - started
        assert loaded.blocks == N and np.array_equal(out, payloads)
        assert client.counters["landings_cut"] == 1
        rebuilt = client.counters["blocks_rebuilt"]
        assert rebuilt > 0  # node-00's data shards, from parity
        assert took < 10.0  # not the 30 s timeout
        assert "node-00" not in client.core.health.down_nodes()
        assert proxy.wait_held()
        proxy.release()
        read_again = False
        for _ in range(20):  # the first ones may go on without node-00 as it reconnects
            rebuilt = client.counters["blocks_rebuilt"]
            out[:] = 0
            assert client.load_keys(keys, payload_len=P, out=out).blocks == N
            assert np.array_equal(out, payloads)
            if client.counters["blocks_rebuilt"] == rebuilt:  # node-00 read again
                read_again = True
                break
        assert read_again
        assert client.counters["landings_cut"] == 1


@pytest.mark.parametrize("attempt", range(3))
def test_one_of_a_node_s_connections_failing_leaves_its_other_exchange_whole(
    cluster_factory: Callable[..., LocalCluster], tmp_path: Path, attempt: int
) -> None:
    """Two exchanges of one node in a burst (two connections, several chunks open); one
    connection is cut. The node's reset must not take the other exchange's bookkeeping
    with it, whatever order the two come back in: the load completes, every landing is
    released (else the load's close would hang) and the next loads work."""
    cluster = cluster_factory()
    proxied = _behind_proxy(
        cluster, tmp_path, 6 + attempt, chunk_bytes=8 * P, window=4, connections_per_node=2,
        hedge_ms=50.0, timeout_s=1.0,
    )  # fmt: skip
    with proxied as (proxy, client, keys, payloads):
        out = np.zeros((N, P), np.uint8)
        before = _counters(client)
        proxy.cut_next()
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


# ---------------------------------------------------------------------- HAS (plain bursts)


def _ran(client: Client, before: dict[str, int], *, done: bool = False) -> bool:
    """A burst took asks since ``before`` (``done``: and read some itself)."""
    now = _counters(client)
    key = "burst_done" if done else "burst_taken"
    return now[key] > before[key]


def _match(client: Client, keys: list[bytes]) -> tuple[int, np.ndarray, list[int]]:
    found = client.match_keys(keys)
    return found.hit_blocks, found.holders, found.stripe.tolist()


def _same(a: tuple[int, np.ndarray, list[int]], b: tuple[int, np.ndarray, list[int]]) -> bool:
    """The same hit and stripes, and no holder known to both that differs (a match stops
    listening once every block has k shards, so which holders it knows varies)."""
    both = (a[1] >= 0) & (b[1] >= 0)
    return a[0] == b[0] and a[2] == b[2] and bool(np.array_equal(a[1][both], b[1][both]))


@pytest.mark.parametrize("nodes", [12, 4])
def test_matches_are_the_same_with_and_without_the_burst(
    cluster_factory: Callable[..., LocalCluster], nodes: int
) -> None:
    """A match's HAS round goes out and comes back in one native burst: the same answer as
    the socket loop's. With 4 nodes each holds 3 shards of every block, more answers than
    the burst makes room for (2 a key and 8): those replies are read by the loop."""
    cluster = cluster_factory(nodes)
    keys, payloads = _blocks(N, 4)
    with Client(cluster.client_config()) as writer:
        assert writer.store_keys(keys, payloads, payload_len=P).written == N
    answers = []
    for burst in (True, False):
        with Client(cluster.client_config(burst=burst)) as client:
            client.match_keys(keys[:1])  # connections up
            before = _counters(client)
            got = [_match(client, keys) for _ in range(3)]
            # A burst may be kept from running (the I/O thread's loop holding a straggler of
            # the match before, another thread's post): more matches, at most 20 in all,
            # until one ran, each one's answer the same.
            while burst and len(got) < 20 and not _ran(client, before):
                got.append(_match(client, keys))
            assert all(_same(got[0], g) for g in got[1:])
            assert got[0][0] == N
            # Every block's known holders are at least k = 10 of its shards.
            assert ((got[0][1] >= 0).sum(axis=1) >= 10).all()
            answers.append(got[0])
            counters = _counters(client)
            taken = counters["burst_taken"] - before["burst_taken"]
            done = counters["burst_done"] - before["burst_done"]
            if not burst:
                assert taken == 0
            elif nodes == 12:
                # How many of its asks a burst reads itself varies with the timing (one cut
                # short by another thread's post hands the rest to the loop).
                assert taken >= 12 and done > 0
            else:
                assert taken >= 4
                stopped = counters["burst_left_stop_header"] - before.get(
                    "burst_left_stop_header", 0
                )
                assert stopped > 0 and done == 0  # 3 x 64 answers > 2 x 64 + 8
            assert _accounted(counters)
    assert _same(answers[0], answers[1])


def test_a_stopped_daemon_s_has_is_left_to_the_round(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    """A match with one daemon stopped: the burst returns once the others are in (the round
    needs k of 12 shards) and a grace passed, not at the hedge time; the round finishes
    without the stopped node, and after it resumes its late answer is taken in stride."""
    cluster = cluster_factory()
    keys, payloads = _blocks(N, 5)
    config = replace(cluster.client_config(), hedge_ms=2000.0, timeout_s=5.0)
    with Client(config) as client:
        assert client.store_keys(keys, payloads, payload_len=P).written == N
        want = _match(client, keys)
        cluster.pause(3)
        try:
            for _ in range(3):
                began = time.monotonic()
                assert _match(client, keys)[0] == N
                # Had a burst waited for the stopped node it would have run to the hedge
                # time, 2 s: it leaves that exchange to the round, which needs 10 of 12.
                assert time.monotonic() - began < 1.0
        finally:
            cluster.resume(3)
        assert _same(_match(client, keys), want)
        assert _accounted(_counters(client))


@pytest.mark.parametrize(
    "stall_at", [0, 20, 48 + 100], ids=["before-header", "in-header", "in-items"]
)
def test_a_has_reply_held_back_is_carried_on_by_the_socket_loop(
    cluster_factory: Callable[..., LocalCluster], tmp_path: Path, stall_at: int
) -> None:
    """A match whose HAS reply from one node stops inside its header or its items: the burst
    returns without it (the round needs 10 of 12), the loop reads it on once the bytes come,
    with the item count the header gave (a plain reply's room is larger), and the next
    matches agree."""
    cluster = cluster_factory()
    proxied = _behind_proxy(cluster, tmp_path, 7, warm=False, hedge_ms=2000.0, timeout_s=5.0)
    with proxied as (proxy, client, keys, _payloads):
        want = _match(client, keys)  # connections up
        proxy.hold_after(stall_at)
        began = time.monotonic()
        assert _match(client, keys)[0] == N
        assert time.monotonic() - began < 1.0  # not held up to the hedge time
        assert proxy.wait_held()
        proxy.release()
        for _ in range(2):
            assert _same(_match(client, keys), want)
        assert _accounted(_counters(client))


# ---------------------------------------------------------------------- PUT (plain bursts)


def test_stores_are_the_same_with_and_without_the_burst(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    """A store of one chunk sends its PUTs, header, items and data, and reads their
    replies in one native burst: what it stores loads back byte for byte, as without."""
    cluster = cluster_factory()
    for seed, burst in ((8, True), (9, False)):
        keys, payloads = _blocks(N, seed)
        with Client(cluster.client_config(burst=burst)) as client:
            client.match_keys(keys[:1])  # control connections up
            assert client.store_keys(keys[:1], payloads[:1], payload_len=P).written == 1
            before = _counters(client)
            got = client.store_keys(keys, payloads, payload_len=P)
            assert (got.written, got.touched, got.failed) == (N - 1, 1, 0)
            # A burst kept from running (see the matches): more stores of fresh blocks, at
            # most 10, until one ran; each loads back below.
            more = 0
            while burst and more < 10 and not _ran(client, before, done=True):
                extra, extra_payloads = _blocks(N, 100 + more)
                assert client.store_keys(extra, extra_payloads, payload_len=P).written == N
                more += 1
            counters = _counters(client)
            taken = counters["burst_taken"] - before["burst_taken"]
            done = counters["burst_done"] - before["burst_done"]
            # The PUTs, one per node (and the HAS of a check for stored stripes, if any).
            assert (taken >= 12, done > 0) == (burst, burst)
            assert _accounted(counters)
        with Client(cluster.client_config()) as reader:
            out = np.zeros((N, P), np.uint8)
            assert reader.load_keys(keys, payload_len=P, out=out).blocks == N
            assert np.array_equal(out, payloads)


def test_a_store_to_a_stopped_daemon_leaves_its_put_half_sent_to_the_loop(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    """One daemon stopped while a store's PUTs go out: its request does not fit the socket
    buffers (64 shards of 2 MiB blocks, 13 MB), so the burst leaves it part sent, returns
    once the other 11 answered (the write quorum is 11 of 12), and the loop goes on sending
    it from where the burst stopped. Once the daemon resumes it stores every shard whole:
    with two other daemons stopped, a load needs its shards, and they load byte for byte."""
    big = 2 << 20
    cluster = cluster_factory()
    rng = np.random.default_rng(10)
    keys = [rng.integers(0, 256, 16, dtype=np.uint8).tobytes() for _ in range(N)]
    payloads = rng.integers(0, 256, (N, big), dtype=np.uint8)
    config = replace(cluster.client_config(), hedge_ms=200.0, timeout_s=20.0, chunk_bytes=N * big)
    with Client(config) as client:
        assert client.store_keys(keys[:1], payloads[:1], payload_len=big).written == 1
        held = cluster.node_stats()[3]["usage"]["shards"]
        cluster.pause(3)
        try:
            before = _counters(client)
            began = time.monotonic()
            assert client.store_keys(keys[1:], payloads[1:], payload_len=big).written == N - 1
            assert time.monotonic() - began < 10.0  # not the 20 s deadline
            counters = _counters(client)
            assert counters["burst_left_send"] - before.get("burst_left_send", 0) == 1
        finally:
            cluster.resume(3)
        # The loop finishes sending node 3's PUT: wait (bounded) until it has stored it.
        deadline = time.monotonic() + 15.0
        while cluster.node_stats()[3]["usage"]["shards"] < held + N - 1:
            assert time.monotonic() < deadline, "node 3 never stored the half-sent PUT"
            time.sleep(0.05)
        assert _accounted(_counters(client))
    cluster.pause(0)
    cluster.pause(1)
    try:
        with Client(replace(cluster.client_config(), hedge_ms=200.0, timeout_s=5.0)) as reader:
            out = np.zeros((N, big), np.uint8)
            assert reader.load_keys(keys, payload_len=big, out=out).blocks == N
            assert np.array_equal(out, payloads)
    finally:
        cluster.resume(0)
        cluster.resume(1)
