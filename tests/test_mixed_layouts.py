"""Stripes a client cannot read are rewritten, never raised on (issue 18, items 4 and 8).

Real daemons on loopback, the shipped client. Two kinds of stripe a client can see
but never read: one written with other erasure parameters (a 10 + 4 store, then a
10 + 2 client's store of the same prompt; 4 + 2 over 10 + 2), and one whose stored
records are valid records of another key or a self-consistent record of another
stripe. A load misses them cleanly; the next store writes the block again.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvcache.chaos import find_shard
from kvcache.client import Client
from kvcache.keys import BlockKey, Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.server.records import WRITTEN_RESOLUTION_MS
from kvcache.shard import HEADER_BYTES, ShardHeader
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key

#: The cluster's replace_after_s (10 s by default): the rewrite is seen without that wait.
REPLACE_AFTER_S = 0.2
SMALL = KVLayout(tokens_per_block=16, bytes_per_token=64, dtype=DType.INT8, layers_in_block=1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """12 daemons that let a PUT replace an unreadable stripe 0.2 s after it was written
    (10 s by default): the rewrite is seen without waiting that long."""
    root = tmp_path_factory.mktemp("mixed")
    config = root / "server.toml"
    config.write_text(f"[server]\nreplace_after_s = {REPLACE_AFTER_S}\n")
    c = LocalCluster(root / "cluster")
    c.start(nodes=12, capacity="64MiB", extra_args=("--config", str(config)))
    yield c
    c.stop()


def prompt(name: str, blocks: int = 3) -> tuple[Namespace, np.ndarray, list[np.ndarray]]:
    ns = Namespace(model=name, revision="1", layout=SMALL)
    toks = np.random.default_rng(len(name)).integers(0, 50_000, blocks * 16).astype(np.uint32)
    return ns, toks, [payload_for_key(k, SMALL.payload_bytes) for k in block_keys(ns, toks)]


#: How long after it was stored a leftover shard may be replaced at the latest: the
#: cluster's replace_after_s, plus the written time's resolution (a row keeps it in whole
#: seconds rounded up, so a shard looks up to a second younger than it is).
REPLACEABLE_AFTER_S = REPLACE_AFTER_S + WRITTEN_RESOLUTION_MS / 1000


def until_written(client: Client, ns: Namespace, toks: np.ndarray, pl: list[np.ndarray]) -> None:
    """Store until every block is written or touched (a young stripe is not replaced:
    CONFLICT until it is REPLACEABLE_AFTER_S old); each round waits for the last one's
    answer, and the rounds stop well after every stripe here became replaceable."""
    deadline = time.monotonic() + 5 * REPLACEABLE_AFTER_S
    while True:
        result = client.store(ns, toks, pl)
        if result.failed == 0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"store never succeeded: {result}")
        client.load_prefix(ns, toks)  # a round trip: time passes on the daemons


def loaded_whole(client: Client, ns: Namespace, toks: np.ndarray, pl: list[np.ndarray]) -> bool:
    result = client.load_prefix(ns, toks)
    return result.blocks == len(pl) and all(
        np.array_equal(a, b) for a, b in zip(result.payloads, pl, strict=True)
    )


@pytest.mark.parametrize(
    ("first", "second"),
    [((10, 4, 12), (10, 2, 11)), ((10, 2, 11), (4, 2, 5)), ((4, 2, 5), (10, 2, 11))],
    ids=["10+4-then-10+2", "10+2-then-4+2", "4+2-then-10+2"],
)
def test_other_erasure_parameters_are_rewritten(
    cluster: LocalCluster, first: tuple[int, int, int], second: tuple[int, int, int]
) -> None:
    ns, toks, pl = prompt(f"mixed-{first}-{second}")
    (k1, m1, w1), (k2, m2, w2) = first, second
    with Client(cluster.client_config(k=k1, m=m1, min_write_shards=w1)) as a:
        assert a.store(ns, toks, pl).written == len(pl)
    with Client(cluster.client_config(k=k2, m=m2, min_write_shards=w2)) as b:
        until_written(b, ns, toks, pl)
        # The first store may only have touched a stripe it cannot read: then the load
        # misses it, drops it, and the next store writes it.
        if not loaded_whole(b, ns, toks, pl):
            until_written(b, ns, toks, pl)
        assert loaded_whole(b, ns, toks, pl)


@pytest.mark.parametrize(
    ("first", "second"),
    [((10, 2, 11), (8, 4, 10)), ((8, 4, 10), (10, 2, 11)), ((10, 4, 12), (12, 2, 13))],
    ids=["10+2-seen-by-8+4", "8+4-seen-by-10+2", "10+4-seen-by-12+2"],
)
def test_a_load_of_other_erasure_parameters_leaves_the_stripe_to_its_readers(
    cluster: LocalCluster, first: tuple[int, int, int], second: tuple[int, int, int]
) -> None:
    """Shards of another erasure layout of the same width or less carry indices this client
    asks for too, so no HAS answer tells them apart: a match takes the stripe for whole and
    the load rejects every shard. The load must leave the stripe alone (it dropped it from
    every holder, so one client's loads erased what a client of the other layout reads),
    count it, and have this client's next stores not take it for stored: they replace it
    once its shards are replace_after_s old."""
    ns, toks, pl = prompt(f"other-erasure-{first}-{second}")
    (k1, m1, w1), (k2, m2, w2) = first, second
    with Client(cluster.client_config(k=k1, m=m1, min_write_shards=w1)) as a:
        assert a.store(ns, toks, pl).written == len(pl)
        with Client(cluster.client_config(k=k2, m=m2, min_write_shards=w2)) as b:
            assert b.load_prefix(ns, toks).blocks == 0  # a clean miss
            # One load finds every block of the prompt (they were fetched together).
            assert b.counters["blocks_other_erasure"] == len(pl)
            assert b.counters["blocks_corrupt"] == b.counters["stripes_dropped"] == 0
            assert loaded_whole(a, ns, toks, pl)  # still whole for its own layout
            until_written(b, ns, toks, pl)
            assert b.counters["blocks_written"] >= 1  # replaced, not only touched
            assert loaded_whole(b, ns, toks, pl)


def test_one_load_marks_every_broken_block_it_fetched_for_the_next_store(
    cluster: LocalCluster,
) -> None:
    """Three shards of each of blocks 1..3 rotten (more than m): a load stops at block 1 and
    drops its stripe, but it fetched and checked all four blocks. The next store must
    rewrite all three broken ones (it rewrote block 1 and touched 2 and 3, so a prompt
    with n broken blocks took n load-and-store rounds to be whole again)."""
    from kvcache.chaos import ShardFault, plant

    ns, toks, pl = prompt("broken-past-the-first", blocks=4)
    keys = block_keys(ns, toks)
    with Client(cluster.client_config()) as client:
        assert client.store(ns, toks, pl).written == 4
        for key in keys[1:]:
            for index in (0, 4, 7):
                plant(cluster, key, index, ShardFault.CORRUPT_BODY)
        assert client.load_prefix(ns, toks).blocks == 1
        assert client.counters["blocks_corrupt"] == 1  # block 1's stripe dropped
        # Blocks 2 and 3 keep their broken stripe, which a PUT may replace once it is
        # REPLACEABLE_AFTER_S old (CONFLICT before): stores until none fails.
        until_written(client, ns, toks, pl)
        assert client.counters["blocks_written"] == 4 + 3  # rewritten, none only touched
        assert loaded_whole(client, ns, toks, pl)


def _overwrite(cluster: LocalCluster, node: int, old: bytes, new: bytes) -> None:
    """Replace every copy of record ``old`` in node ``node``'s data file by ``new`` (same
    length), as a disk would that returned another sector."""
    assert len(old) == len(new)
    directory = Path(cluster.data_dir(node))
    found = 0
    # Store format v4 keeps records in segment files beside the LMDB index.
    for path in [directory / "data.mdb", *(directory / "segments").glob("*.seg")]:
        if not path.exists() or not path.stat().st_size:
            continue
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            offsets = []
            at = mm.find(old)
            while at >= 0:
                offsets.append(at)
                at = mm.find(old, at + 1)
        fd = os.open(path, os.O_RDWR)
        try:
            for at in offsets:
                os.pwrite(fd, new, at)
        finally:
            os.close(fd)
        found += len(offsets)
    assert found


def _other_stripe(record: bytes) -> bytes:
    import dataclasses

    header = ShardHeader.unpack(record)
    return (
        dataclasses.replace(header, stripe_id=header.stripe_id ^ 0x5A5A).pack()
        + record[HEADER_BYTES:]
    )


@pytest.mark.parametrize("kind", ["other-key", "other-stripe"])
def test_stripe_with_more_than_m_rejected_shards_is_dropped_and_rewritten(
    cluster: LocalCluster, kind: str
) -> None:
    ns, toks, pl = prompt(f"rejected-{kind}")
    keys: list[BlockKey] = block_keys(ns, toks)
    with Client(cluster.client_config()) as client:
        assert client.store(ns, toks, pl).written == 3
        for index in (1, 6, 10):
            node, _stripe, record = find_shard(cluster, keys[1], index)
            if kind == "other-key":
                replacement = find_shard(cluster, keys[2], index)[2]
                if len(replacement) != len(record):  # pragma: no cover - same layout
                    pytest.skip("records differ in length")
            else:
                replacement = _other_stripe(record)
            _overwrite(cluster, node, record, replacement)
        assert client.load_prefix(ns, toks).blocks == 1  # a clean miss at block 1
        assert client.counters["blocks_corrupt"] >= 1
    with Client(cluster.client_config()) as fresh:  # not the client that saw it broken
        until_written(fresh, ns, toks, pl)
        assert loaded_whole(fresh, ns, toks, pl)


def test_a_load_asking_another_payload_length_never_drops_the_block(
    cluster: LocalCluster,
) -> None:
    """A caller's wrong ``payload_len`` (or a namespace of another layout) makes every shard
    of a block the wrong size for it: a clean miss, counted, and the block stays, whole for
    every reader that asks the right length (such loads used to drop it everywhere)."""
    ns, toks, pl = prompt("other-payload-len")
    with Client(cluster.client_config()) as writer:
        assert writer.store(ns, toks, pl).written == 3
    with Client(cluster.client_config()) as reader:
        match = reader.match_prefix(ns, toks)
        assert match.hit_blocks == 3
        for wrong in (SMALL.payload_bytes - 1, SMALL.payload_bytes * 2):
            assert reader.load_keys(match, payload_len=wrong).blocks == 0
        assert reader.counters["blocks_other_payload_len"] == 2
        assert reader.counters["blocks_corrupt"] == reader.counters["stripes_dropped"] == 0
    with Client(cluster.client_config()) as fresh:
        assert fresh.match_prefix(ns, toks).hit_blocks == 3
        assert loaded_whole(fresh, ns, toks, pl)


def test_a_store_replaces_every_leftover_shard_of_a_stripe(cluster: LocalCluster) -> None:
    """Two shards of a stripe whose writer failed (its rollback lost) stay on their
    holders; once they are replace_after_s old, a store must replace both, and the block
    ends with all 12 shards of the new stripe (it replaced only one before)."""
    from kvcache.chaos import _probe
    from kvcache.server.probe import fake_shard

    ns, toks, pl = prompt("leftovers", blocks=1)
    key = block_keys(ns, toks)[0]
    # The careful store's HAS waits for every holder until the hedge time; one derived from
    # loopback latency (about a millisecond) can pass before a busy CI machine's holder
    # answers, and a leftover it did not hear of is not named, so not replaced (the block is
    # then acknowledged with 11 shards: correct, but not what this test is about).
    with Client(cluster.client_config(hedge_ms=5000)) as client:
        holders = client.core.view().targets([key], client.core.up_mask(client.core.view()))[0][0]
        for index in (3, 8):
            node = int(holders[index])
            with _probe(cluster, node, "default") as probe:
                record = fake_shard(
                    key, index, bytes(128), stripe_id=0xDEAD, traffic_class="default"
                )
                assert probe.put([(key, index, record)]).tolist() == [0]
        # The premise: both leftovers are replaceable when the store runs. Stored at
        # slightly different moments, one could otherwise still be young when the other is
        # not: that one is refused (CONFLICT), the block is acknowledged with 11 shards, and
        # the leftover stays. A written time is kept in whole seconds rounded up, so the
        # wait is replace_after_s plus that second.
        aged = time.monotonic() + REPLACEABLE_AFTER_S + 0.1
        while time.monotonic() < aged:
            client.load_prefix(ns, toks)  # round trips while the daemons' clocks move on
        until_written(client, ns, toks, pl)
        stripes = {i: find_shard(cluster, key, i)[1] for i in range(12)}
        assert 0xDEAD not in stripes.values()
        assert len(set(stripes.values())) == 1, stripes
        assert loaded_whole(client, ns, toks, pl)
