"""The vLLM connector's event reports (kvcache.engine.vllm_events), without vLLM."""

from __future__ import annotations

from kvcache.engine.vllm_events import EngineEvents, GroupSpec

FULL = GroupSpec(0, "full_attention", None, 4)


def test_blocks_become_runs_without_the_failed_ones() -> None:
    events = EngineEvents()
    keys = [bytes([n]) * 16 for n in range(6)]
    tokens = list(range(24))
    events.blocks(keys, tokens, first_block=1, count=4, block_size=4, group=FULL, skip=[3],
                  session_id="r1")  # fmt: skip
    first, second = events.take()
    assert first.block_hashes == (keys[1], keys[2]) and first.parent_block_hash == keys[0]
    assert first.token_ids == tuple(range(4, 12))
    assert second.block_hashes == (keys[4],) and second.parent_block_hash == keys[3]
    assert second.token_ids == tuple(range(16, 20))
    assert {r.medium for r in (first, second)} == {"STORAGE"}
    assert first.locality == "REMOTE" and first.session_id == "r1" and first.group == FULL
    assert events.take() == []


def test_a_state_is_reported_once_per_sliding_window_group() -> None:
    events = EngineEvents()
    groups = [GroupSpec(1, "sliding_window", 64, 32), GroupSpec(2, "sliding_window", 64, 32)]
    events.state(b"k" * 16, b"p" * 16, groups, session_id="r2")
    reports = events.take()
    assert [(r.group.group_idx, r.group.sliding_window, r.medium, r.locality) for r in reports] == [
        (1, 64, "CPU", "LOCAL"), (2, 64, "CPU", "LOCAL")]  # fmt: skip
    assert all(r.block_hashes == (b"k" * 16,) and r.parent_block_hash == b"p" * 16 for r in reports)


def test_a_stalled_engine_loses_the_oldest_reports_counted() -> None:
    events = EngineEvents(max_reports=2)
    for n in range(3):
        events.state(bytes([n]) * 16, None, [FULL])
    assert [r.block_hashes[0][0] for r in events.take()] == [1, 2]
    assert events.dropped == 1
