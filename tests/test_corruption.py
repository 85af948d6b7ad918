"""Damaged shards inside live daemons cost no wrong bytes and, up to the redundancy, no hits.

Faults are planted with :mod:`kvcache.chaos` in a real 12-daemon cluster:
bytes flipped in the daemons' LMDB files while they run, shards deleted, and
forged shards whose own checksums match. Loads go through the shipped client.
"""

from __future__ import annotations

import itertools
import time
import zlib

import numpy as np
import pytest

from kvcache.chaos import ShardFault, find_shard, flip_record_byte, plant, unflip
from kvcache.client import Client
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.shard import HEADER_BYTES
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key

# Small blocks keep the every-byte sweep short: 1 KiB payloads, shards of about 100 bytes.
SMALL = KVLayout(tokens_per_block=16, bytes_per_token=64, dtype=DType.INT8, layers_in_block=1)
BIG = KVLayout(tokens_per_block=64, bytes_per_token=1792, dtype=DType.BFLOAT16, layers_in_block=7)


def space(name: str, layout: KVLayout = BIG) -> Namespace:
    return Namespace(model=name, revision="1", layout=layout)


def tokens_for(blocks: int, seed: int, layout: KVLayout = BIG) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50_000, blocks * layout.tokens_per_block).astype(np.uint32)


def stored(client: Client, ns: Namespace, tokens: np.ndarray) -> list[np.ndarray]:
    payloads = [payload_for_key(k, ns.layout.payload_bytes) for k in block_keys(ns, tokens)]
    result = client.store(ns, tokens, payloads)
    assert result.written == len(payloads)
    return payloads


def loaded(client: Client, ns: Namespace, tokens: np.ndarray) -> tuple[int, int]:
    """(blocks loaded, wrong bytes among them)."""
    result = client.load_prefix(ns, tokens)
    expected = [payload_for_key(k, ns.layout.payload_bytes) for k in block_keys(ns, tokens)]
    wrong = sum(
        int(np.count_nonzero(got != want))
        for got, want in zip(result.payloads, expected, strict=False)
    )
    return result.blocks, wrong


def test_every_single_byte_flip_of_a_stored_shard_costs_nothing(
    shared_cluster: LocalCluster,
) -> None:
    """Tahoe-style: each byte of one stored shard (header and body) flipped in turn, in the
    daemon's file while it serves: every load is whole and byte-identical."""
    ns, toks = space("every-byte", SMALL), tokens_for(2, 1, SMALL)
    with Client(shared_cluster.client_config(read_repair=False)) as client:
        stored(client, ns, toks)
        key = block_keys(ns, toks)[0]
        node, _stripe, record = find_shard(shared_cluster, key, 0)  # a data shard: always read
        assert len(record) > HEADER_BYTES + 1024 // 10  # header + one tenth, padded
        for position in range(len(record)):
            offsets = flip_record_byte(shared_cluster, node, record, position)
            try:
                assert loaded(client, ns, toks) == (2, 0), position
            finally:
                unflip(shared_cluster, node, offsets)
        # Every flip of the body, and of every header field a load relies on, is found (and
        # would be repaired). Header bytes a load never uses (the shard's class, its times)
        # are the daemon's scrub's to find.
        body = len(record) - HEADER_BYTES
        assert body < client.counters["bad_shards_found"] <= len(record)
        assert client.counters["blocks_corrupt"] == 0


KINDS = list(ShardFault)


@pytest.mark.parametrize("kinds", [*((k,) for k in KINDS), *itertools.combinations(KINDS, 2)])
def test_one_or_two_bad_shards_of_any_kind_cost_no_hit(
    shared_cluster: LocalCluster, kinds: tuple[ShardFault, ...]
) -> None:
    """One bad shard of each kind, and every pair of kinds, in every block (data and parity
    shards alike): every load is whole and byte-identical."""
    name = "bad-" + "-".join(k.value for k in kinds)
    ns, toks = space(name), tokens_for(4, zlib.crc32(name.encode()))
    with Client(shared_cluster.client_config(read_repair=False)) as client:
        stored(client, ns, toks)
        for b, key in enumerate(block_keys(ns, toks)):
            for j, kind in enumerate(kinds):
                plant(shared_cluster, key, (b * 5 + j * 7) % 12, kind)
        assert loaded(client, ns, toks) == (4, 0)
        assert client.counters["blocks_corrupt"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_two_bad_shards_of_one_kind_cost_no_hit(
    shared_cluster: LocalCluster, kind: ShardFault
) -> None:
    ns, toks = space(f"two-{kind.value}"), tokens_for(3, 40 + KINDS.index(kind))
    with Client(shared_cluster.client_config(read_repair=False)) as client:
        stored(client, ns, toks)
        for b, key in enumerate(block_keys(ns, toks)):
            for index in (b, b + 6):  # a data shard and a data-or-parity one
                plant(shared_cluster, key, index, kind)
        assert loaded(client, ns, toks) == (3, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_three_bad_shards_give_a_clean_miss(shared_cluster: LocalCluster, kind: ShardFault) -> None:
    """Three bad shards of block 1 are beyond 10 + 2: the load stops before it, block 0
    still loads, and no wrong byte is ever handed out."""
    ns, toks = space(f"three-{kind.value}"), tokens_for(3, 60 + KINDS.index(kind))
    with Client(shared_cluster.client_config(read_repair=False)) as client:
        stored(client, ns, toks)
        key = block_keys(ns, toks)[1]
        for index in (0, 4, 11):
            # A header byte of the block key field: the shard is not the one asked for.
            plant(shared_cluster, key, index, kind, position=30)
        assert loaded(client, ns, toks) == (1, 0)


def test_bad_payload_claims_in_headers_are_outvoted(shared_cluster: LocalCluster) -> None:
    """Three headers whose payload-hash claim is damaged (bodies intact): the claim most
    shards make wins, the block loads whole, and the three shards are reported bad."""
    ns, toks = space("outvoted"), tokens_for(2, 80)
    with Client(shared_cluster.client_config(read_repair=False)) as client:
        stored(client, ns, toks)
        key = block_keys(ns, toks)[0]
        for index in (0, 4, 10):
            plant(shared_cluster, key, index, ShardFault.CORRUPT_HEADER, position=50)
        assert loaded(client, ns, toks) == (2, 0)
        assert client.counters["bad_shards_found"] >= 2


def test_read_repair_puts_a_good_shard_back(shared_cluster: LocalCluster) -> None:
    """A flipped byte found by a load is replaced on its node by a good copy."""
    ns, toks = space("repair"), tokens_for(2, 7)
    with Client(shared_cluster.client_config()) as client:
        stored(client, ns, toks)
        key = block_keys(ns, toks)[0]
        good = find_shard(shared_cluster, key, 2)[2]
        plant(shared_cluster, key, 2, ShardFault.CORRUPT_BODY)
        assert loaded(client, ns, toks) == (2, 0)
        assert client.counters["bad_shards_found"] == 1
        # The repair PUT is sent in the background: wait (bounded) until the node has it.
        deadline = time.monotonic() + 10
        while find_shard(shared_cluster, key, 2)[2] != good:
            assert time.monotonic() < deadline, "the bad shard was never replaced"
            time.sleep(0.02)
        assert client.counters["shards_repaired"] == 1
