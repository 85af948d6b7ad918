"""Pure client logic: prefix matching, read planning, stripe assembly and repair."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.client.encoding import build_node_records, encode_stripes
from kvcache.client.plan import HeldShards, StripeAssembly, match_from_held, plan_reads
from kvcache.erasure import Backend, ErasureParams, get_codec
from kvcache.keys import BlockKey
from kvcache.shard import HEADER_BYTES, split_shard
from kvcache.workload import payload_for_key

K, N = 10, 12
P = 114688


def keys(count: int, seed: int = 1) -> list[BlockKey]:
    rng = np.random.default_rng(seed)
    return [BlockKey(rng.bytes(16)) for _ in range(count)]


def held_for(stripes_per_block: list[dict[int, int]]) -> list[HeldShards]:
    """HAS answers where node j holds shard j of the given stripe of each block."""
    out = []
    for node in range(N):
        ordinal, stripe = [], []
        for b, shard_map in enumerate(stripes_per_block):
            if node in shard_map:
                ordinal.append(b)
                stripe.append(shard_map[node])
        out.append(
            HeldShards(
                node=node,
                ordinal=np.array(ordinal, np.int64),
                index=np.full(len(ordinal), node, np.int64),
                stripe=np.array(stripe, np.uint64),
            )
        )
    return out


def test_match_stops_at_first_block_without_k_shards() -> None:
    full = {i: 7 for i in range(N)}
    nine = {i: 7 for i in range(9)}
    blocks = [full, full, nine, full]
    m = match_from_held(keys(4), held_for(blocks), k=K, n=N, tokens_per_block=512)
    assert m.hit_blocks == 2
    assert m.hit_tokens == 1024
    assert list(m.best_count) == [12, 12, 9, 12]
    assert (m.holders == np.arange(N)).all()


def test_match_never_mixes_stripes() -> None:
    mixed = {i: (1 if i < 6 else 2) for i in range(N)}
    eleven_of_one = {i: (5 if i else 9) for i in range(N)}
    m = match_from_held(
        keys(3), held_for([eleven_of_one, mixed, eleven_of_one]), k=K, n=N, tokens_per_block=16
    )
    assert m.hit_blocks == 1
    assert int(m.stripe[0]) == 5
    assert m.holders[0, 0] == -1 and (m.holders[0, 1:] >= 0).all()


def test_match_with_no_answers() -> None:
    m = match_from_held(keys(3), [], k=K, n=N, tokens_per_block=16)
    assert m.hit_blocks == 0 and list(m.best_count) == [0, 0, 0]


def test_plan_asks_data_and_one_rotating_parity() -> None:
    holders = np.tile(np.arange(N), (4, 1))
    plan = plan_reads(holders, np.ones(N, bool), k=K)
    asked = {(int(b), int(i)) for _n, bl, ix in plan.first for b, i in zip(bl, ix, strict=True)}
    later = {(int(b), int(i)) for _n, bl, ix in plan.later for b, i in zip(bl, ix, strict=True)}
    for b in range(4):
        parity = {i for (bb, i) in asked if bb == b and i >= K}
        assert {i for (bb, i) in asked if bb == b and i < K} == set(range(K))
        assert parity == {K + b % 2}
        assert {i for (bb, i) in later if bb == b} == {K + (b + 1) % 2}


def test_plan_avoids_down_nodes() -> None:
    holders = np.tile(np.arange(N), (3, 1))
    up = np.ones(N, bool)
    up[3] = False
    plan = plan_reads(holders, up, k=K)
    first_nodes = {n for n, _b, _i in plan.first}
    assert 3 not in first_nodes
    assert sum(len(b) for _n, b, _i in plan.first) == 3 * (K + 1)


def reply_for(
    records: dict[tuple[int, int], bytes], blocks: np.ndarray, idx: np.ndarray
) -> tuple[np.ndarray, memoryview]:
    status = np.array(
        [0 if (int(b), int(i)) in records else 1 for b, i in zip(blocks, idx, strict=True)],
        np.uint8,
    )
    data = b"".join(
        records[(int(b), int(i))]
        for b, i in zip(blocks, idx, strict=True)
        if (int(b), int(i)) in records
    )
    return status, memoryview(data)


def encoded(
    count: int, backend: Backend = Backend.NUMPY
) -> tuple[list[BlockKey], dict[tuple[int, int], bytes], np.ndarray]:
    codec = get_codec(ErasureParams(k=K, m=N - K), backend)
    ks = keys(count)
    payloads = [payload_for_key(k, P) for k in ks]
    stripes, stripe_ids, headers = encode_stripes(
        codec, ks, payloads, payload_len=P, traffic_class="chat", now_ms=5
    )
    records = {}
    for node in range(N):
        b = np.arange(count)
        i = np.full(count, node)
        items, frame = build_node_records(ks, b, i, stripes, headers)
        assert list(items["length"]) == [HEADER_BYTES + stripes.shape[2]] * count
        for row, (bb, ii) in enumerate(zip(b, i, strict=True)):
            rec = frame[row].tobytes()
            header, _body = split_shard(rec)  # every record is a valid shard
            assert header.stripe_id == stripe_ids[bb]
            records[(int(bb), int(ii))] = rec
    return ks, records, stripe_ids


@pytest.mark.parametrize("lost", [(), (0,), (3, 9), (10,), (2, 11)])
def test_assembly_round_trip(lost: tuple[int, ...]) -> None:
    ks, records, stripe_ids = encoded(5)
    for b in range(5):
        for i in lost:
            records.pop((b, i))
    codec = get_codec(ErasureParams(k=K, m=N - K), Backend.NUMPY)
    asm = StripeAssembly(ks, stripe_ids, k=K, n=N, payload_len=P, shard_len=11520)
    for node in range(N):
        blocks, idx = np.arange(5), np.full(5, node)
        status, data = reply_for(records, blocks, idx)
        asm.add(blocks, idx, status, data)
    assert asm.complete().all()
    assert asm.finish(codec) == 5
    for b in range(5):
        assert np.array_equal(asm.payload(b), payload_for_key(ks[b], P))


def test_assembly_ignores_shards_of_another_stripe_and_key() -> None:
    ks, records, stripe_ids = encoded(2)
    _other_keys, other_records, _ = encoded(2)
    # Node 0 answers block 0 with a shard of another key: it must count as missing.
    records[(0, 0)] = other_records[(0, 0)]
    asm = StripeAssembly(ks, stripe_ids, k=K, n=N, payload_len=P, shard_len=11520)
    for node in range(N):
        blocks, idx = np.arange(2), np.full(2, node)
        asm.add(blocks, idx, *reply_for(records, blocks, idx))
    assert not asm.got[0, 0] and asm.got[1, 0]
    codec = get_codec(ErasureParams(k=K, m=N - K), Backend.NUMPY)
    assert asm.finish(codec) == 2
    assert np.array_equal(asm.payload(0), payload_for_key(ks[0], P))


def test_corrupt_body_is_repaired_from_the_other_shards() -> None:
    ks, records, stripe_ids = encoded(3)
    bad = bytearray(records[(1, 4)])
    bad[HEADER_BYTES + 100] ^= 0x5A  # body damaged, header intact
    records[(1, 4)] = bytes(bad)
    asm = StripeAssembly(ks, stripe_ids, k=K, n=N, payload_len=P, shard_len=11520)
    for node in range(N):
        blocks, idx = np.arange(3), np.full(3, node)
        asm.add(blocks, idx, *reply_for(records, blocks, idx))
    codec = get_codec(ErasureParams(k=K, m=N - K), Backend.NUMPY)
    assert asm.finish(codec) == 3
    assert np.array_equal(asm.payload(1), payload_for_key(ks[1], P))


def test_unrepairable_block_ends_the_prefix() -> None:
    ks, records, stripe_ids = encoded(3)
    for i in (0, 1):
        bad = bytearray(records[(1, i)])
        bad[-1] ^= 1
        records[(1, i)] = bytes(bad)
    records.pop((1, 11))  # 11 shards, 2 of them bad: only 9 good
    asm = StripeAssembly(ks, stripe_ids, k=K, n=N, payload_len=P, shard_len=11520)
    for node in range(N):
        blocks, idx = np.arange(3), np.full(3, node)
        asm.add(blocks, idx, *reply_for(records, blocks, idx))
    codec = get_codec(ErasureParams(k=K, m=N - K), Backend.NUMPY)
    assert asm.finish(codec) == 1


@settings(derandomize=True, max_examples=40, deadline=None)
@given(st.lists(st.sets(st.integers(0, N - 1), max_size=3), min_size=1, max_size=4))
def test_any_loss_pattern_loads_or_stops_cleanly(losses: list[set[int]]) -> None:
    count = len(losses)
    ks, records, stripe_ids = encoded(count)
    for b, lost in enumerate(losses):
        for i in lost:
            records.pop((b, i))
    asm = StripeAssembly(ks, stripe_ids, k=K, n=N, payload_len=P, shard_len=11520)
    for node in range(N):
        blocks, idx = np.arange(count), np.full(count, node)
        asm.add(blocks, idx, *reply_for(records, blocks, idx))
    codec = get_codec(ErasureParams(k=K, m=N - K), Backend.NUMPY)
    good = asm.finish(codec)
    expected = next((b for b, lost in enumerate(losses) if len(lost) > N - K), count)
    assert good == expected
    for b in range(good):
        assert np.array_equal(asm.payload(b), payload_for_key(ks[b], P))
