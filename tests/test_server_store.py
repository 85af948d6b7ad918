"""ShardStore directly, with a stepped clock: storage, retention, sweeping, eviction. No sockets."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixtures import FakeClock, block_records, get_items, keys_items, put_items

from kvcache.credentials import tenant_id
from kvcache.errors import ProtocolError, StorageError
from kvcache.retention import DAY_S, RetentionPolicy
from kvcache.server.eviction import Quota
from kvcache.server.store import PutBatch, ReplyTooLargeError, ShardStore
from kvcache.shard import split_shard
from kvcache.wire import GET_REFRESHED, NO_INDEX, Op, Status, make_items

HOUR = 3600
T = tenant_id("default")
OTHER = tenant_id("alice")


def open_store(path: Path, clock: FakeClock, **kwargs: object) -> ShardStore:
    options: dict[str, object] = {"capacity_bytes": 64 << 20, "touch_resolution_s": 60.0}
    options.update(kwargs)
    return ShardStore(path, clock=clock, **options)  # type: ignore[arg-type]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[ShardStore]:
    with open_store(tmp_path / "db", clock) as s:
        yield s


def put(
    store: ShardStore,
    shards: list[tuple[bytes, int, bytes]],
    *,
    tenant: bytes = T,
    expect: list[int] | None = None,
) -> list[int]:
    items, data = put_items(shards)
    if expect is not None:
        items["expect"] = expect
    return store.put(tenant, items, data)["status"].tolist()  # type: ignore[arg-type]


def get(
    store: ShardStore, wanted: list[tuple[bytes, int]], cls: str = "", *, tenant: bytes = T
) -> tuple[list[int], list[bytes]]:
    result = store.get(tenant, get_items(wanted), cls)  # type: ignore[arg-type]
    try:
        # The parts are the found records back to back (runs of adjacent records joined).
        data = b"".join(bytes(p) for p in result.parts)
        out, at = [], 0
        for status, length in zip(
            result.items["status"].tolist(), result.items["length"].tolist(), strict=True
        ):
            out.append(data[at : at + length] if status == Status.OK else b"")
            at += length if status == Status.OK else 0
        assert at == len(data)
        return result.items["status"].tolist(), out
    finally:
        result.release()


def held(store: ShardStore, key: bytes, *, tenant: bytes = T) -> set[int]:
    reply = store.has(tenant, keys_items(Op.HAS, [key]))  # type: ignore[arg-type]
    return set(reply["index"].tolist())


def stripe_of(shards: list[tuple[bytes, int, bytes]]) -> int:
    return split_shard(shards[0][2])[0].stripe_id


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def test_put_get_round_trip_returns_exact_records(store: ShardStore) -> None:
    shards = block_records(key(1)) + block_records(key(2), traffic_class="agent")
    assert put(store, shards) == [Status.OK] * 24
    status, records = get(store, [(k, i) for k, i, _ in shards] + [(key(3), 0), (key(1), 12)])
    assert status == [Status.OK] * 24 + [Status.NOT_FOUND] * 2
    assert records[:24] == [r for _, _, r in shards]
    for record in records[:24]:
        split_shard(record)  # header and checksum still valid
    usage = store.usage()
    assert usage["shards"] == 24
    assert usage["used_bytes"] == sum(len(r) for _, _, r in shards)
    assert usage["classes"]["agent"]["shards"] == 12
    assert store.recount() == usage


def test_new_blocks_go_in_without_a_lookup_and_a_block_with_rows_is_written_again(
    store: ShardStore,
) -> None:
    """A PUT of one shard of each of several new blocks (what one node of twelve gets) is
    written without looking for earlier rows first; one that meets a row already stored
    (another shard of a block, the same write again, another writer's stripe) is undone and
    written again with the lookup, with the same outcome as the careful path alone."""
    one_each = [block_records(key(n), indices=[n % 12])[0] for n in range(16)]
    assert put(store, one_each) == [Status.OK] * 16
    assert store.counters["put_lookup_retries"] == 0
    # Another shard of block 3, beside a new block: the block key is there already.
    more = [block_records(key(3), indices=[7])[0], block_records(key(40), indices=[1])[0]]
    assert put(store, more) == [Status.OK, Status.OK]
    assert store.counters["put_lookup_retries"] == 1
    assert held(store, key(3)) == {3, 7}
    # The same write again is a repeat; another stripe of a live shard is a conflict.
    assert put(store, [one_each[5]]) == [Status.OK]
    other = block_records(key(6), indices=[6], seed=9)
    assert put(store, other) == [Status.CONFLICT]
    assert store.counters["put_lookup_retries"] == 3
    assert store.counters["put_conflicts"] == 1
    # Several shards of one new block in one PUT (a node of a small cluster) need no lookup
    # either; several of a block stored before are written again with it.
    fifty = block_records(key(50), indices=[0, 1, 2])
    assert put(store, fifty) == [Status.OK] * 3
    assert store.counters["put_lookup_retries"] == 3
    two_more = [*block_records(key(50), indices=[5, 4]), block_records(key(51), indices=[1])[0]]
    assert put(store, two_more) == [Status.OK] * 3
    assert store.counters["put_lookup_retries"] == 4
    assert held(store, key(50)) == {0, 1, 2, 4, 5}
    wanted = [(k, i) for k, i, _ in one_each + more + fifty + two_more]
    status, records = get(store, wanted)
    assert status == [Status.OK] * len(wanted)
    assert records == [r for _, _, r in one_each + more + fifty + two_more]
    # What an undone transaction appended is not counted anywhere: a rescan agrees.
    usage = store.usage()
    assert usage["shards"] == 16 + 2 + 3 + 3
    assert store.recount() == usage
    assert sum(st.live_bytes for st in store.segments.state.values()) == usage["used_bytes"]


def test_bad_items_fail_alone(store: ShardStore) -> None:
    good = block_records(key(1), indices=[0, 1])
    corrupt = bytearray(good[1][2])
    corrupt[-1] ^= 1
    foreign = block_records(key(9), indices=[2])[0][2]
    shards = [good[0], (key(1), 1, bytes(corrupt)), (key(1), 2, foreign), (key(1), 3, b"short")]
    assert put(store, shards) == [Status.OK, Status.CHECKSUM, Status.WRONG_KEY, Status.BAD_ITEM]
    assert held(store, key(1)) == {0}


def test_another_writers_live_stripe_is_never_overwritten(
    store: ShardStore, clock: FakeClock
) -> None:
    first = block_records(key(1), indices=[0], seed=1)
    second = block_records(key(1), indices=[0], seed=2)
    assert put(store, first) == [Status.OK]
    assert put(store, first) == [Status.OK]  # a repeat of the same write
    assert put(store, second) == [Status.CONFLICT]
    assert store.counters["put_conflicts"] == 1
    # Naming the stored stripe is not enough while its writer may still be at work ...
    assert put(store, second, expect=[stripe_of(first)]) == [Status.CONFLICT]
    clock.step(11)
    assert put(store, second, expect=[stripe_of(second) ^ 1]) == [Status.CONFLICT]
    # ... but once it is older than replace_after_s, it may be replaced.
    assert put(store, second, expect=[stripe_of(first)]) == [Status.OK]
    assert get(store, [(key(1), 0)])[1] == [second[0][2]]
    assert store.usage()["shards"] == 1
    assert store.recount() == store.usage()


def test_expired_shards_of_another_stripe_are_replaced(store: ShardStore, clock: FakeClock) -> None:
    first = block_records(key(1), indices=[0], seed=1, traffic_class="agent")
    assert put(store, first) == [Status.OK]
    clock.step(3 * DAY_S + 1)
    assert put(store, block_records(key(1), indices=[0], seed=2)) == [Status.OK]
    assert store.recount() == store.usage() and store.usage()["shards"] == 1


def test_has_reports_index_and_stripe(store: ShardStore) -> None:
    shards = block_records(key(5), indices=[0, 3, 11])
    put(store, shards)
    reply = store.has(T, keys_items(Op.HAS, [key(4), key(5)]))
    assert reply["ordinal"].tolist() == [1, 1, 1]
    assert reply["index"].tolist() == [0, 3, 11]
    stripe = split_shard(shards[0][2])[0].stripe_id
    assert set(reply["stripe"].tolist()) == {stripe}


def test_delete_by_index_stripe_and_whole_key(store: ShardStore) -> None:
    shards = block_records(key(1))
    put(store, shards)
    stripe = split_shard(shards[0][2])[0].stripe_id
    items = make_items(Op.DELETE, 4, reply=False)
    items["key"] = [key(1), key(1), key(1), key(2)]
    items["stripe"] = [0, stripe + 1, stripe, 0]
    items["index"] = [0, NO_INDEX, 1, NO_INDEX]
    assert store.delete(T, items)["status"].tolist() == [
        Status.OK,
        Status.NOT_FOUND,  # another stripe: nothing of this one is touched
        Status.OK,
        Status.NOT_FOUND,
    ]
    assert held(store, key(1)) == set(range(2, 12))
    items = make_items(Op.DELETE, 1, reply=False)
    items["key"] = [key(1)]
    items["index"] = [NO_INDEX]
    assert store.delete(T, items)["status"].tolist() == [Status.OK]
    assert held(store, key(1)) == set()
    assert store.usage()["shards"] == 0 and store.recount() == store.usage()


# ---------------------------------------------------------------------- retention


def test_agent_gone_after_3_days_chat_kept_until_7(store: ShardStore, clock: FakeClock) -> None:
    put(
        store,
        block_records(key(1), traffic_class="agent") + block_records(key(2), traffic_class="chat"),
    )
    clock.step(3 * DAY_S - 1)
    assert held(store, key(1)) == set(range(12))
    clock.step(2)
    assert held(store, key(1)) == set()  # expired: invisible even before the sweep
    assert get(store, [(key(1), 0)])[0] == [Status.NOT_FOUND]
    assert held(store, key(2)) == set(range(12))
    assert store.sweep(limit=100) == 12
    assert store.counters["expired_shards"] == 12
    assert store.usage()["classes"] == {
        "chat": {"bytes": store.usage()["used_bytes"], "shards": 12}
    }
    clock.step(4 * DAY_S - 2)
    assert held(store, key(2)) == set(range(12))
    clock.step(2)
    assert held(store, key(2)) == set()
    assert store.sweep(limit=100) == 12
    assert store.usage()["shards"] == 0 and store.recount() == store.usage()


def test_hits_slide_the_expiry(store: ShardStore, clock: FakeClock) -> None:
    put(store, block_records(key(1), traffic_class="agent", indices=[0, 1]))
    start = clock.now
    clock.step(2 * DAY_S)
    assert get(store, [(key(1), 0)])[0] == [Status.OK]
    assert store.touch(T, keys_items(Op.TOUCH, [key(1), key(2)]))["status"].tolist() == [
        Status.OK,
        Status.NOT_FOUND,
    ]
    store.flush_touches()
    expiry, cls = store.expiry_of(T, key(1), 0) or (0, "")
    assert expiry == int((start + 2 * DAY_S + 3 * DAY_S) * 1000) and cls == "agent"
    clock.step(2 * DAY_S)  # 4 days after the write, 2 after the hit
    assert held(store, key(1)) == {0, 1}
    clock.step(1 * DAY_S + 1)
    assert held(store, key(1)) == set()


def test_hits_within_the_resolution_write_nothing(store: ShardStore, clock: FakeClock) -> None:
    put(store, block_records(key(1), indices=[0]))
    for _ in range(10):
        clock.step(5)
        get(store, [(key(1), 0)])
    assert store.flush_touches() == 0
    clock.step(120)
    get(store, [(key(1), 0)])
    assert store.flush_touches() == 1


def test_a_hit_that_moves_an_expiry_is_flagged_in_its_reply(
    store: ShardStore, clock: FakeClock
) -> None:
    """GET_REFRESHED marks exactly the items whose expiry this hit moved: the reader then
    refreshes the block's shards it did not ask for."""
    put(store, block_records(key(1), indices=[0, 1]))
    put(store, block_records(key(2), indices=[0]))

    def flags(wanted: list[tuple[bytes, int]]) -> list[int]:
        result = store.get(T, get_items(wanted))  # type: ignore[arg-type]
        try:
            return result.items["flags"].tolist()  # type: ignore[no-any-return]
        finally:
            result.release()

    clock.step(5)  # within the resolution: nothing moves, nothing flagged
    assert flags([(key(1), 0), (key(2), 0)]) == [0, 0]
    clock.step(120)
    assert flags([(key(1), 0), (key(3), 0), (key(2), 0)]) == [GET_REFRESHED, 0, GET_REFRESHED]
    # The slide is pending now: the next hit moves nothing and is not flagged.
    assert flags([(key(1), 0), (key(1), 1)]) == [0, GET_REFRESHED]


@pytest.mark.parametrize("batches", [1, 2])
def test_a_rewrite_keeps_the_slide_a_pending_hit_promised(
    tmp_path: Path, clock: FakeClock, batches: int
) -> None:
    """A hit naming a longer class slides a shard's expiry (pending, not yet written); the
    same shard written again, alone or twice in one group commit (two batches of one
    put_many, whose first attempt is undone and redone the careful way), keeps the promised
    expiry, and the shard outlives its own class's TTL."""
    policy = RetentionPolicy(classes={"chat": 300, "agent": 3000}, default_class="chat")
    with open_store(tmp_path / "db", clock, policy=policy, touch_resolution_s=1) as store:
        shards = block_records(key(7), indices=[0], traffic_class="chat")
        put(store, shards)
        clock.step(10)
        result = store.get(T, get_items([(key(7), 0)]), traffic_class="agent")
        assert result.items["flags"].tolist() == [GET_REFRESHED]
        result.release()
        promised = store.expiry_of(T, key(7), 0)
        assert promised is not None and promised[1] == "agent"
        items, data = put_items(shards)
        for reply in store.put_many([PutBatch(T, items, data)] * batches):
            assert reply["status"].tolist() == [Status.OK]  # type: ignore[index]
        store.flush_touches()
        assert store.expiry_of(T, key(7), 0) == promised
        clock.step(1000)  # past chat's 300 s, within the promised 3000
        store.sweep()
        result = store.get(T, get_items([(key(7), 0)]))
        assert result.items["status"].tolist() == [Status.OK]
        result.release()


def test_two_classes_keep_the_longer_expiry(store: ShardStore, clock: FakeClock) -> None:
    put(store, block_records(key(1), traffic_class="agent", indices=[0]))
    put(store, block_records(key(2), traffic_class="chat", indices=[0]))
    clock.step(HOUR)
    get(store, [(key(1), 0)], "chat")  # chat reuses an agent block: 7 days from now
    get(store, [(key(2), 0)], "agent")  # agent reuses a chat block: keeps its 7 days
    store.flush_touches()
    assert store.expiry_of(T, key(1), 0) == (int((clock.now + 7 * DAY_S) * 1000), "chat")
    assert store.expiry_of(T, key(2), 0) == (int((clock.now - HOUR + 7 * DAY_S) * 1000), "chat")
    assert store.usage()["classes"]["chat"]["shards"] == 2
    assert store.recount() == store.usage()
    # A repeat of the write by agent traffic does not shorten it either.
    put(store, block_records(key(1), traffic_class="agent", indices=[0]))
    assert store.expiry_of(T, key(1), 0) == (int((clock.now + 7 * DAY_S) * 1000), "chat")


def test_unknown_classes_count_as_the_default(store: ShardStore, clock: FakeClock) -> None:
    put(store, block_records(key(1), traffic_class="nightly", indices=[0]))
    assert store.expiry_of(T, key(1), 0) == (int((clock.now + 3 * DAY_S) * 1000), "default")
    assert set(store.usage()["classes"]) == {"default"}


def test_sweep_is_bounded(store: ShardStore, clock: FakeClock) -> None:
    for n in range(5):
        put(store, block_records(key(n), traffic_class="agent"))
    clock.step(3 * DAY_S + 1)
    assert store.sweep(limit=25) == 25
    assert store.usage()["shards"] == 35
    assert store.maintain() is True or store.usage()["shards"] < 35
    while store.maintain():
        pass
    assert store.usage()["shards"] == 0
    assert store.counters["expired_shards"] == 60


def test_eviction_interleaves_partitions_by_expiry(tmp_path: Path, clock: FakeClock) -> None:
    """Shards of two classes whose expiries interleave are evicted in expiry order across
    both: a batch from the partition with the earliest head stops where the other's head
    is earlier (it used to take its whole batch from the one partition)."""
    body = 4096
    with open_store(tmp_path / "db", clock) as store:
        written: dict[str, int] = {}

        def write(name: str, cls: str) -> None:
            shard = block_records(key(len(written)), body_len=body, traffic_class=cls, indices=[0])
            assert put(store, shard) == [Status.OK]
            written[name] = len(written)

        write("chat 7d", "chat")  # expires at 7 d
        clock.step(3 * DAY_S)
        write("agent 6d", "agent")  # 6 d
        clock.step(DAY_S // 2)
        write("agent 6.5d", "agent")  # 6.5 d
        clock.step(DAY_S)
        write("agent 7.5d", "agent")  # 7.5 d
        record = store.usage()["used_bytes"] // 4
        store.evict(store.usage()["used_bytes"] - 3 * record)
        kept = {name for name, n in written.items() if held(store, key(n))}
        assert kept == {"agent 7.5d"}


def test_eviction_takes_the_earliest_expiry_first(tmp_path: Path, clock: FakeClock) -> None:
    body = 64 << 10  # 14 shards of 64 KiB stay under the high watermark of 0.9 MiB
    mib = 1 << 20
    with open_store(
        tmp_path / "db", clock, capacity_bytes=mib, low_watermark=0.5, sweep_batch=2
    ) as store:
        # key n is written at hour n: agent blocks expire first, then by age.
        for n in range(14):
            cls = "agent" if n % 3 == 0 else "chat"
            shard = block_records(key(n), body_len=body, traffic_class=cls, indices=[0])
            assert put(store, shard) == [Status.OK]
            clock.step(HOUR)
        assert store.counters["evicted_shards"] == 0
        # The next write crosses the high watermark: it evicts only what it needs itself
        # (one shard), so no request waits for a large eviction...
        assert put(store, block_records(key(99), body_len=body, indices=[0])) == [Status.OK]
        order = sorted(range(14), key=lambda n: (0 if n % 3 == 0 else 1, n))  # expiry order
        evicted = {n for n in range(14) if not held(store, key(n))}
        assert evicted == {order[0]}
        # ... the loop then drains one bounded batch (sweep_batch, 2) before it answers
        # any other request, once (a second call finds no new crossing)...
        assert store.drain_after_crossing() == 2
        assert store.drain_after_crossing() == 0
        evicted = {n for n in range(14) if not held(store, key(n))}
        assert evicted == set(order[:3])
        assert store.usage()["used_bytes"] <= 0.9 * mib
        # ... and background work, in bounded steps, takes usage down to the low watermark.
        steps = 0
        while store.maintain():
            steps += 1
            assert steps < 100
        evicted = {n for n in range(14) if not held(store, key(n))}
        assert store.counters["evicted_shards"] == len(evicted) > 3
        assert store.usage()["used_bytes"] <= 0.5 * mib
        assert evicted == set(order[: len(evicted)])
        assert held(store, key(99)) == {0}
        assert store.recount() == store.usage()


def test_a_short_drain_is_one_batch_after_the_write_that_started_it(
    tmp_path: Path, clock: FakeClock
) -> None:
    """A drain to the low watermark of at most ``sweep_batch`` shards is over after the
    one batch the loop runs once the crossing PUT is answered: the next request finds what
    the retention simulator says it finds, however soon it comes (issue 20)."""
    body = 64 << 10
    mib = 1 << 20
    with open_store(tmp_path / "db", clock, capacity_bytes=mib, low_watermark=0.5) as store:
        for n in range(14):
            assert put(store, block_records(key(n), body_len=body, indices=[0])) == [Status.OK]
            clock.step(HOUR)
        assert store.drain_after_crossing() == 0  # nothing crossed yet
        assert put(store, block_records(key(99), body_len=body, indices=[0])) == [Status.OK]
        assert store.drain_after_crossing() > 0
        assert store.usage()["used_bytes"] <= 0.5 * mib
        # The fresh shard stays (the oldest went first), and nothing is left to drain.
        assert held(store, key(99)) == {0}
        evicted = {n for n in range(14) if not held(store, key(n))}
        assert evicted == set(range(len(evicted))) and len(evicted) >= 7
        assert not store.maintain()
        assert store.recount() == store.usage()


def test_batch_larger_than_capacity_is_refused_whole(tmp_path: Path, clock: FakeClock) -> None:
    with open_store(tmp_path / "db", clock, capacity_bytes=1 << 20) as store:
        shards = block_records(key(1), body_len=128 << 10)  # 12 x 128 KiB > 1 MiB
        assert put(store, shards) == [Status.NO_SPACE] * 12
        assert held(store, key(1)) == set()
        assert store.counters["error_capacity"] == 1


def test_map_full_aborts_the_whole_batch(tmp_path: Path, clock: FakeClock) -> None:
    with open_store(
        tmp_path / "db", clock, capacity_bytes=1 << 30, map_size_bytes=1 << 20
    ) as store:
        assert put(store, block_records(key(1), body_len=1024)) == [Status.OK] * 12
        # Records live in segment files (format v4 on): only the index fills the map, so the
        # batch that does not fit is many small shards (about 100 bytes of index each).
        big = [s for n in range(2, 2000) for s in block_records(key(n), body_len=64)]
        assert put(store, big) == [Status.NO_SPACE] * len(big)
        assert held(store, key(2)) == set()
        assert store.counters["error_map_full"] == 1
        assert held(store, key(1)) == set(range(12))
        assert store.recount() == store.usage()
        shards = block_records(key(5000), body_len=1024)
        assert put(store, shards) == [Status.OK] * 12
        # The failed batch's appended bytes were rewound over: the next batch reads back.
        assert get(store, [(key(5000), i) for i in range(12)])[1] == [r for _, _, r in shards]


def test_reopen_keeps_shards_counters_and_policy(tmp_path: Path, clock: FakeClock) -> None:
    shards = block_records(key(1))
    with open_store(tmp_path / "db", clock) as store:
        put(store, shards)
        store.set_policy(RetentionPolicy.from_mapping({"classes": {"chat": "1d", "default": "1h"}}))
        usage = store.usage()
    with open_store(tmp_path / "db", clock, policy=RetentionPolicy()) as store:
        assert store.usage() == usage
        assert store.policy.ttl_s("chat") == DAY_S  # the admin-set policy is kept
        assert get(store, [(key(1), 5)])[1] == [shards[5][2]]
        store.clear_policy(RetentionPolicy())
        assert store.policy == RetentionPolicy()


def test_one_daemon_per_directory(tmp_path: Path, clock: FakeClock) -> None:
    with open_store(tmp_path / "db", clock), pytest.raises(StorageError, match="in use"):
        open_store(tmp_path / "db", clock)


# ---------------------------------------------------------------------- model check


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, int, int, int]]:
    ops = st.tuples(
        st.sampled_from(["put", "put", "get", "touch", "delete", "step", "sweep"]),
        st.integers(0, 5),  # key
        st.integers(0, 3),  # index / seed
        st.integers(0, 2),  # class / hours
    )
    return draw(st.lists(ops, max_size=30))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(script=operations())
def test_store_agrees_with_a_model(
    tmp_path_factory: pytest.TempPathFactory, script: list[tuple[str, int, int, int]]
) -> None:
    """Random operations against a dict model: same visible shards, counters match a rescan."""
    clock = FakeClock()
    classes = ["agent", "chat", "other"]
    # (key, index) -> (record, expiry_ms, stripe)
    model: dict[tuple[int, int], tuple[bytes, int, int]] = {}
    policy = RetentionPolicy()
    path = tmp_path_factory.mktemp("model")
    with open_store(path, clock, touch_resolution_s=0.0) as store:
        for op, k, i, c in script:
            now = int(clock.now * 1000)
            if op == "put":
                (rec,) = block_records(key(k), indices=[i], seed=c, traffic_class=classes[c])
                stripe = split_shard(rec[2])[0].stripe_id
                old = model.get((k, i))
                live = old is not None and old[1] > now
                if live and old is not None and old[2] != stripe:
                    assert put(store, [rec]) == [Status.CONFLICT]
                    continue
                assert put(store, [rec]) == [Status.OK]
                expiry = policy.expiry_for(classes[c], clock.now)
                if live and old is not None:
                    expiry = max(expiry, old[1])
                model[(k, i)] = (rec[2], expiry, stripe)
            elif op == "get":
                status, records = get(store, [(key(k), i)], classes[c])
                live = (k, i) in model and model[(k, i)][1] > now
                assert status == [Status.OK if live else Status.NOT_FOUND]
                if live:
                    assert records == [model[(k, i)][0]]
                    rec0, exp0, st0 = model[(k, i)]
                    model[(k, i)] = (rec0, max(exp0, policy.expiry_for(classes[c], clock.now)), st0)
            elif op == "touch":
                store.touch(T, keys_items(Op.TOUCH, [key(k)]), classes[c])
                for (mk, mi), (rec, exp, st) in list(model.items()):
                    if mk == k and exp > now:
                        slid = max(exp, policy.expiry_for(classes[c], clock.now))
                        model[(mk, mi)] = (rec, slid, st)
            elif op == "delete":
                items = make_items(Op.DELETE, 1, reply=False)
                items["key"] = [key(k)]
                items["index"] = [i]
                store.delete(T, items)
                model.pop((k, i), None)
            elif op == "step":
                clock.step(c * DAY_S * 2 + i * HOUR)
            else:
                store.sweep(limit=3)
            now = int(clock.now * 1000)
            for k2 in range(6):
                expected = {
                    mi for (mk, mi), (_, exp, _st) in model.items() if mk == k2 and exp > now
                }
                assert held(store, key(k2)) == expected
        store.flush_touches()
        assert store.recount() == store.usage()
        assert np.all(
            np.array(
                [
                    store.expiry_of(T, key(mk), mi)[0] >= exp
                    for (mk, mi), (_, exp, _st) in model.items()
                    if store.expiry_of(T, key(mk), mi)
                ]
            )
        )


def test_random_keys_smoke(store: ShardStore) -> None:
    keys = [os.urandom(16) for _ in range(50)]
    shards = [s for k in keys for s in block_records(k, indices=[0, 7])]
    assert put(store, shards) == [Status.OK] * 100
    status, records = get(store, [(k, i) for k, i, _ in shards])
    assert status == [Status.OK] * 100 and records == [r for _, _, r in shards]


# ---------------------------------------------------------------------- batched paths


def test_get_all_hits_duplicates_and_misses(store: ShardStore) -> None:
    """The all-hits path (no per-item Python) and the per-item path answer alike."""
    shards = block_records(key(1)) + block_records(key(2), traffic_class="agent")
    put(store, shards)
    wanted = [(k, i) for k, i, _ in shards]
    records = [r for _, _, r in shards]
    assert get(store, wanted) == ([Status.OK] * 24, records)
    assert get(store, wanted[:3] + wanted[:3]) == ([Status.OK] * 6, records[:3] * 2)
    status, got = get(store, [wanted[0], (key(9), 0), wanted[5], (key(1), 12)])
    assert status == [Status.OK, Status.NOT_FOUND, Status.OK, Status.NOT_FOUND]
    assert got == [records[0], b"", records[5], b""]
    assert get(store, []) == ([], [])


def test_get_with_due_and_pending_slides(store: ShardStore, clock: FakeClock) -> None:
    agent = block_records(key(1), traffic_class="agent", indices=[0, 1])
    chat = block_records(key(2), traffic_class="chat", indices=[0, 1])
    put(store, agent + chat)
    clock.step(HOUR)
    wanted = [(k, i) for k, i, _ in agent + chat]
    records = [r for _, _, r in agent + chat]
    # chat traffic moves the agent shards by days: slides are recorded, not written.
    assert get(store, wanted, "chat") == ([Status.OK] * 4, records)
    assert store.expiry_of(T, key(1), 0) == (int((clock.now + 7 * DAY_S) * 1000), "chat")
    assert store.counters["touches_written"] == 0
    # With slides pending for some keys, a batch holding them takes the per-item path.
    assert get(store, wanted) == ([Status.OK] * 4, records)
    assert store.flush_touches() == 4  # chat shards move by the hour since their write
    clock.step(6 * DAY_S)  # agent's own 3 days are long gone; the chat slide keeps them
    assert held(store, key(1)) == held(store, key(2)) == {0, 1}
    clock.step(DAY_S)  # past the slid expiry
    assert get(store, wanted)[0] == [Status.NOT_FOUND] * 4


def test_get_refuses_a_reply_over_the_limit(tmp_path: Path, clock: FakeClock) -> None:
    shards = block_records(key(1), body_len=1024, indices=[0, 1, 2])
    with open_store(tmp_path / "db", clock, max_reply_bytes=2 * len(shards[0][2])) as store:
        put(store, shards)
        assert get(store, [(key(1), 0), (key(1), 1)])[0] == [Status.OK] * 2
        with pytest.raises(ReplyTooLargeError, match="at item 2"):
            store.get(T, get_items([(key(1), i) for i in range(3)]))
        with pytest.raises(ReplyTooLargeError, match="at item 3"):
            store.get(T, get_items([(key(9), 0), (key(1), 0), (key(1), 1), (key(1), 2)]))


def test_put_many_is_one_transaction_with_per_batch_replies(store: ShardStore) -> None:
    first = block_records(key(1), indices=[0, 1, 2])
    second = block_records(key(1), indices=[2, 3], seed=5) + block_records(key(2), indices=[0])
    bad = list(second)
    bad[1] = (key(9), 3, second[1][2])  # a record under another key
    items, data = put_items(bad)
    mismatched = PutBatch(T, put_items(first)[0], memoryview(b"short"))
    replies = store.put_many([PutBatch(T, *put_items(first)), PutBatch(T, items, data), mismatched])
    assert replies[0]["status"].tolist() == [Status.OK] * 3  # type: ignore[index]
    assert replies[1]["status"].tolist() == [  # type: ignore[index]
        Status.CONFLICT,  # (key 1, index 2) was just written by the first batch's stripe
        Status.WRONG_KEY,
        Status.OK,
    ]
    assert isinstance(replies[2], ProtocolError)
    assert get(store, [(key(1), 2)])[1] == [first[2][2]]
    assert held(store, key(1)) == {0, 1, 2} and held(store, key(2)) == {0}
    assert store.usage()["shards"] == 4
    assert store.recount() == store.usage()


def test_put_many_failure_fails_only_the_batch_that_does_not_fit(
    tmp_path: Path, clock: FakeClock
) -> None:
    """The group transaction fails (the map is full); each batch is then written on its
    own: the one that fits is stored, the one that does not stores nothing."""
    with open_store(
        tmp_path / "db", clock, capacity_bytes=1 << 30, map_size_bytes=1 << 20
    ) as store:
        small = block_records(key(1), body_len=1024, indices=[0, 1])
        # Only index rows fill the map (records are in segment files): many small shards.
        big = [s for n in range(2, 2000) for s in block_records(key(n), body_len=64)]
        broken = list(small)
        broken[1] = (key(1), 1, small[1][2][:-1] + b"\x00")  # body checksum mismatch
        replies = store.put_many([PutBatch(T, *put_items(broken)), PutBatch(T, *put_items(big))])
        assert replies[0]["status"].tolist() == [  # type: ignore[index]
            Status.OK,
            Status.CHECKSUM,
        ]
        assert replies[1]["status"].tolist() == [Status.NO_SPACE] * len(big)  # type: ignore[index]
        assert held(store, key(1)) == {0} and held(store, key(2)) == set()
        assert store.counters["error_map_full"] == 1
        assert store.usage()["shards"] == 1 and store.recount() == store.usage()


def test_data_file_is_allocated_ahead_up_to_the_map_size(tmp_path: Path, clock: FakeClock) -> None:
    """Without writemap LMDB grows its file as it writes; it is kept allocated a chunk ahead."""
    data_file = tmp_path / "db" / "data.mdb"
    with open_store(tmp_path / "db", clock, map_size_bytes=8 << 20, writemap=False) as store:
        assert not store._lmdb.writemap
        put(store, block_records(key(1), body_len=1024))
        # A chunk ahead, but a small map gets a small chunk (1/32 of it).
        assert 256 << 10 <= data_file.stat().st_size <= 1 << 20
    with open_store(tmp_path / "db", clock, map_size_bytes=4 << 30, writemap=False) as store:
        assert get(store, [(key(1), 0)])[0] == [Status.OK]
        put(store, block_records(key(2), body_len=1 << 20))  # 12 MiB of records
        # LMDB holds the index only (format v4): its file stays small.
        assert data_file.stat().st_size <= 2 << 20
        assert held(store, key(2)) == set(range(12))
        # The records themselves went to a segment file, not into LMDB's pages.
        segments = list((tmp_path / "db" / "segments").glob("*.seg"))
        assert sum(p.stat().st_size for p in segments) >= 12 << 20


def test_with_writemap_every_page_a_write_may_add_is_allocated_before_it(
    tmp_path: Path, clock: FakeClock
) -> None:
    """With writemap LMDB sizes its file to the whole map, sparse, and a store through the map
    into a hole that a full disk cannot fill is a SIGBUS. So before every write transaction
    the file is allocated past LMDB's last page by all that transaction may add; the rest of
    the map stays a hole."""
    data_file = tmp_path / "db" / "data.mdb"
    with open_store(tmp_path / "db", clock, map_size_bytes=256 << 20) as store:
        env = store._lmdb
        assert env.writemap
        assert data_file.stat().st_size == 256 << 20  # the whole map, as LMDB sized it
        page = env.env.stat()["psize"]
        for n in range(60):
            # One shard each of 64 blocks, as one node of twelve gets them; every fifth
            # round also expires what is due, so deletes and frees take their turns.
            shards = [block_records(key(n * 64 + b), indices=[b % 12])[0] for b in range(64)]
            assert put(store, shards) == [Status.OK] * 64
            if n % 5 == 4:
                clock.step(8 * DAY_S)
                store.sweep()
            used = (env.env.info()["last_pgno"] + 1) * page
            allocated = data_file.stat().st_blocks * 512
            # Room for the next PUT like this one (its 64 rows), at least.
            assert allocated >= min(256 << 20, used + (1024 + 64 * 8) * page)
        assert allocated <= 64 << 20  # what the index needs and a chunk ahead, not the map
    # Reopened, the allocation is found again before the first write.
    with open_store(tmp_path / "db", clock, map_size_bytes=256 << 20) as store:
        assert put(store, [block_records(key(10**6), indices=[0])[0]]) == [Status.OK]
        assert data_file.stat().st_blocks * 512 >= (
            (store._lmdb.env.info()["last_pgno"] + 1) * page
        )


def test_a_file_that_may_not_grow_to_the_map_opens_without_writemap(
    tmp_path: Path, clock: FakeClock
) -> None:
    """With writemap LMDB makes its file as large as the map at open; where that is refused
    (here a file size limit, as a file system's largest file would), the store opens
    without writemap and works as before."""
    script = f"""
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 20, 32 << 20))
from kvcache.server.store import ShardStore
with ShardStore({str(tmp_path / "db")!r}, capacity_bytes=64 << 20) as store:
    print("writemap", store._lmdb.writemap, flush=True)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert "writemap False" in done.stdout
    assert "opens without writemap" in done.stderr
    with open_store(tmp_path / "db", clock) as store:  # and with writemap once it may
        assert store._lmdb.writemap


# ---------------------------------------------------------------------- tenants


def test_tenants_are_separate_stores_on_one_node(store: ShardStore) -> None:
    mine = block_records(key(1))
    theirs = block_records(key(1), seed=9)  # same block key, another tenant
    assert put(store, mine) == [Status.OK] * 12
    assert put(store, theirs, tenant=OTHER) == [Status.OK] * 12  # no conflict across tenants
    assert get(store, [(key(1), 0)])[1] == [mine[0][2]]
    assert get(store, [(key(1), 0)], tenant=OTHER)[1] == [theirs[0][2]]
    items = make_items(Op.DELETE, 1, reply=False)
    items["key"] = [key(1)]
    items["index"] = [NO_INDEX]
    assert store.delete(OTHER, items)["status"].tolist() == [Status.OK]  # type: ignore[arg-type]
    assert held(store, key(1)) == set(range(12)) and held(store, key(1), tenant=OTHER) == set()
    usage = store.usage({T: "default", OTHER: "alice"})  # type: ignore[dict-item]
    assert set(usage["tenants"]) == {"default"}
    assert store.recount()["used_bytes"] == usage["used_bytes"]


def test_a_put_refused_conflict_evicts_nothing_for_it(tmp_path: Path, clock: FakeClock) -> None:
    """Room was made for every byte of a PUT before its conflicts were known: a re-store of
    stored blocks (every shard refused CONFLICT, nothing written) evicted as many bytes of
    other blocks, on a full node and under a tenant's quota alike."""
    body = 64 << 10
    mib = 1 << 20
    quota = Quota(total=14 * (body + 104))
    with open_store(tmp_path / "db", clock, capacity_bytes=mib, quotas={OTHER: quota}) as store:
        for tenant in (T, OTHER):
            for n in range(7):  # 14 of 64 KiB: just under the high watermark (0.9 MiB)
                shard = block_records(key(n), body_len=body, indices=[0])
                assert put(store, shard, tenant=tenant) == [Status.OK]
                clock.step(1)
        used = store.usage()["used_bytes"]
        for tenant in (T, OTHER):  # the same blocks again, under another stripe id
            for n in range(7):
                again = block_records(key(n), body_len=body, indices=[0], seed=1)
                assert put(store, again, tenant=tenant) == [Status.CONFLICT]
        assert store.counters["evicted_shards"] == store.counters["quota_evicted_shards"] == 0
        assert store.usage()["used_bytes"] == used
        # A new block still makes room, as before.
        assert put(store, block_records(key(50), body_len=body, indices=[0])) == [Status.OK]
        assert store.counters["evicted_shards"] == 1


def test_a_tenant_at_its_quota_evicts_its_own_blocks(tmp_path: Path, clock: FakeClock) -> None:
    body = 64 << 10
    quota = 8 * (body + 104)
    with open_store(
        tmp_path / "db", clock, quotas={T: Quota(total=quota)}, capacity_bytes=64 << 20
    ) as store:
        victim = [block_records(key(1000 + n), body_len=body, indices=[0]) for n in range(4)]
        for shards in victim:
            assert put(store, shards, tenant=OTHER) == [Status.OK]
        for n in range(40):  # a flood of 5x the quota
            clock.step(1)
            assert put(store, block_records(key(n), body_len=body, indices=[0])) == [Status.OK]
        assert store.book.tenant_bytes(T) <= quota
        assert all(held(store, key(1000 + n), tenant=OTHER) == {0} for n in range(4))
        assert store.counters["quota_evicted_shards"] == 40 - 8
        assert held(store, key(39)) == {0} and held(store, key(0)) == set()  # oldest went first
        # A batch larger than the whole quota can never fit.
        big = block_records(key(99), body_len=body, indices=list(range(12)))
        assert put(store, big) == [Status.QUOTA] * 12
        assert store.counters["error_quota"] == 1
        assert store.recount() == store.usage()


def test_class_quota_evicts_only_that_class(tmp_path: Path, clock: FakeClock) -> None:
    body = 16 << 10
    quota = Quota(classes={"agent": 4 * (body + 104)})
    with open_store(tmp_path / "db", clock, quotas={T: quota}) as store:
        chat = block_records(key(500), body_len=body, traffic_class="chat", indices=[0, 1, 2])
        assert put(store, chat) == [Status.OK] * 3
        for n in range(10):
            clock.step(1)
            agent = block_records(key(n), body_len=body, traffic_class="agent", indices=[0])
            assert put(store, agent) == [Status.OK]
        assert held(store, key(500)) == {0, 1, 2}
        assert store.usage()["classes"]["agent"]["shards"] == 4


def test_capacity_pressure_takes_the_flooding_tenant_first(
    tmp_path: Path, clock: FakeClock
) -> None:
    """No quotas: a tenant holding more than its share evicts its own blocks, even older ones
    of a quieter tenant survive."""
    body = 64 << 10
    mib = 1 << 20
    with open_store(tmp_path / "db", clock, capacity_bytes=2 * mib, low_watermark=0.5) as store:
        quiet = [block_records(key(1000 + n), body_len=body, indices=[0]) for n in range(5)]
        for shards in quiet:
            assert put(store, shards, tenant=OTHER) == [Status.OK]
        for n in range(60):
            clock.step(HOUR)
            assert put(store, block_records(key(n), body_len=body, indices=[0])) == [Status.OK]
        assert store.counters["evicted_shards"] > 0
        assert all(held(store, key(1000 + n), tenant=OTHER) == {0} for n in range(5))
        assert store.recount() == store.usage()


def test_expiry_index_keeps_one_key_per_batch_expiry(tmp_path: Path, clock: FakeClock) -> None:
    """Store format v3: a PUT batch's shards are duplicates of one (partition, expiry) key,
    a slid expiry moves one duplicate to its own key, and the sweep takes them apart."""
    import lmdb

    with open_store(tmp_path / "db", clock) as s:
        put(s, [r for n in range(4) for r in block_records(key(n), traffic_class="agent")])
        clock.step(HOUR)
        put(s, block_records(key(9), traffic_class="agent"))
        clock.step(HOUR)
        get(s, [(key(0), 3)], "chat")  # slides one shard to chat, 7 days from now
        s.flush_touches()
    env = lmdb.open(str(tmp_path / "db"), readonly=True, lock=False, max_dbs=4)
    with env.begin() as txn:
        db = env.open_db(b"expiry", txn=txn, create=False)
        stat = txn.stat(db)
        keys = {bytes(k) for k, _ in txn.cursor(db=db)}
    env.close()
    assert stat["entries"] == 60 and len(keys) == 3
    with open_store(tmp_path / "db", clock) as s:
        clock.step(3 * DAY_S - 1.5 * HOUR)  # the first batch expired, the second not yet
        assert s.sweep(limit=1000) == 47
        assert held(s, key(0)) == {3} and held(s, key(9)) == set(range(12))
        clock.step(HOUR)
        assert s.sweep(limit=1000) == 12
        assert s.recount() == s.usage()


def test_a_v2_directory_is_refused_with_a_clear_message(tmp_path: Path, clock: FakeClock) -> None:
    """A data directory of store format v2 (expiry index with a key per shard)."""
    import lmdb

    path = tmp_path / "db"
    path.mkdir()
    env = lmdb.open(str(path), max_dbs=4)
    shards, expiry, meta = (env.open_db(n) for n in (b"shards", b"expiry", b"meta"))
    env.open_db(b"retention")
    with env.begin(write=True) as txn:
        txn.put(b"format", b"kvcache-store-v2", db=meta)
        txn.put(T + key(1) + b"\x00\x00", b"record", db=shards)
        txn.put(T + b"chat".ljust(16, b"\x00") + bytes(8) + key(1) + b"\x00\x00", b"", db=expiry)
    env.close()
    with pytest.raises(StorageError, match=r"store format .kvcache-store-v2.*fresh data directory"):
        open_store(path, clock)
    # Refused, not changed: the old records are all still there.
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=4)
    with env.begin() as txn:
        assert txn.get(b"format", db=env.open_db(b"meta", txn=txn, create=False)) == (
            b"kvcache-store-v2"
        )
        assert txn.stat(env.open_db(b"shards", txn=txn, create=False))["entries"] == 1
    env.close()


def test_a_quota_refusal_in_a_group_commit_fails_only_that_tenants_batch(
    tmp_path: Path, clock: FakeClock
) -> None:
    """Issue 18: PUTs of several connections share one transaction; a tenant whose batch
    can never fit its quota used to fail every batch in it (QUOTA for all)."""
    body = 4 << 10
    with open_store(tmp_path / "db", clock, quotas={T: Quota(total=2 * (body + 104))}) as store:
        over = put_items(block_records(key(1), body_len=body, indices=list(range(12))))
        mine = [put_items(block_records(key(10 + n), body_len=body)) for n in range(3)]
        replies = store.put_many(
            [PutBatch(OTHER, *mine[0]), PutBatch(T, *over), PutBatch(OTHER, *mine[1]),
             PutBatch(OTHER, *mine[2])]
        )  # fmt: skip
        statuses = [r["status"].tolist() for r in replies if not isinstance(r, Exception)]
        assert statuses == [[Status.OK] * 12, [Status.QUOTA] * 12, [Status.OK] * 12,
                            [Status.OK] * 12]  # fmt: skip
        assert all(held(store, key(10 + n), tenant=OTHER) == set(range(12)) for n in range(3))
        assert held(store, key(1)) == set()
        assert store.counters["error_quota"] == 1  # counted once, for the batch that failed
        assert store.recount() == store.usage()
