"""Read repair and the load path trust no header field they have not checked.

Issue 18, item 4: a stored shard's header damaged on every copy (byte 84 or 85 of
its 104 bytes, the traffic-class name), with another shard of the block deleted so
that a repair is due, used to make every later load raise. Also valid-looking records
that carry a wrong class or a wrong payload hash must not be copied into repairs.
Real daemons, real LMDB files, the shipped client.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from kvcache.chaos import ShardFault, _probe, find_shard, flip_record_byte, plant
from kvcache.client import Client
from kvcache.keys import BlockKey, Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.shard import HEADER_BYTES, ShardHeader
from kvcache.testing.localcluster import LocalCluster
from kvcache.wire import Status
from kvcache.workload import payload_for_key

SMALL = KVLayout(tokens_per_block=16, bytes_per_token=64, dtype=DType.INT8, layers_in_block=1)


def space(name: str) -> Namespace:
    return Namespace(model=name, revision="1", layout=SMALL)


def tokens_for(blocks: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50_000, blocks * SMALL.tokens_per_block).astype(np.uint32)


def store(client: Client, ns: Namespace, toks: np.ndarray) -> None:
    payloads = [payload_for_key(k, ns.layout.payload_bytes) for k in block_keys(ns, toks)]
    assert client.store(ns, toks, payloads).written == len(payloads)


def load(client: Client, ns: Namespace, toks: np.ndarray) -> tuple[int, int]:
    """(blocks loaded, wrong bytes among them)."""
    result = client.load_prefix(ns, toks)
    expected = [payload_for_key(k, ns.layout.payload_bytes) for k in block_keys(ns, toks)]
    wrong = sum(
        int(np.count_nonzero(got != want))
        for got, want in zip(result.payloads, expected, strict=False)
    )
    return result.blocks, wrong


def wait_sound(cluster: LocalCluster, key: BlockKey, index: int, deadline_s: float = 10) -> bytes:
    """The record of shard ``index`` once its stored header parses (read repair landed)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            record = find_shard(cluster, key, index)[2]
            ShardHeader.unpack(record)
            return record
        except Exception:
            assert time.monotonic() < deadline, f"shard {index} was never repaired"
            time.sleep(0.02)


@pytest.mark.parametrize(("position", "mask"), [(85, 0xFC), (84, 0xFC), (84, 0x01), (90, 0x80)])
def test_damaged_class_name_on_every_copy_is_decoded_around_and_repaired(
    shared_cluster: LocalCluster, position: int, mask: int
) -> None:
    ns, toks = space(f"class-flip-{position}-{mask}"), tokens_for(2, position * 7 + mask)
    with Client(shared_cluster.client_config()) as client:
        store(client, ns, toks)
        key = block_keys(ns, toks)[0]
        node, _stripe, record = find_shard(shared_cluster, key, 0)
        flip_record_byte(shared_cluster, node, record, position, mask=mask)
        plant(shared_cluster, key, 3, ShardFault.MISSING)
        for _ in range(5):
            assert load(client, ns, toks) == (2, 0)
        repaired = ShardHeader.unpack(wait_sound(shared_cluster, key, 0))
        assert repaired.traffic_class == ShardHeader.unpack(record).traffic_class
        again = ShardHeader.unpack(wait_sound(shared_cluster, key, 3))
        assert again.traffic_class == repaired.traffic_class
        assert load(client, ns, toks) == (2, 0)


def _put_record(cluster: LocalCluster, node: int, key: BlockKey, index: int, record: bytes) -> None:
    with _probe(cluster, node, "default") as probe:
        assert probe.put([(key, index, record)])[0] == Status.OK


@pytest.mark.parametrize("variant", ["other-class", "wrong-payload-hash"])
def test_valid_record_with_wrong_claims_is_not_copied(
    shared_cluster: LocalCluster, variant: str
) -> None:
    """A self-consistent record (its header checksum holds) with a class or payload hash
    that the other shards do not claim: loads are whole, and repairs carry the block's
    own class and hash, never the odd one's."""
    ns, toks = space(f"odd-{variant}"), tokens_for(2, len(variant))
    with Client(shared_cluster.client_config()) as client:
        store(client, ns, toks)
        key = block_keys(ns, toks)[0]
        node, _stripe, record = find_shard(shared_cluster, key, 0)
        header = ShardHeader.unpack(record)
        if variant == "other-class":
            odd = dataclasses.replace(header, traffic_class="default4")
        else:
            odd = dataclasses.replace(header, payload_hash=bytes(16))
        _put_record(shared_cluster, node, key, 0, odd.pack() + record[HEADER_BYTES:])
        plant(shared_cluster, key, 5, ShardFault.MISSING)
        for _ in range(3):
            assert load(client, ns, toks) == (2, 0)
        repaired = ShardHeader.unpack(wait_sound(shared_cluster, key, 5))
        assert repaired.traffic_class == header.traffic_class
        assert repaired.payload_hash == header.payload_hash
        assert load(client, ns, toks) == (2, 0)
