"""Node health and latency bookkeeping with a stepped clock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.client.health import LatencyTracker, NodeHealth


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_down_node_is_skipped_until_retry() -> None:
    clock = Clock()
    health = NodeHealth(retry_s=5.0, clock=clock)
    assert health.is_up("a")
    health.mark_down("a", "timeout")
    assert not health.is_up("a") and health.down_nodes() == ["a"]
    clock.now += 4.9
    assert not health.is_up("a")
    clock.now += 0.2
    assert health.is_up("a")  # its retry time came: normal traffic probes it
    health.mark_up("a")
    assert health.down_nodes() == []


def test_down_for_counts_from_the_first_mark_until_the_node_answers() -> None:
    clock = Clock()
    health = NodeHealth(retry_s=5.0, clock=clock)
    assert health.down_for("a") is None
    health.mark_down("a", "timeout")
    clock.now += 7.0
    health.mark_down("a", "its probe failed too")  # a failed probe does not restart it
    clock.now += 3.0
    assert health.down_for("a") == 10.0
    health.mark_up("a")
    assert health.down_for("a") is None


def test_early_probes_are_rate_limited() -> None:
    clock = Clock()
    health = NodeHealth(retry_s=60.0, clock=clock, probe_every_s=1.0)
    health.mark_down("a", "refused")
    assert health.may_probe("a")
    assert not health.may_probe("a")
    clock.now += 1.01
    assert health.may_probe("a")


def test_hedge_deadline_follows_recent_latency() -> None:
    tracker = LatencyTracker(floor_s=0.002, ceiling_s=0.25)
    assert tracker.hedge_after() == 0.05  # no history yet: a fifth of the ceiling
    for _ in range(50):
        tracker.record(0.004)
    assert tracker.hedge_after() == 0.008
    for _ in range(256):
        tracker.record(1.0)
    assert tracker.hedge_after() == 0.25
    for _ in range(256):
        tracker.record(0.0001)
    assert tracker.hedge_after() == 0.002


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["down", "up", "wait"]), st.sampled_from("abcd"),
                  st.floats(0.0, 4.0)),
        max_size=20,
    )
)  # fmt: skip
def test_skipped_and_down_since_say_what_each_node_says(
    steps: list[tuple[str, str, float]],
) -> None:
    """The whole-cluster answers a call's masks use (one clock reading) agree with the
    per-node ones, through any sequence of marks and waits."""
    clock = Clock()
    health = NodeHealth(retry_s=2.5, clock=clock)
    for what, node, secs in steps:
        if what == "down":
            health.mark_down(node, "test")
        elif what == "up":
            health.mark_up(node)
        else:
            clock.now += secs
        assert health.skipped() == {n for n in "abcd" if not health.is_up(n)}
        since = health.down_since()
        assert since == {n: t for n in "abcd" if (t := health.down_for(n)) is not None}
