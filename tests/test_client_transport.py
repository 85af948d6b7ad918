"""The client's TCP transport and one-round loads, against real daemons on loopback.

- Loads of keys the caller knows are stored: no HAS round, any stripe, stripes settled
  from the shards that arrive.
- Restarts: a node killed and started again, and a rolling restart of every node, cost
  no load (issue 18): stale connections are dropped or retried on fresh ones, never a
  reason to mark a node that answers again down.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvcache import REFERENCE_LAYOUT, Namespace
from kvcache.client import Client
from kvcache.keys import block_keys
from kvcache.testing.localcluster import LocalCluster

P = 114_688


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = Path(tmp_path_factory.mktemp("transport"))
    with LocalCluster(root / "cluster").start(nodes=12, capacity="1GiB") as c:
        yield c


def _blocks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, P), dtype=np.uint8)


def _has_requests(cluster: LocalCluster) -> int:
    return sum(int(s["requests"]["has"]) for s in cluster.node_stats())


def test_load_of_known_keys_makes_no_has_round_and_returns_the_stored_bytes(
    cluster: LocalCluster,
) -> None:
    keys = [os.urandom(16) for _ in range(64)]
    src = _blocks(64, 1)
    with Client(cluster.client_config()) as client:
        assert client.store_keys(keys, src, payload_len=P).written == 64
        before = _has_requests(cluster)
        out = np.zeros_like(src)
        loaded = client.load_keys(keys, payload_len=P, out=out)
        assert loaded.blocks == 64
        assert np.array_equal(out, src)
        assert _has_requests(cluster) == before
        # A key that is not stored ends the prefix there, like a miss.
        gap = [*keys[:10], os.urandom(16), *keys[11:]]
        out[:] = 0
        assert client.load_keys(gap, payload_len=P, out=out).blocks == 10
        assert np.array_equal(out[:10], src[:10])


def test_known_keys_load_settles_on_the_stripe_of_a_rewritten_block(
    cluster: LocalCluster,
) -> None:
    """A block deleted and written again (a new stripe): the load takes one stripe's
    shards, never a mix, and returns the second write's bytes."""
    ns = Namespace(model="transport-test", revision="1", layout=REFERENCE_LAYOUT)
    tokens = list(range(8 * ns.tokens_per_block))
    keys = block_keys(ns, tokens)
    first, second = _blocks(8, 2), _blocks(8, 3)
    with Client(cluster.client_config()) as client:
        assert client.store(ns, tokens, list(first)).written == 8
        assert client.delete(ns, tokens) > 0
        assert client.store(ns, tokens, list(second)).written == 8
        out = np.zeros_like(second)
        assert client.load_keys(keys, payload_len=P, out=out).blocks == 8
        assert np.array_equal(out, second)


def test_known_keys_load_rejects_bad_arguments(cluster: LocalCluster) -> None:
    from kvcache.errors import ArgumentError

    with Client(cluster.client_config()) as client, pytest.raises(ArgumentError):
        client.load_keys([b"short"], payload_len=P)


def test_a_node_killed_and_restarted_costs_no_load(cluster: LocalCluster) -> None:
    keys = [os.urandom(16) for _ in range(32)]
    src = _blocks(32, 4)
    with Client(cluster.client_config()) as client:
        assert client.store_keys(keys, src, payload_len=P).written == 32
        out = np.zeros_like(src)
        for victim in (3, 7):
            cluster.kill(victim)
            cluster.restart(victim)
            for _ in range(5):
                out[:] = 0
                match = client.match_keys(keys)
                assert match.hit_blocks == 32
                assert client.load_keys(match, payload_len=P, out=out).blocks == 32
                assert np.array_equal(out, src)
            # The restarted node answers, so it is up: its old sockets were not held
            # against it.
            assert client._core.health.is_up(cluster.nodes[victim].id)


def test_a_rolling_restart_of_every_node_costs_no_load_and_no_store(
    cluster: LocalCluster,
) -> None:
    keys = [os.urandom(16) for _ in range(32)]
    src = _blocks(32, 5)
    stop = threading.Event()
    short: list[int] = []
    loads = 0
    stores_failed = 0
    with Client(cluster.client_config()) as client:
        assert client.store_keys(keys, src, payload_len=P).written == 32

        def load_forever() -> None:
            nonlocal loads
            out = np.zeros_like(src)
            while not stop.is_set():
                got = client.load_keys(client.match_keys(keys), payload_len=P, out=out)
                loads += 1
                if got.blocks != 32 or not np.array_equal(out, src):
                    short.append(got.blocks)

        reader = threading.Thread(target=load_forever)
        reader.start()
        try:
            for i in range(len(cluster.nodes)):
                cluster.terminate(i)
                # One node down: a store still reaches its quorum through a stand-in.
                fresh = [os.urandom(16) for _ in range(4)]
                if client.store_keys(fresh, src[:4], payload_len=P).written != 4:
                    stores_failed += 1
                cluster.restart(i)
        finally:
            stop.set()
            reader.join(timeout=60)
    assert loads > 0
    assert short == []
    assert stores_failed == 0


def test_a_match_longer_than_one_has_request_is_asked_in_segments(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt of more keys than a daemon takes in one request (16,384 by default) is
    matched in segments; shown here with segments of 16 keys over 40."""
    from kvcache.client import matching

    monkeypatch.setattr(matching, "MAX_HAS_KEYS", 16)
    keys = [os.urandom(16) for _ in range(40)]
    src = _blocks(40, 6)
    with Client(cluster.client_config()) as client:
        assert client.store_keys(keys, src, payload_len=P).written == 40
        match = client.match_keys(keys)
        assert match.hit_blocks == 40
        out = np.zeros_like(src)
        assert client.load_keys(match, payload_len=P, out=out).blocks == 40
        assert np.array_equal(out, src)
        gap = [*keys[:20], os.urandom(16), *keys[21:]]
        assert client.match_keys(gap).hit_blocks == 20


# ---------------------------------------------------------------------- who runs the loop


def test_a_waiting_call_runs_the_loop_itself_and_the_io_thread_stays_parked(
    cluster: LocalCluster,
) -> None:
    """Back-to-back loads are received by the calling thread: the I/O thread takes a turn
    only for answers a returned call left behind for longer than the linger."""
    keys = [os.urandom(16) for _ in range(32)]
    src = _blocks(32, 11)
    out = np.zeros_like(src)
    with Client(cluster.client_config()) as client:
        assert client.store_keys(keys, src, payload_len=P).written == 32
        counters = client._core.transport.counters  # type: ignore[attr-defined]
        before = dict(counters)
        for _ in range(20):
            out[:] = 0
            assert client.load_keys(keys, payload_len=P, out=out).blocks == 32
            assert np.array_equal(out, src)
        caller = counters["caller_turns"] - before["caller_turns"]
        io = counters["io_turns"] - before["io_turns"]
        assert caller >= 20  # at least one turn per load
        assert io < caller


@pytest.mark.parametrize("caller_drives", [True, False])
def test_loads_from_several_threads_at_once_all_complete(
    cluster: LocalCluster, caller_drives: bool
) -> None:
    """One thread runs the loop at a time; the others wait for their replies as before and
    are never left with an exchange nobody sends or receives."""
    keys = [os.urandom(16) for _ in range(48)]
    src = _blocks(48, 12)
    errors: list[BaseException] = []
    with Client(cluster.client_config(caller_drives=caller_drives)) as client:
        assert client.store_keys(keys, src, payload_len=P).written == 48

        def loads(part: int) -> None:
            try:
                lo, hi = part * 12, part * 12 + 12
                out = np.zeros((12, P), np.uint8)
                for _ in range(15):
                    out[:] = 0
                    got = client.load_keys(keys[lo:hi], payload_len=P, out=out)
                    assert got.blocks == 12
                    assert np.array_equal(out, src[lo:hi])
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=loads, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        counters = client._core.transport.counters  # type: ignore[attr-defined]
        if caller_drives:
            assert counters["caller_turns"] > 0
        else:
            assert counters["caller_turns"] == 0


def test_an_exchange_no_caller_waits_for_is_sent_and_received_by_the_io_thread(
    cluster: LocalCluster,
) -> None:
    """A fire-and-forget submit (read repair's PUTs use one) from a thread that never runs
    the loop: the parked I/O thread is woken, sends it and receives its reply."""
    from kvcache.client.transport import Exchange
    from kvcache.wire import Op, make_items

    done = threading.Event()
    outcome: list[object] = []

    class Stats(Exchange):
        def finish(self, reply: object, error: BaseException | None) -> None:
            outcome.append(error if error is not None else reply)
            done.set()

    with Client(cluster.client_config()) as client:
        transport = client._core.transport  # type: ignore[attr-defined]
        io_before = transport.counters["io_turns"]
        transport.submit(Stats(0, Op.STATS, make_items(Op.STATS, 0, reply=False)))
        assert done.wait(10), "nobody ran the loop for an exchange no caller waits for"
        assert not isinstance(outcome[0], BaseException), outcome[0]
        assert transport.counters["io_turns"] > io_before
