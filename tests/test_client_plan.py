"""Pure client logic: prefix matching, read planning, encoding, and load assembly with repair."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.client.assembly import BlockVerdict, LoadAssembly
from kvcache.client.encoding import as_payload_rows, encode_batch
from kvcache.client.plan import HeldShards, match_from_held, plan_reads
from kvcache.erasure import Backend, ErasureParams, get_codec
from kvcache.errors import ConfigError
from kvcache.keys import BlockKey
from kvcache.shard import HEADER_BYTES, ShardHeader, split_shard
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


def test_match_leaves_out_a_stripe_of_another_erasure_layout() -> None:
    """A 10 + 4 stripe (shard indices up to 13) seen by a 10 + 2 client has as many shards
    below 12 as the client's own stripe: the tie went to the lower stripe id, the 10 + 4
    one, which the load then found unreadable. Block 1's foreign stripe alone is no hit."""
    own, foreign = 9, 3  # the foreign stripe has the lower id: it won the tie
    held = held_for([{i: own for i in range(N)}, {}])
    extra = [
        HeldShards(
            node=node,
            ordinal=np.array([0, 1, 1], np.int64),
            index=np.array([N + node, node, N + node], np.int64),
            stripe=np.array([foreign, foreign, foreign], np.uint64),
        )
        for node in range(2)
    ] + [
        HeldShards(
            node,
            np.array([1], np.int64),
            np.array([node], np.int64),
            np.array([foreign], np.uint64),
        )
        for node in range(2, N)
    ]
    m = match_from_held(keys(2), held + extra, k=K, n=N, tokens_per_block=16)
    assert m.hit_blocks == 1 and int(m.stripe[0]) == own
    assert (m.holders[0] == np.arange(N)).all()
    assert list(m.best_count) == [N, 0]


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


def test_plan_asks_unlikely_holders_after_likely_ones_and_before_down_ones() -> None:
    """Two holders down, their shards guessed on stand-ins (nodes 4 and 7, which the
    match did not see holding them): the 10 known holders are asked first, and the
    stand-ins before the down nodes."""
    holders = np.tile(np.arange(N), (3, 1))
    up = np.ones(N, bool)
    up[[2, 5]] = False
    holders[:, 2], holders[:, 5] = 4, 7  # stand-ins for the down holders' shards
    unlikely = np.zeros((3, N), bool)
    unlikely[:, [2, 5]] = True
    plan = plan_reads(holders, up, k=K, unlikely=unlikely)
    asked = {(int(b), int(i)) for _n, bl, ix in plan.first for b, i in zip(bl, ix, strict=True)}
    for b in range(3):
        mine = {i for (bb, i) in asked if bb == b}
        assert len(mine) == K + 1
        assert {i for i in range(N) if i not in (2, 5)} <= mine  # every likely shard
        assert len(mine & {2, 5}) == 1  # the spare is a stand-in, not nothing
    without = plan_reads(holders, up, k=K)  # without the hint, data shards 2 and 5 come first
    asked = {(int(b), int(i)) for _n, bl, ix in without.first for b, i in zip(bl, ix, strict=True)}
    assert {(b, i) for b in range(3) for i in (2, 5)} <= asked


@settings(max_examples=200, deadline=None)
@given(
    blocks=st.integers(1, 40),
    nodes=st.integers(1, 60),
    k=st.integers(1, 10),
    m=st.integers(0, 4),
    spare=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
    down=st.integers(0, 3),
    guessed=st.booleans(),
    first=st.integers(0, 1000),
)
def test_plan_shortcut_equals_the_general_plan(
    blocks: int,
    nodes: int,
    k: int,
    m: int,
    spare: int,
    seed: int,
    down: int,
    guessed: bool,
    first: int,
) -> None:
    """The shortcut for holders all known and up gives the general ranking's plan, and any
    down node, unknown holder or unlikely guess leaves it to the general one; blocks
    numbered from ``first_block`` are the same plan's, shifted."""
    rng = np.random.default_rng(seed)
    n = k + m
    holders = rng.integers(0, nodes, (blocks, n))
    holders[rng.random((blocks, n)) < 0.1 * (down > 0)] = -1
    up = np.ones(nodes, bool)
    up[rng.integers(0, nodes, down)] = False
    unlikely = rng.random((blocks, n)) < 0.2 if guessed else None

    def flat(
        plan: list[tuple[int, np.ndarray, np.ndarray]],
    ) -> list[tuple[int, list[int], list[int]]]:
        return [(nd, b.tolist(), i.tolist()) for nd, b, i in plan]

    fast = plan_reads(holders, up, k=k, spare=spare, unlikely=unlikely)
    slow = plan_reads(holders, up, k=k, spare=spare, unlikely=unlikely, general=True)
    assert flat(fast.first) == flat(slow.first)
    assert flat(fast.later) == flat(slow.later)
    assert all(b.dtype == np.int64 and i.dtype == np.int64 for _n, b, i in fast.first)
    for general in (False, True):
        shifted = plan_reads(
            holders, up, k=k, spare=spare, unlikely=unlikely, general=general, first_block=first
        )
        for got, want in ((shifted.first, fast.first), (shifted.later, fast.later)):
            assert [(nd, (b - first).tolist(), i.tolist()) for nd, b, i in got] == flat(want)


# ---------------------------------------------------------------------- encoding


def encoded(
    count: int, backend: Backend = Backend.NUMPY, payload_len: int = P, seed: int = 1
) -> tuple[list[BlockKey], dict[tuple[int, int], bytes], np.ndarray, list[np.ndarray]]:
    """Blocks encoded the way a store does, as node j's PUT record of shard j."""
    codec = get_codec(ErasureParams(k=K, m=N - K), backend)
    ks = keys(count, seed)
    payloads = [payload_for_key(k, payload_len) for k in ks]
    batch = encode_batch(
        codec,
        ks,
        as_payload_rows(payloads, payload_len),
        payload_len=payload_len,
        traffic_class="chat",
        now_ms=5,
    )
    records = {}
    parts = [(np.arange(count), np.full(count, node)) for node in range(N)]
    for (b, i), (items, data) in zip(parts, batch.sections(parts), strict=True):
        shard_len = batch.shard_len
        assert list(items["length"]) == [HEADER_BYTES + shard_len] * count
        raw = b"".join(bytes(v) for v in data.views())
        for row, (bb, ii) in enumerate(zip(b, i, strict=True)):
            rec = raw[row * (HEADER_BYTES + shard_len) : (row + 1) * (HEADER_BYTES + shard_len)]
            header, _body = split_shard(rec)  # every record is a valid shard
            assert header.stripe_id == batch.stripe_ids[bb]
            records[(int(bb), int(ii))] = rec
    return ks, records, batch.stripe_ids, payloads


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.tuples(st.integers(0, 4), st.integers(0, N - 1)), max_size=9), max_size=6),
    st.booleans(),
)
def test_sections_give_each_node_its_items_and_segments(
    parts_drawn: list[list[tuple[int, int]]], with_expect: bool
) -> None:
    """Every node's PUT from one sections() call: its items name its shards (key, index,
    length, the stripe it may replace) and its segments are each shard's header then its
    body, whatever the nodes' shard counts (none included)."""
    codec = get_codec(ErasureParams(k=K, m=N - K), Backend.NUMPY)
    ks = [BlockKey(bytes([b]) * 16) for b in range(5)]
    batch = encode_batch(
        codec, ks, as_payload_rows([payload_for_key(k, 640) for k in ks], 640),
        payload_len=640, traffic_class="chat", now_ms=5,
    )  # fmt: skip
    expect = np.arange(5 * N, dtype=np.uint64).reshape(5, N) + 1 if with_expect else None
    parts = [
        (np.array([b for b, _ in p], np.int64), np.array([i for _, i in p], np.int64))
        for p in parts_drawn
    ]
    out = batch.sections(parts, expect)
    assert len(out) == len(parts)
    record = HEADER_BYTES + batch.shard_len
    for (b, i), (items, data) in zip(parts, out, strict=True):
        assert [bytes(k) for k in items["key"]] == [bytes(ks[x]) for x in b.tolist()]
        assert items["index"].tolist() == i.tolist()
        assert items["length"].tolist() == [record] * len(b)
        want = [0] * len(b) if expect is None else expect[b, i].tolist()
        assert items["expect"].tolist() == want
        assert data.nbytes == record * len(b) and data.count == 2 * len(b)
        raw = b"".join(bytes(v) for v in data.views())
        for j, (x, y) in enumerate(zip(b.tolist(), i.tolist(), strict=True)):
            rec = raw[j * record : (j + 1) * record]
            assert rec[:HEADER_BYTES] == batch.headers[x, y].tobytes()
            assert rec[HEADER_BYTES:] == batch.body(x, y)


@pytest.mark.parametrize("backend", [Backend.NUMPY, Backend.ISAL])
@pytest.mark.parametrize("payload_len", [P, 64, 640, 1000, 2 << 20])
def test_encoding_matches_the_reference_codec(backend: Backend, payload_len: int) -> None:
    """Zero-copy encoding from payload rows gives exactly the stripes of the plain codec."""
    from kvcache.erasure import encode_payloads, isal_available

    if backend is Backend.ISAL and not isal_available():
        pytest.skip("libisal.so.2 not installed")
    _ks, records, _ids, payloads = encoded(3, backend, payload_len)
    reference = encode_payloads(get_codec(ErasureParams(k=K, m=N - K), Backend.NUMPY), payloads)
    for (b, i), rec in records.items():
        assert rec[HEADER_BYTES:] == reference[b, i].tobytes()


def test_payload_rows_are_checked_before_any_io() -> None:
    with pytest.raises(ConfigError, match="1000 bytes"):
        as_payload_rows([b"x" * 1000], 1024)
    with pytest.raises(ConfigError, match="not a bytes-like"):
        as_payload_rows([123], 1024)
    with pytest.raises(ConfigError, match="uint8"):
        as_payload_rows(np.zeros((2, 256), np.float32), 1024)
    assert len(as_payload_rows(np.zeros((2, 1024), np.uint8), 1024)) == 2


# ---------------------------------------------------------------------- assembly


def assembly_for(
    ks: list[BlockKey],
    stripe_ids: np.ndarray,
    out: np.ndarray,
    backend: Backend = Backend.NUMPY,
) -> LoadAssembly:
    return LoadAssembly(
        key_words=np.frombuffer(b"".join(ks), "V16"),
        stripes=stripe_ids,
        out=out,
        k=K,
        n=N,
        payload_len=out.shape[1],
        codec=get_codec(ErasureParams(k=K, m=N - K), backend),
    )


def deliver(asm: LoadAssembly, records: dict[tuple[int, int], bytes], count: int) -> None:
    """Node j answers a GET of shard j of every block: land the bytes as a socket would."""
    for node in range(N):
        blocks, idx = np.arange(count), np.full(count, node)
        have = [(int(b), int(i)) in records for b, i in zip(blocks, idx, strict=True)]
        status = np.array([0 if h else 1 for h in have], np.uint8)
        lengths = np.array(
            [len(records[(b, node)]) if h else 0 for b, h in enumerate(have)], np.int64
        )
        data = b"".join(records[(b, node)] for b, h in enumerate(have) if h)
        land(asm, blocks, idx, status, lengths, data)


def land(
    asm: LoadAssembly,
    blocks: np.ndarray,
    idx: np.ndarray,
    status: np.ndarray,
    lengths: np.ndarray,
    data: bytes,
) -> np.ndarray:
    """One GET reply received into the assembly's landing buffers, then accepted."""
    claim = asm.landing(blocks, idx, status, lengths)
    assert claim is not None
    segments, writes = claim
    at = 0
    for view in segments.views():
        view[:] = data[at : at + view.nbytes]
        at += view.nbytes
    assert at == len(data)
    asm.landed(writes)
    accepted: np.ndarray = asm.accept(blocks, idx, status, lengths)
    return accepted


def good_prefix(asm: LoadAssembly, count: int) -> int:
    good = 0
    for v in asm.verify(list(range(count))):
        if not v.good:
            break
        good += 1
    return good


@pytest.mark.parametrize("lost", [(), (0,), (3, 9), (10,), (2, 11)])
def test_assembly_round_trip(lost: tuple[int, ...]) -> None:
    ks, records, stripe_ids, payloads = encoded(5)
    for b in range(5):
        for i in lost:
            records.pop((b, i))
    out = np.zeros((5, P), np.uint8)
    asm = assembly_for(ks, stripe_ids, out)
    deliver(asm, records, 5)
    verdicts = asm.verify(list(range(5)))
    assert all(v.good for v in verdicts)
    assert all(v.rebuilt == any(i < K for i in lost) for v in verdicts)
    for b in range(5):
        assert np.array_equal(out[b], payloads[b])


def _backends() -> list[Backend]:
    from kvcache.erasure import isal_available

    return [Backend.NUMPY, *([Backend.ISAL] if isal_available() else [])]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("payload_len", [P, 1000, 640])
@settings(derandomize=True, max_examples=25, deadline=None)
@given(st.lists(st.sets(st.integers(0, N - 1), max_size=3), min_size=1, max_size=8), st.data())
def test_assembly_rebuilds_blocks_with_different_losses_in_one_pass(
    backend: Backend, payload_len: int, lost: list[set[int]], data: st.DataObject
) -> None:
    """Each block loses its own shards (a node down holds a different index of every
    key), one may also carry a corrupt body: every block with k sound shards comes out
    byte-identical, the others are not good, and nothing else is touched. The payload
    lengths put the data row that crosses the payload's end at different rows (or none),
    and ISA-L rebuilds the whole batch in one native call."""
    count = len(lost)
    ks, records, stripe_ids, payloads = encoded(
        count, backend, payload_len=payload_len, seed=len(lost)
    )
    corrupt = data.draw(st.sampled_from([None, *range(count)]))
    for b, gone in enumerate(lost):
        for i in gone:
            records.pop((b, i))
    if corrupt is not None:
        index = min(set(range(N)) - lost[corrupt])
        body = bytearray(records[(corrupt, index)])
        body[HEADER_BYTES + 7] ^= 0x40
        records[(corrupt, index)] = bytes(body)
    out = np.zeros((count, payload_len), np.uint8)
    asm = assembly_for(ks, stripe_ids, out, backend)
    deliver(asm, records, count)
    searched: list[int] = []  # blocks that needed the shard-by-shard search
    locate = asm._locate

    def counted_locate(b: int) -> BlockVerdict:
        searched.append(b)
        return locate(b)

    asm._locate = counted_locate  # type: ignore[method-assign]
    verdicts = asm.verify(list(range(count)))
    # Only the corrupt block (its bad shard is received) and the blocks short of k shards
    # reach the shard-by-shard search: the others are rebuilt in the batched pass.
    short = {b for b, gone in enumerate(lost) if N - len(gone) < K}
    assert short <= set(searched) <= short | {corrupt}
    for b, (verdict, gone) in enumerate(zip(verdicts, lost, strict=True)):
        sound = N - len(gone) - (1 if b == corrupt else 0)
        assert verdict.good == (sound >= K)
        if verdict.good:
            assert np.array_equal(out[b], payloads[b])


def test_assembly_ignores_shards_of_another_stripe_and_key() -> None:
    ks, records, stripe_ids, payloads = encoded(2)
    _other, other_records, _ids, _pl = encoded(2, seed=9)
    # Node 0 answers block 0 with a shard of another key: it must count as missing.
    records[(0, 0)] = other_records[(0, 0)]
    out = np.zeros((2, P), np.uint8)
    asm = assembly_for(ks, stripe_ids, out)
    deliver(asm, records, 2)
    assert not asm.got[0, 0] and asm.got[1, 0]
    assert good_prefix(asm, 2) == 2
    assert np.array_equal(out[0], payloads[0])


def test_a_late_answer_never_writes_over_a_verified_block() -> None:
    """Block 0 verified by rebuilding data shard 2 (its answer was late); then the late
    answer arrives, with bad bytes: it lands in scratch, is not accepted, and the checked
    payload stays as it was."""
    ks, records, stripe_ids, payloads = encoded(1)
    late = records.pop((0, 2))
    out = np.zeros((1, P), np.uint8)
    asm = assembly_for(ks, stripe_ids, out)
    deliver(asm, records, 1)
    assert asm.seal(np.arange(1))  # nothing landing: it may be verified now
    (verdict,) = asm.verify([0])
    assert verdict.good and verdict.rebuilt
    bad = bytearray(late)
    bad[HEADER_BYTES:] = bytes(len(bad) - HEADER_BYTES)  # zeros instead of the shard body
    accepted = land(
        asm,
        np.array([0]),
        np.array([2]),
        np.array([0], np.uint8),
        np.array([len(bad)], np.int64),
        bytes(bad),
    )
    assert not accepted.any() and not asm.got[0, 2]
    assert np.array_equal(out[0], payloads[0])
    # Unsealed (its asks were escalated), the block takes answers again.
    asm.unseal(np.arange(1))
    assert land(
        asm,
        np.array([0]),
        np.array([2]),
        np.array([0], np.uint8),
        np.array([len(late)], np.int64),
        late,
    ).all()


@pytest.mark.parametrize("where", ["data", "parity"])
def test_corrupt_body_is_located_and_reported(where: str) -> None:
    ks, records, stripe_ids, payloads = encoded(3)
    index = 4 if where == "data" else 10
    bad = bytearray(records[(1, index)])
    bad[HEADER_BYTES + 100] ^= 0x5A  # body damaged, header intact
    records[(1, index)] = bytes(bad)
    out = np.zeros((3, P), np.uint8)
    asm = assembly_for(ks, stripe_ids, out)
    deliver(asm, records, 3)
    verdicts = asm.verify([0, 1, 2])
    assert all(v.good for v in verdicts)
    if where == "data":
        assert verdicts[1].bad_indices == (index,)
    assert np.array_equal(out[1], payloads[1])
    # The repair copy is the shard the writer stored, byte for byte.
    (repair,) = asm.repair_shards(1, (index,))
    header, _body = split_shard(repair.header + repair.body)
    assert header.stripe_id == stripe_ids[1] and header.shard_index == index
    clean = bytearray(records[(1, index)])
    clean[HEADER_BYTES + 100] ^= 0x5A
    assert repair.header + repair.body == bytes(clean)


def test_forged_self_consistent_shard_is_located() -> None:
    """A shard whose header and body checksums agree but whose bytes are not the stripe's."""
    ks, records, stripe_ids, payloads = encoded(2)
    header = ShardHeader.unpack(records[(0, 3)])
    body = bytes(b ^ 0xFF for b in records[(0, 3)][HEADER_BYTES:])
    from kvcache.shard import shard_hash

    forged = ShardHeader(
        **{
            **{f: getattr(header, f) for f in header.__dataclass_fields__},
            "shard_hash": shard_hash(body),
        }
    )
    records[(0, 3)] = forged.pack() + body
    out = np.zeros((2, P), np.uint8)
    asm = assembly_for(ks, stripe_ids, out)
    deliver(asm, records, 2)
    verdicts = asm.verify([0, 1])
    assert verdicts[0].good and verdicts[0].bad_indices == (3,)
    assert np.array_equal(out[0], payloads[0])


def test_unrepairable_block_ends_the_prefix() -> None:
    ks, records, stripe_ids, _payloads = encoded(3)
    for i in (0, 1):
        bad = bytearray(records[(1, i)])
        bad[-1] ^= 1
        records[(1, i)] = bytes(bad)
    records.pop((1, 11))  # 11 shards, 2 of them bad: only 9 good
    asm = assembly_for(ks, stripe_ids, np.zeros((3, P), np.uint8))
    deliver(asm, records, 3)
    assert good_prefix(asm, 3) == 1


@settings(derandomize=True, max_examples=30, deadline=None)
@given(st.lists(st.sets(st.integers(0, N - 1), max_size=3), min_size=1, max_size=4))
def test_any_loss_pattern_loads_or_stops_cleanly(losses: list[set[int]]) -> None:
    count = len(losses)
    ks, records, stripe_ids, payloads = encoded(count)
    for b, lost in enumerate(losses):
        for i in lost:
            records.pop((b, i))
    out = np.zeros((count, P), np.uint8)
    asm = assembly_for(ks, stripe_ids, out)
    deliver(asm, records, count)
    good = good_prefix(asm, count)
    expected = next((b for b, lost in enumerate(losses) if len(lost) > N - K), count)
    assert good == expected
    for b in range(good):
        assert np.array_equal(out[b], payloads[b])


@settings(derandomize=True, max_examples=30, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, N - 1), st.integers(HEADER_BYTES, HEADER_BYTES + 11519)),
        min_size=1,
        max_size=2,
        unique_by=lambda t: t[0],
    )
)
def test_one_or_two_corrupt_bodies_never_cost_the_block(damage: list[tuple[int, int]]) -> None:
    """With all 12 shards, any one or two damaged bodies are located; wrong bytes never pass."""
    ks, records, stripe_ids, payloads = encoded(1)
    for index, pos in damage:
        bad = bytearray(records[(0, index)])
        bad[pos] ^= 0x01
        records[(0, index)] = bytes(bad)
    out = np.zeros((1, P), np.uint8)
    asm = assembly_for(ks, stripe_ids, out)
    deliver(asm, records, 1)
    (verdict,) = asm.verify([0])
    assert verdict.good
    assert np.array_equal(out[0], payloads[0])
    assert set(verdict.bad_indices) <= {i for i, _ in damage}


def test_a_block_is_not_verified_while_a_reply_is_landing_in_it() -> None:
    ks, records, stripe_ids, _payloads = encoded(1)
    out = np.zeros((1, P), np.uint8)
    asm = assembly_for(ks, stripe_ids, out)
    rec = records[(0, 0)]
    claim = asm.landing(
        np.array([0]), np.array([0]), np.array([0], np.uint8), np.array([len(rec)], np.int64)
    )
    assert claim is not None
    # The reply's bytes are still coming in: sealing says "not yet", and blocks new ones.
    assert not asm.seal(np.arange(1))
    assert (
        asm.landing(
            np.array([0]), np.array([1]), np.array([0], np.uint8), np.array([len(rec)], np.int64)
        )
        is not None
    )  # a later reply is claimed, but lands in scratch
    segments, writes = claim
    at = 0
    for view in segments.views():
        view[:] = rec[at : at + view.nbytes]
        at += view.nbytes
    asm.landed(writes)
    assert asm.seal(np.arange(1))
