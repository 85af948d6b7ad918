"""The client against a real 12-daemon cluster on loopback: round trips, dead and
paused nodes, racing writers, holes in the prefix."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from vllm_e2e.damage import damage_block

from kvcache.client import Client, ClientConfig, MatchResult, StoreResult
from kvcache.errors import ArgumentError, ConfigError
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.retention import Hint
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key

LAYOUT = KVLayout(
    tokens_per_block=64, bytes_per_token=1792, dtype=DType.BFLOAT16, layers_in_block=7
)
P = LAYOUT.payload_bytes  # 112 KiB


def ns(name: str) -> Namespace:
    return Namespace(model=name, revision="1", layout=LAYOUT)


def prompt(blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, blocks * 64 + 17).astype(np.uint32)


def payloads_for(space: Namespace, tokens: np.ndarray) -> list[np.ndarray]:
    return [payload_for_key(k, P) for k in block_keys(space, tokens)]


def client_for(cluster: LocalCluster, **kw: object) -> Client:
    return Client(cluster.client_config(**kw))


def assert_loads(client: Client, space: Namespace, tokens: np.ndarray, blocks: int) -> None:
    result = client.load_prefix(space, tokens)
    assert result.blocks == blocks
    expected = payloads_for(space, tokens)
    for got, want in zip(result.payloads, expected, strict=False):
        assert np.array_equal(got, want)


@contextlib.contextmanager
def paused(cluster: LocalCluster, *nodes: int) -> Iterator[None]:
    """Daemons ``nodes`` stopped (SIGSTOP: connections up, nothing answered), resumed after."""
    for node in nodes:
        cluster.pause(node)
    try:
        yield
    finally:
        for node in nodes:
            cluster.resume(node)


def timed_store(
    client: Client, space: Namespace, tokens: np.ndarray, payloads: list[np.ndarray]
) -> tuple[StoreResult, float]:
    """A store and its seconds."""
    started = time.monotonic()
    stored = client.store(space, tokens, payloads)
    return stored, time.monotonic() - started


def test_round_trip_and_touch(shared_cluster: LocalCluster) -> None:
    space, tokens = ns("round-trip"), prompt(20, 1)
    with client_for(shared_cluster) as client:
        assert client.match_prefix(space, tokens).hit_blocks == 0
        stored = client.store(space, tokens, payloads_for(space, tokens), traffic_class="chat")
        assert (stored.written, stored.failed) == (20, 0)
        match = client.match_prefix(space, tokens)
        assert match.hit_blocks == 20 and match.hit_tokens == 20 * 64
        out = np.zeros((20, P), np.uint8)
        result = client.load(space, match, out=out, traffic_class="chat")
        assert result.blocks == 20 and result.bytes_loaded == 20 * P
        assert all(np.array_equal(out[i], p) for i, p in enumerate(payloads_for(space, tokens)))
        again = client.store(space, tokens, payloads_for(space, tokens), traffic_class="agent")
        assert (again.written, again.touched) == (0, 20)


def test_daemons_sending_from_their_maps_serve_the_same_bytes(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    """``--sendfile-min 0`` (every reply from the segment's mapping) against the default
    (runs of 64 KiB and more with sendfile, as in every other test here): same loads."""
    cluster = cluster_factory(nodes=12, extra_args=("--sendfile-min", "0"))
    space, tokens = ns("from-the-map"), prompt(24, 5)
    with client_for(cluster) as client:
        assert client.store(space, tokens, payloads_for(space, tokens)).written == 24
        assert_loads(client, space, tokens, 24)
        keys = block_keys(space, tokens)[::-3]  # out of order: short runs too
        out = np.zeros((len(keys), P), np.uint8)
        assert client.load_keys(keys, payload_len=P, out=out).blocks == len(keys)
        for row, k in zip(out, keys, strict=True):
            assert np.array_equal(row, payload_for_key(k, P))


def has_requests(cluster: LocalCluster) -> int:
    return sum(int(stats["requests"]["has"]) for stats in cluster.node_stats())


def test_a_store_of_new_blocks_asks_no_has_and_one_of_stored_blocks_touches_them(
    shared_cluster: LocalCluster,
) -> None:
    space, tokens = ns("no-has-first"), prompt(12, 11)
    with client_for(shared_cluster) as client:
        before = has_requests(shared_cluster)
        stored = client.store(space, tokens, payloads_for(space, tokens))
        assert (stored.written, stored.touched, stored.failed) == (12, 0, 0)
        assert has_requests(shared_cluster) == before  # PUTs only
        # Stored already: every holder answers CONFLICT, and the careful pass (HAS first)
        # finds the blocks readable and touches them, writing nothing.
        again = client.store(space, tokens, payloads_for(space, tokens))
        assert (again.written, again.touched, again.failed) == (0, 12, 0)
        assert has_requests(shared_cluster) > before
        assert_loads(client, space, tokens, 12)
    space, tokens = ns("has-first"), prompt(6, 12)
    with client_for(shared_cluster, ask_before_store=True) as client:
        before = has_requests(shared_cluster)
        stored = client.store(space, tokens, payloads_for(space, tokens))
        assert (stored.written, stored.failed) == (6, 0)
        assert has_requests(shared_cluster) > before


def test_a_stripe_short_of_a_writes_quorum_is_not_taken_for_stored(
    shared_cluster: LocalCluster,
) -> None:
    """A stripe with k shards or more but fewer than a write leaves (min_write_shards), every
    holder answering, is what a racing writer leaves while it is still at work, and it rolls
    that back when it misses its quorum: a store touched such a block and reported it stored,
    and the block was gone. Now it is rewritten (here refused CONFLICT: its shards are younger
    than replace_after_s, so the store reports the block failed)."""
    from kvcache.chaos import ShardFault, plant

    space, tokens = ns("short-of-quorum"), prompt(2, 13)
    with client_for(shared_cluster, ask_before_store=True) as client:
        assert client.store(space, tokens, payloads_for(space, tokens)).written == 2
        key = block_keys(space, tokens)[1]
        for index in (4, 9):  # 10 of 12 shards left: readable, short of min_write_shards
            plant(shared_cluster, key, index, ShardFault.MISSING)
        again = client.store(space, tokens, payloads_for(space, tokens))
        assert (again.touched, again.written + again.failed) == (1, 1)
        assert again.failed_blocks in ((), (1,))


def test_stopped_holders_hold_up_no_store_of_stored_blocks_nor_a_touch_or_delete(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    """Two daemons that stop answering (SIGSTOP: their connections stay up) must not make a
    store of a prompt whose prefix is stored wait out the client's timeout: the PUT round
    is decided once every block is written or answered CONFLICT (the silent holders'
    shards of the new blocks sent on), and the touch of the stored blocks, like a delete,
    waits for at most the holders a stripe may lose, then a hedge's time. (Such a store
    used to take the whole ``timeout_s``.)"""
    cluster = cluster_factory()
    timeout_s = 10.0
    space, tokens = ns("stopped-holder"), prompt(24, 21)
    payloads = payloads_for(space, tokens)
    with client_for(cluster, timeout_s=timeout_s, hedge_ms=50.0) as client:
        head = tokens[: 12 * 64]
        assert client.store(space, head, payloads[:12]).written == 12
        with paused(cluster, 3, 7):
            stored, took = timed_store(client, space, tokens, payloads)
            assert (stored.written, stored.touched, stored.failed) == (12, 12, 0)
            assert took < timeout_s / 2, took
            assert_loads(client, space, tokens, 24)
            started = time.monotonic()
            assert client.touch(space, tokens) == 24
            assert time.monotonic() - started < timeout_s / 2
            started = time.monotonic()
            assert client.delete(space, head) == 12
            assert time.monotonic() - started < timeout_s / 2
        # The deleted blocks are gone (the stopped nodes' two shards each are not enough).
        assert client.match_prefix(space, tokens).hit_blocks == 0


def test_a_store_with_two_holders_stopped_sends_their_shards_on_and_is_written(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    """Two daemons that stop answering (as many as 10 + 2 may lose) before the client knows:
    the store's PUT round sends their shards on to live nodes once the others have
    answered, so the blocks are written, well before the timeout (a store like this used to
    wait out ``timeout_s`` and fail every block), and load byte for byte, before and after
    the stopped daemons come back."""
    cluster = cluster_factory()
    timeout_s = 10.0
    space, tokens = ns("two-stopped"), prompt(24, 23)
    payloads = payloads_for(space, tokens)
    with client_for(cluster, timeout_s=timeout_s, hedge_ms=50.0) as client:
        assert client.store(space, prompt(4, 24), payloads[:4]).written == 4  # connections up
        with paused(cluster, 3, 7):
            stored, took = timed_store(client, space, tokens, payloads)
            assert (stored.written, stored.failed) == (24, 0)
            assert took < timeout_s / 2, took
            assert_loads(client, space, tokens, 24)
        assert_loads(client, space, tokens, 24)
    with client_for(cluster) as fresh:  # a client that knows of no trouble at all
        assert_loads(fresh, space, tokens, 24)
    # A store of many chunks, four in flight: the rounds are driven in turn, each after
    # the ones before it, and a later chunk's round sends the silent nodes' shards on as
    # it begins (an earlier round found them silent).
    space, tokens = ns("two-stopped-chunks"), prompt(48, 25)
    payloads = payloads_for(space, tokens)
    config = {"timeout_s": timeout_s, "hedge_ms": 50.0, "chunk_bytes": 4 * P, "window": 4}
    with client_for(cluster, **config) as client:
        assert client.store(space, prompt(4, 26), payloads[:4]).written == 4
        with paused(cluster, 3, 7):
            stored, took = timed_store(client, space, tokens, payloads)
            assert (stored.written, stored.failed) == (48, 0)
            assert took < timeout_s / 2, took
        assert_loads(client, space, tokens, 48)


def test_a_load_of_known_keys_finds_shards_a_writer_sent_to_stand_ins(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    """A writer that found three holders stopped stores: their shards go to stand-ins, so
    placement's holders keep 9 of 12. With every daemon back, a load of the keys alone
    (no match: the one-round-trip load) finds each block short there, matches the rest
    over every node that may hold it, and loads every block byte for byte (it used to load
    none)."""
    cluster = cluster_factory()
    space, tokens = ns("known-keys-spilled"), prompt(16, 31)
    payloads = payloads_for(space, tokens)
    keys = block_keys(space, tokens)
    warm, warm_tokens = ns("known-keys-warm"), prompt(4, 32)
    with client_for(cluster, timeout_s=1.0) as writer:
        assert writer.store(warm, warm_tokens, payloads_for(warm, warm_tokens)).written == 4
        with paused(cluster, 1, 2, 3):
            writer.load_prefix(warm, warm_tokens)  # the writer sees the three stopped
            stored, _took = timed_store(writer, space, tokens, payloads)
            assert (stored.written, stored.failed) == (16, 0)
    with client_for(cluster) as reader:
        result = reader.load_keys(keys, payload_len=P)
        assert result.blocks == 16
        assert all(np.array_equal(a, b) for a, b in zip(result.payloads, payloads, strict=True))
        assert reader.counters["loads_rematched"] == 1
        # Keys that are not stored end the prefix: the match of the rest finds none.
        missing = block_keys(ns("never-stored"), prompt(3, 33))
        assert reader.load_keys([*keys[:2], *missing], payload_len=P).blocks == 2


def test_longer_prompt_hits_only_shared_prefix(shared_cluster: LocalCluster) -> None:
    space = ns("prefix")
    base = prompt(8, 2)
    longer = np.concatenate([base[: 5 * 64], prompt(6, 3)])
    with client_for(shared_cluster) as client:
        client.store(space, base, payloads_for(space, base))
        assert client.match_prefix(space, longer).hit_blocks == 5
        assert_loads(client, space, longer, 5)


def test_missing_middle_block_ends_the_hit(shared_cluster: LocalCluster) -> None:
    space, tokens = ns("hole"), prompt(8, 4)
    pay = payloads_for(space, tokens)
    with client_for(shared_cluster) as client:
        client.store(space, tokens, pay[:3])
        client.store(space, tokens, pay[4:], first_block=4)
        assert client.match_prefix(space, tokens).hit_blocks == 3
        assert_loads(client, space, tokens, 3)


def test_delete_removes_blocks(shared_cluster: LocalCluster) -> None:
    space, tokens = ns("delete"), prompt(4, 5)
    with client_for(shared_cluster) as client:
        client.store(space, tokens, payloads_for(space, tokens))
        assert client.delete(space, tokens) == 4
        assert client.match_prefix(space, tokens).hit_blocks == 0


@pytest.mark.parametrize("dead", [1, 2])
def test_loads_survive_dead_daemons(
    cluster_factory: Callable[..., LocalCluster], dead: int
) -> None:
    cluster = cluster_factory()
    space, tokens = ns("dead"), prompt(24, 6)
    with client_for(cluster, timeout_s=2.0) as client:
        client.store(space, tokens, payloads_for(space, tokens))
        for i in range(dead):
            cluster.kill(i)
        for _ in range(2):  # the first call discovers the dead nodes, the second skips them
            assert_loads(client, space, tokens, 24)
        # The dead holders' shards were rebuilt for the loads, not copied onto stand-ins
        # (read repair waits repair_down_after_s; see kvcache.client.loading._repair).
        assert client.counters["blocks_rebuilt"] > 0
        assert client.counters["shards_repaired"] == 0
        assert sum(s["usage"]["shards"] for s in cluster.node_stats() if s["up"]) == 24 * (
            12 - dead
        )


def test_read_repair_rebuilds_a_gone_holders_shards_on_stand_ins(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    """With ``repair_down_after_s=0`` a dead holder counts as gone at once: loads put its
    shard of every block (one each: 12 nodes, 12 shards) on the live nodes."""
    cluster = cluster_factory()
    space, tokens = ns("stand-in"), prompt(24, 9)

    def live_shards() -> int:
        return sum(s["usage"]["shards"] for s in cluster.node_stats() if s["up"])

    with client_for(cluster, timeout_s=2.0, repair_down_after_s=0.0) as client:
        client.store(space, tokens, payloads_for(space, tokens))
        cluster.kill(3)
        before = live_shards()
        assert before == 24 * 11
        for _ in range(3):  # the first discovers the dead node; they all rebuild and repair
            assert_loads(client, space, tokens, 24)
        assert client.counters["shards_repaired"] >= 24
        assert live_shards() == 24 * 12  # every block whole again, without node 3


def test_repair_down_after_s_must_not_be_negative(shared_cluster: LocalCluster) -> None:
    with pytest.raises(ConfigError, match="repair_down_after_s"):
        shared_cluster.client_config(repair_down_after_s=-1)


def test_three_dead_daemons_give_clean_misses(cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = cluster_factory()
    space, tokens = ns("three-dead"), prompt(10, 7)
    with client_for(cluster, timeout_s=1.0) as client:
        client.store(space, tokens, payloads_for(space, tokens))
        for i in range(3):
            cluster.kill(i)
        result = client.load_prefix(space, tokens)
        assert result.blocks == 0 and result.payloads == []
        stored = client.store(space, tokens, payloads_for(space, tokens))
        assert stored.failed == 10 and stored.written == 0


def test_paused_daemon_costs_no_wait(cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = cluster_factory()
    space, tokens = ns("paused"), prompt(32, 8)
    timeout = 5.0
    with client_for(cluster, timeout_s=timeout) as client:
        client.store(space, tokens, payloads_for(space, tokens))
        cluster.pause(0)
        try:
            for _ in range(3):
                started = time.monotonic()
                assert_loads(client, space, tokens, 32)
                assert time.monotonic() - started < timeout / 2
        finally:
            cluster.resume(0)


def test_racing_writers_never_mix(shared_cluster: LocalCluster) -> None:
    """Two writers delete and store different bytes under the same keys while a reader
    loads: every block ever returned equals one writer's bytes, never a mix."""
    space, tokens = ns("race"), prompt(6, 9)
    keys = block_keys(space, tokens)
    variants = [
        [payload_for_key(k, P) for k in keys],
        [np.bitwise_not(payload_for_key(k, P)) for k in keys],
    ]
    clients = [client_for(shared_cluster) for _ in range(3)]
    bad: list[int] = []
    writing = threading.Event()
    writing.set()
    try:
        barrier = threading.Barrier(3)

        def write(i: int) -> None:
            barrier.wait()
            for _ in range(6):
                clients[i].delete(space, tokens)
                clients[i].store(space, tokens, variants[i])

        def read() -> None:
            barrier.wait()
            while writing.is_set():
                result = clients[2].load_prefix(space, tokens)
                for b, got in enumerate(result.payloads):
                    if not (
                        np.array_equal(got, variants[0][b]) or np.array_equal(got, variants[1][b])
                    ):
                        bad.append(b)

        writers = [threading.Thread(target=write, args=(i,)) for i in range(2)]
        reader = threading.Thread(target=read)
        for t in [*writers, reader]:
            t.start()
        for t in writers:
            t.join(timeout=60)
        writing.clear()
        reader.join(timeout=60)
        assert bad == []
        # Deleting and storing again gives whole blocks.
        clients[0].delete(space, tokens)
        clients[0].store(space, tokens, variants[0])
        final = clients[2].load_prefix(space, tokens)
        assert final.blocks == len(keys)
        for b, got in enumerate(final.payloads):
            assert np.array_equal(got, variants[0][b])
    finally:
        for c in clients:
            c.close()


def test_concurrent_stores_never_ack_an_unreadable_block(shared_cluster: LocalCluster) -> None:
    """Two writers store different bytes for the same fresh blocks at the same moment: a
    block either writer was told is stored (written or already there) must load, whole."""
    clients = [client_for(shared_cluster) for _ in range(3)]
    unreadable = 0
    both_written = 0
    try:
        for race in range(12):
            space, tokens = ns(f"store-race-{race}"), prompt(4, 100 + race)
            keys = block_keys(space, tokens)
            variants = [
                [payload_for_key(k, P) for k in keys],
                [np.bitwise_not(payload_for_key(k, P)) for k in keys],
            ]
            results: list[object] = [None, None]
            barrier = threading.Barrier(2)

            def write(
                i: int,
                variants: list[list[np.ndarray]] = variants,
                barrier: threading.Barrier = barrier,
                results: list[object] = results,
                space: Namespace = space,
                tokens: np.ndarray = tokens,
            ) -> None:
                barrier.wait()
                results[i] = clients[i].store(space, tokens, variants[i])

            threads = [threading.Thread(target=write, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
            acked = [
                set(range(len(keys))) - set(r.failed_blocks)  # type: ignore[attr-defined]
                for r in results
            ]
            written = [
                set(range(len(keys))) - set(r.failed_blocks)  # type: ignore[attr-defined]
                if r.touched == 0  # type: ignore[attr-defined]
                else set()
                for r in results
            ]
            both_written += len(written[0] & written[1])
            loaded = clients[2].load_prefix(space, tokens)
            for b in acked[0] | acked[1]:
                if b >= loaded.blocks:
                    unreadable += 1
                    continue
                got = loaded.payloads[b]
                assert np.array_equal(got, variants[0][b]) or np.array_equal(got, variants[1][b])
        assert unreadable == 0
        assert both_written == 0
    finally:
        for c in clients:
            c.close()


def test_node_marked_down_is_probed_when_others_die(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    """A node marked down (it was paused) is still asked once skipping it would leave
    fewer than k holders: after it resumes and two others die, loads stay whole."""
    cluster = cluster_factory()
    space, tokens = ns("probe"), prompt(12, 10)
    with client_for(cluster, timeout_s=0.5, down_retry_s=600.0) as client:
        client.store(space, tokens, payloads_for(space, tokens))
        cluster.pause(5)
        try:
            client.match_prefix(space, tokens)
            client.stats()  # waits out the timeout on the paused node: it is marked down
        finally:
            cluster.resume(5)
        assert "node-05" in client.core.health.down_nodes()
        cluster.kill(0)
        cluster.kill(1)
        assert_loads(client, space, tokens, 12)


def test_damaged_block_ends_the_load_and_the_next_store_repairs_it(
    shared_cluster: LocalCluster,
) -> None:
    """Three shards of block 2 replaced by wrong bytes with self-consistent checksums: a
    match still counts 12 shards, the load refuses the block (never wrong bytes), and the
    next store rewrites it instead of merely touching it."""
    space, tokens = ns("damaged"), prompt(5, 11)
    pay = payloads_for(space, tokens)
    keys = block_keys(space, tokens)
    with client_for(shared_cluster) as client:
        client.store(space, tokens, pay)
        damage_block(shared_cluster, keys[2])
        assert client.match_prefix(space, tokens).hit_blocks == 5
        assert_loads(client, space, tokens, 2)
        assert client.counters["blocks_corrupt"] == 1
        again = client.store(space, tokens, pay, traffic_class="chat")
        assert again.written == 1 and again.touched == 4
        assert_loads(client, space, tokens, 5)


def test_a_corrupt_or_forged_shard_costs_no_hit(shared_cluster: LocalCluster) -> None:
    """One shard's body damaged with a recomputed checksum (forged) in every block: every load
    is whole and byte-identical, and every damaged shard it reads is found."""
    space, tokens = ns("forged"), prompt(6, 12)
    pay = payloads_for(space, tokens)
    keys = block_keys(space, tokens)
    with client_for(shared_cluster) as client:
        client.store(space, tokens, pay)
        damaged = [
            damage_block(shared_cluster, key, shards=1, first_node=b)[0]
            for b, key in enumerate(keys)
        ]
        assert_loads(client, space, tokens, 6)
        # A load checks the payload its data shards make: each damaged data shard is
        # found (and the block rebuilt without it); a damaged parity shard costs nothing
        # while every data shard arrives. (Six of the prompt's blocks: most of the damage
        # is to data shards.)
        data = sum(1 for i in damaged if i < 10)
        counters = client.counters
        assert data >= 3
        assert counters["bad_shards_found"] == data and counters["blocks_rebuilt"] == data
        assert counters["blocks_corrupt"] == 0


def test_client_refuses_bad_arguments_before_any_io(shared_cluster: LocalCluster) -> None:
    space, tokens = ns("args"), prompt(2, 13)
    with client_for(shared_cluster) as client:
        known = MatchResult.known(block_keys(space, tokens), n=12)
        bad_calls = [
            lambda: client.match_prefix("not a namespace", tokens),  # type: ignore[arg-type]
            lambda: client.match_prefix(space, "abc"),  # type: ignore[arg-type]
            lambda: client.match_prefix(space, [1.5, 2.5]),  # type: ignore[list-item]
            lambda: client.store(space, tokens, [b"short", b"short"]),
            lambda: client.store(space, tokens, np.zeros((2, P), np.float32)),  # type: ignore[arg-type]
            lambda: client.store(space, tokens, 42),  # type: ignore[arg-type]
            lambda: client.store(space, tokens, payloads_for(space, tokens), traffic_class="BAD!"),
            lambda: client.load(space, "match"),  # type: ignore[arg-type]
            lambda: client.load_prefix(space, tokens, out=np.zeros((2, P), np.float32)),  # type: ignore[arg-type]
            lambda: client.store_keys([b"short"], [b"x"], payload_len=1),
            lambda: client.store(space, tokens, payloads_for(space, tokens), first_block=-1),
            lambda: client.match_keys(block_keys(space, tokens), tokens_per_block=0),
            lambda: client.match_keys(block_keys(space, tokens), tokens_per_block="a"),  # type: ignore[arg-type]
            lambda: client.match_with_directory(block_keys(space, tokens), tokens_per_block=-1),
            lambda: client.alloc_buffer(1 << 40, 1 << 40),  # past any host's memory
            lambda: client.match_prefix(space, tokens, max_blocks=-1),  # was an empty match
            # Hint(store=False) stores nothing, but a bad call is still an error.
            lambda: client.store_keys(["nope"], None, payload_len=-5, hint=Hint(store=False)),  # type: ignore[list-item,arg-type]
            # Blocks named by keys (no HAS first): the buffer for them cannot be had.
            lambda: client.load_keys(block_keys(space, tokens), payload_len=10**12),
            # MatchResults no match of this client makes.
            lambda: client.load(space, dataclasses.replace(known, hit_blocks=-1)),
            lambda: client.load(space, dataclasses.replace(known, holders=known.holders[:, :3])),
            lambda: client.load(space, dataclasses.replace(known, holders=known.holders + 99)),
            lambda: client.load(space, dataclasses.replace(known, stripe=known.stripe[:1])),
        ]
        for call in bad_calls:
            with pytest.raises(ArgumentError):
                call()
        assert client.match_prefix(space, tokens).hit_blocks == 0  # nothing was stored


def test_clients_without_the_right_credentials_get_nothing(shared_cluster: LocalCluster) -> None:
    space, tokens = ns("creds"), prompt(2, 14)
    with client_for(shared_cluster) as owner:
        owner.store(space, tokens, payloads_for(space, tokens))
    with pytest.raises(ConfigError, match="no credentials"):
        Client(ClientConfig(cluster_file=shared_cluster.cluster_file))
    stranger_config = ClientConfig(cluster_file=shared_cluster.cluster_file, secret="ab" * 32)
    with Client(stranger_config) as stranger:
        errors = [entry.get("error", "") for entry in stranger.stats().values()]
        assert len(errors) == 12 and all("refused" in e for e in errors)
        assert stranger.match_prefix(space, tokens).hit_blocks == 0
