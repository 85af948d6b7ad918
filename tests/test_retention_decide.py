"""The pure retention rules (kvcache.retention.decide), without a store."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from server_fixtures import FakeClock, block_records, get_items, put_items

from kvcache.credentials import tenant_id
from kvcache.errors import ArgumentError, ConfigError
from kvcache.retention import NO_HINT, Hint, RetentionPolicy, clamp, decide
from kvcache.retention.decide import WriteAction, write_action
from kvcache.server.store import ShardStore

POLICY = RetentionPolicy(
    classes={"agent": 3 * 86400, "chat": 7 * 86400, "default": 3 * 86400},
    default_class="default",
    ttl_bounds={"chat": (3600, 14 * 86400)},
)
expiries = st.integers(0, 2**50)
stored_names = st.sampled_from(["agent", "chat", "+agent", "+chat"])


@given(
    current=st.none() | st.tuples(expiries, stored_names), cand=st.tuples(expiries, stored_names)
)
def test_merge_keeps_the_later_expiry_and_any_pin(
    current: tuple[int, str] | None, cand: tuple[int, str]
) -> None:
    expiry, stored = decide.merge(current, cand)
    assert expiry == max(cand[0], current[0] if current else 0)
    pinned = decide.split_stored(stored)[1]
    assert pinned == (decide.split_stored(cand[1])[1] or bool(current and current[1][0] == "+"))
    winner = cand if current is None or cand[0] > current[0] else current
    assert decide.split_stored(stored)[0] == decide.split_stored(winner[1])[0]


@given(
    expiry=expiries,
    now=expiries,
    ttl=st.integers(1, 10**7),
    resolution=st.integers(1, 10**6),
    stored=stored_names,
)
def test_a_slide_never_shortens_and_is_written_only_past_the_resolution(
    expiry: int, now: int, ttl: int, resolution: int, stored: str
) -> None:
    hit = decide.Applied(traffic_class="agent", ttl_s=ttl, pin=False)
    moved = decide.slide(
        expiry_ms=expiry, stored=stored, hit=hit, now_ms=now, resolution_ms=resolution
    )
    candidate = decide.write_expiry(now, ttl)
    assert candidate >= now + ttl * 1000 and candidate % decide.EXPIRY_QUANTUM_MS == 0
    if candidate - expiry < resolution:
        assert moved is None
    else:
        assert moved is not None and moved[0] == candidate > expiry
        assert moved[1] == ("+agent" if stored.startswith("+") else "agent")


@given(now=expiries, ttl=st.integers(0, 10**7), later=st.integers(0, 10**6))
def test_a_write_expiry_is_the_next_whole_second_and_keeps_the_order_of_writes(
    now: int, ttl: int, later: int
) -> None:
    q = decide.EXPIRY_QUANTUM_MS
    expiry = decide.write_expiry(now, ttl)
    assert expiry % q == 0 and 0 <= expiry - (now + ttl * 1000) < q  # never shorter than asked
    assert decide.write_expiry(now + later, ttl) >= expiry
    # The daemons' quiet bound, taken at now 0 and added to a later now, is never too low.
    policy = RetentionPolicy(classes={"c": max(1, ttl)}, default_class="c")
    bound = now + decide.quiet_above(policy, 0, 60_000, reach_s=max(1, ttl))
    assert bound >= decide.write_expiry(now, max(1, ttl)) - 60_000


@given(ttl=st.integers(1, 10**9), name=st.sampled_from(["agent", "chat", "nope", ""]))
def test_clamp_keeps_a_ttl_within_its_class_bounds(ttl: int, name: str) -> None:
    applied = clamp(POLICY, name, ttl_s=ttl)
    low, high = POLICY.bounds_of(name)
    assert low <= applied.ttl_s <= high
    assert (applied.clamped is None) == (low <= ttl <= high and name != "nope")
    assert applied.traffic_class == POLICY.resolve(name)


def test_default_bounds_let_a_hint_shorten_but_not_lengthen() -> None:
    assert POLICY.bounds_of("agent") == (60, 3 * 86400)
    assert clamp(POLICY, "agent", ttl_s=600).ttl_s == 600
    assert clamp(POLICY, "agent", ttl_s=10 * 86400).ttl_s == 3 * 86400
    assert clamp(POLICY, "chat", ttl_s=10 * 86400).ttl_s == 10 * 86400  # admin widened chat
    assert clamp(POLICY, "chat", ttl_s=60).ttl_s == 3600
    assert clamp(POLICY, "agent").ttl_s == 3 * 86400


def test_a_pin_past_the_quota_is_dropped_and_said_so() -> None:
    assert clamp(POLICY, "chat", pin=True).pin
    dropped = clamp(POLICY, "chat", pin=True, pin_room=False)
    assert not dropped.pin and "pin quota" in (dropped.clamped or "")


def test_write_action_is_the_racing_writer_rule() -> None:
    base = {
        "stored_stripe": 5,
        "stored_written_ms": 1000,
        "now_ms": 20_000,
        "replace_after_ms": 10_000,
    }
    assert write_action(stored_expiry_ms=None, stripe=6, expect=0, **base) is WriteAction.FRESH
    assert write_action(stored_expiry_ms=20_000, stripe=6, expect=0, **base) is WriteAction.FRESH
    assert write_action(stored_expiry_ms=30_000, stripe=5, expect=0, **base) is WriteAction.REPEAT
    assert write_action(stored_expiry_ms=30_000, stripe=6, expect=5, **base) is WriteAction.REPLACE
    assert write_action(stored_expiry_ms=30_000, stripe=6, expect=0, **base) is WriteAction.CONFLICT
    young = {**base, "stored_written_ms": 15_000}
    assert (
        write_action(stored_expiry_ms=30_000, stripe=6, expect=5, **young) is WriteAction.CONFLICT
    )


def test_pinned_shards_are_not_evictable() -> None:
    assert decide.stored_class("chat", True) == "+chat"
    assert decide.split_stored("+chat") == ("chat", True)
    assert not decide.evictable("+chat") and decide.evictable("chat")


def test_hints_from_requests() -> None:
    assert Hint.from_mapping(None) is NO_HINT
    assert Hint.from_mapping({}) == NO_HINT and NO_HINT.is_default
    h = Hint.from_mapping({"traffic_class": "agent", "ttl": "90m", "pin": True})
    assert (h.traffic_class, h.ttl_s, h.pin, h.store) == ("agent", 5400, True, True)
    assert Hint.from_mapping({"store": False}).store is False
    assert Hint.from_mapping({"ttl": 120}).with_default_class("chat").traffic_class == "chat"
    for bad, what in [
        ({"trafic_class": "chat"}, "unknown field"),
        ({"traffic_class": "Chat!"}, "traffic_class"),
        ({"ttl": "soon"}, "ttl"),
        ({"ttl": 0}, "ttl"),
        ({"pin": "yes"}, "pin"),
        ("chat", "object"),
    ]:
        with pytest.raises(ArgumentError, match=what):
            Hint.from_mapping(bad)


def test_policy_bounds_round_trip_and_are_checked() -> None:
    policy = RetentionPolicy.from_mapping(
        {"classes": "agent=3d,chat=7d,default=3d", "ttl_bounds": "chat=1h..14d"}
    )
    assert policy.bounds_of("chat") == (3600, 14 * 86400)
    assert RetentionPolicy.from_mapping(policy.to_dict()) == policy
    assert policy.max_ttl_s == 14 * 86400
    with pytest.raises(ConfigError, match="not one of the classes"):
        RetentionPolicy.from_mapping({"classes": "agent=3d", "ttl_bounds": "chat=1h..2h"})
    with pytest.raises(ConfigError, match="min <= max"):
        RetentionPolicy.from_mapping({"classes": "agent=3d", "ttl_bounds": "agent=2h..1h"})


def test_the_touch_flusher_runs_on_its_injected_clock(tmp_path: Path) -> None:
    tenant = tenant_id("default")
    wall, mono = FakeClock(), FakeClock(100.0)
    with ShardStore(tmp_path / "db", capacity_bytes=64 << 20, clock=wall, monotonic=mono,
                    touch_flush_s=5.0) as store:  # fmt: skip
        shards = block_records(b"k" * 16, indices=[0])
        items, data = put_items(shards)
        store.put(tenant, items, data)  # type: ignore[arg-type]
        wall.step(3600)
        store.get(tenant, get_items([(b"k" * 16, 0)]), "chat").release()  # type: ignore[arg-type]
        store.maintain()
        assert store.counters["touches_written"] == 0  # due at mono 105
        mono.step(5)
        store.maintain()
        assert store.counters["touches_written"] == 1


@given(
    expiry=expiries,
    now=expiries,
    ttl=st.integers(1, 10**7),
    resolution=st.integers(1, 10**6),
    stored=stored_names,
    pin=st.booleans(),
)
def test_slide_is_the_merge_of_the_hit_written_when_worth_it(
    expiry: int, now: int, ttl: int, resolution: int, stored: str, pin: bool
) -> None:
    hit = decide.Applied(traffic_class="chat", ttl_s=ttl, pin=pin)
    moved = decide.slide(
        expiry_ms=expiry, stored=stored, hit=hit, now_ms=now, resolution_ms=resolution
    )
    candidate = (decide.write_expiry(now, ttl), decide.stored_class("chat", pin))
    new_pin = pin and not stored.startswith("+")
    if candidate[0] - expiry < resolution and not new_pin:
        assert moved is None
    else:
        assert moved == decide.merge((expiry, stored), candidate)
