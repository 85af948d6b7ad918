"""Retention hints (TTL, pin) at the store: clamped into the class bounds, pins against the
tenant's pin quota, kept out of eviction, and kept across a restart. Real LMDB, stepped clock."""

from __future__ import annotations

from pathlib import Path

from server_fixtures import FakeClock, block_records, get_items, keys_items, put_items

from kvcache.credentials import tenant_id
from kvcache.retention import RetentionPolicy
from kvcache.server.eviction import Quota
from kvcache.server.store import PutBatch, ShardStore
from kvcache.wire import NO_INDEX, NO_RETAIN, Op, Retain, Status, make_items

T = tenant_id("default")
POLICY = RetentionPolicy(
    classes={"agent": 3 * 86400, "chat": 7 * 86400, "default": 3 * 86400},
    default_class="default",
    ttl_bounds={"agent": (600, 5 * 86400)},
)


def key(n: int) -> bytes:
    return n.to_bytes(16, "big")


def put(store: ShardStore, n: int, cls: str, retain: Retain = NO_RETAIN) -> list[int]:
    items, data = put_items(block_records(key(n), traffic_class=cls, indices=[0]))
    [reply] = store.put_many([PutBatch(T, items, data, retain)])  # type: ignore[arg-type]
    assert not isinstance(reply, Exception)
    return reply["status"].tolist()  # type: ignore[no-any-return]


def open_store(path: Path, clock: FakeClock, **kw: object) -> ShardStore:
    return ShardStore(path, clock=clock, policy=POLICY, quotas={T: Quota(pins=5000)}, **kw)  # type: ignore[arg-type]


def test_a_ttl_hint_is_clamped_into_its_class_bounds(tmp_path: Path) -> None:
    clock = FakeClock()
    now = int(clock() * 1000)
    with open_store(tmp_path / "db", clock, capacity_bytes=64 << 20) as store:
        put(store, 1, "agent", Retain(ttl_s=3600))
        put(store, 2, "agent", Retain(ttl_s=30))  # below 600 s
        put(store, 3, "agent", Retain(ttl_s=30 * 86400))  # above 5 d
        put(store, 4, "chat", Retain(ttl_s=30 * 86400))  # default bounds: up to 7 d
        put(store, 5, "agent")
        assert store.expiry_of(T, key(1), 0) == (now + 3600_000, "agent")
        assert store.expiry_of(T, key(2), 0) == (now + 600_000, "agent")
        assert store.expiry_of(T, key(3), 0) == (now + 5 * 86400_000, "agent")
        assert store.expiry_of(T, key(4), 0) == (now + 7 * 86400_000, "chat")
        assert store.expiry_of(T, key(5), 0) == (now + 3 * 86400_000, "agent")
        assert store.counters["hints_clamped"] == 3
        # A hit with a TTL hint slides to its own (clamped) TTL.
        clock.step(3000)
        store.get(T, get_items([(key(1), 0)]), "agent", Retain(ttl_s=7200)).release()  # type: ignore[arg-type]
        store.flush_touches()
        assert store.expiry_of(T, key(1), 0) == (now + 3000_000 + 7200_000, "agent")


def test_pins_hold_against_eviction_within_the_pin_quota_and_survive_a_restart(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    record = len(block_records(key(0), indices=[0])[0][2])
    cap = record * 10
    with open_store(tmp_path / "db", clock, capacity_bytes=cap) as store:
        assert put(store, 1, "chat", Retain(pin=True)) == [Status.OK]
        assert store.expiry_of(T, key(1), 0)[1] == "+chat"  # type: ignore[index]
        for n in range(2, 30):  # fill past capacity: unpinned shards churn
            clock.step(1)
            assert put(store, n, "chat") == [Status.OK]
        assert store.counters["evicted_shards"] > 0
        assert store.expiry_of(T, key(1), 0) is not None  # the oldest, but pinned
        # The pin quota (5000 bytes) holds few records: a pin past it is dropped, counted.
        pinned = 1
        while put(store, 100 + pinned, "chat", Retain(pin=True)) == [Status.OK]:
            got = store.expiry_of(T, key(100 + pinned), 0)
            if got is None or got[1] == "chat":
                break
            pinned += 1
        assert pinned * record <= 5000 < (pinned + 1) * record
        assert store.counters["pins_refused"] == 1
        assert store.usage()["classes"]["+chat"]["bytes"] == pinned * record
    with open_store(tmp_path / "db", clock, capacity_bytes=cap) as store:
        assert store.expiry_of(T, key(1), 0)[1] == "+chat"  # type: ignore[index]
        for n in range(200, 230):
            clock.step(1)
            put(store, n, "chat")
        assert store.expiry_of(T, key(1), 0) is not None
        # A pin still expires: after its class's TTL it is gone.
        clock.step(8 * 86400)
        store.sweep()
        assert store.expiry_of(T, key(1), 0) is None


def test_a_drain_held_up_by_pins_does_not_ask_to_run_again_at_once(tmp_path: Path) -> None:
    """Pins above the low watermark: the drain takes every unpinned shard it can, and then
    maintenance says nothing more is waiting (the daemon's loop would otherwise call it
    again at once, forever); the pins stay."""
    clock = FakeClock()
    record = len(block_records(key(0), indices=[0])[0][2])
    cap = record * 10
    with ShardStore(tmp_path / "db", clock=clock, policy=POLICY, capacity_bytes=cap,
                    quotas={T: Quota(pins=cap)}, sweep_batch=1) as store:  # type: ignore[arg-type]  # fmt: skip
        for n in range(9):  # 90 % pinned: above the low watermark (80 %) for good
            clock.step(1)
            assert put(store, n, "chat", Retain(pin=True)) == [Status.OK]
        clock.step(1)
        assert put(store, 100, "chat") == [Status.OK]  # crosses the high watermark
        turns = 0
        while store.maintain():
            turns += 1
            assert turns < 10
        assert store.expiry_of(T, key(100), 0) is None  # the unpinned shard went
        assert store.book.used > store._low and store._draining  # the pins hold it above
        assert not store.maintain()  # and it does not ask again at once
        assert all(store.expiry_of(T, key(n), 0) is not None for n in range(9))


def test_a_touch_pins_stored_blocks_and_a_tenant_without_pin_quota_gets_none(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    with open_store(tmp_path / "db", clock, capacity_bytes=64 << 20) as store:
        put(store, 1, "chat")
        store.touch(T, keys_items(Op.TOUCH, [key(1)]), "chat", Retain(pin=True))  # type: ignore[arg-type]
        assert store.expiry_of(T, key(1), 0)[1] == "+chat"  # type: ignore[index]
        store.quotas = {}
        put(store, 2, "chat", Retain(pin=True))
        assert store.expiry_of(T, key(2), 0)[1] == "chat"  # type: ignore[index]
        assert store.counters["pins_refused"] == 1
        assert store.recount() == store.usage()


def test_removals_are_counted_by_cause_with_their_ages(tmp_path: Path) -> None:
    from kvcache.server.removals import AGE_BUCKETS_S

    clock = FakeClock()
    record = len(block_records(key(0), indices=[0])[0][2])
    with open_store(tmp_path / "db", clock, capacity_bytes=record * 10) as store:
        put(store, 1, "agent", Retain(ttl_s=3600))
        clock.step(2 * 3600)  # expired, not swept yet
        for n in range(2, 14):  # past capacity: the expired one first, then live ones
            put(store, n, "chat")
            clock.step(10)
        store.sweep()
        items = make_items(Op.DELETE, 1, reply=False)
        items["key"], items["stripe"], items["index"] = key(13), 0, NO_INDEX
        store.delete(T, items)  # type: ignore[arg-type]
        rows = {(r["class"], r["cause"]): r for r in store.removals.snapshot()}
        assert rows["agent", "expired"]["shards"] == 1
        age = rows["agent", "expired"]["age_sum_s"]
        assert 2 * 3600 <= age <= 2 * 3600 + 200
        evicted = rows["chat", "evicted"]
        assert evicted["shards"] == store.counters["evicted_shards"] - 1 > 0
        assert evicted["bytes"] == evicted["shards"] * record
        assert evicted["buckets"][1] == [AGE_BUCKETS_S[1], evicted["shards"]]  # all < 10 min
        assert evicted["buckets"][0][1] < evicted["shards"]  # some older than a minute
        assert evicted["buckets"][-1] == ["+Inf", evicted["shards"]]
        assert rows["chat", "deleted"]["shards"] == 1
        oldest = store.oldest_live()
        assert set(oldest) == {(T, "chat")}
        assert 0 < oldest[T, "chat"] <= 120_000


def test_one_eviction_pass_counts_expired_and_live_shards_of_a_class_apart(
    tmp_path: Path,
) -> None:
    """Pressure that takes a class's expired shards and live ones in one pass counts each
    under its own cause, with its own bytes and ages."""
    clock = FakeClock()
    record = len(block_records(key(0), indices=[0])[0][2])
    with open_store(
        tmp_path / "db", clock, capacity_bytes=record * 10, low_watermark=0.2, sweep_batch=16
    ) as store:
        for n in range(3):  # a short TTL: expired below, not swept
            put(store, n, "chat", Retain(ttl_s=3600))
        clock.step(2 * 3600)
        for n in range(3, 9):
            put(store, n, "chat")
        assert store.counters["evicted_shards"] == 0
        put(store, 9, "chat")  # past the high watermark: the write takes one expired shard ...
        assert store.counters["evicted_shards"] == 1
        # ... and the drain after it, in one pass, the other two and live ones.
        assert store.drain_after_crossing() > 2
        rows = {(r["class"], r["cause"]): r for r in store.removals.snapshot()}
        assert rows["chat", "expired"]["shards"] == 3
        assert rows["chat", "expired"]["bytes"] == 3 * record
        assert 2 * 3600 <= rows["chat", "expired"]["age_sum_s"] / 3 <= 2 * 3600 + 60
        live = rows["chat", "evicted"]
        assert live["shards"] == store.counters["evicted_shards"] - 3 > 0
        assert live["bytes"] == live["shards"] * record
        assert live["age_sum_s"] < 60 * live["shards"]
        assert store.recount() == store.usage()


def test_a_pinned_write_counts_against_the_tenants_total_not_its_class_quota(
    tmp_path: Path,
) -> None:
    """Pinned bytes count against the tenant's total quota and its pin quota, not its class
    quota (docs/spec/retention.md, "Hints"): a pinned chat write was charged to the chat
    quota, so it evicted the tenant's unpinned chat blocks, and one larger than that quota
    was refused QUOTA (after evicting them too) though the pin quota held it."""
    clock = FakeClock()
    record = len(block_records(key(0), indices=[0])[0][2])
    quota = Quota(classes={"chat": 4 * record}, pins=20 * record)
    with ShardStore(
        tmp_path / "db", clock=clock, policy=POLICY, quotas={T: quota}, capacity_bytes=64 << 20
    ) as store:
        for n in range(1, 5):  # the chat quota, full of unpinned blocks
            assert put(store, n, "chat") == [Status.OK]
        for n in range(10, 16):  # more pinned chat bytes than the chat quota
            assert put(store, n, "chat", Retain(pin=True)) == [Status.OK]
            assert store.expiry_of(T, key(n), 0)[1] == "+chat"  # type: ignore[index]
        assert all(store.expiry_of(T, key(n), 0) is not None for n in range(1, 5))
        assert store.counters["quota_evicted_shards"] == 0
        # The class quota still holds for unpinned writes: the oldest chat block goes.
        assert put(store, 5, "chat") == [Status.OK]
        assert store.expiry_of(T, key(1), 0) is None
        assert store.counters["quota_evicted_shards"] == 1
