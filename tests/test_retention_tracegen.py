"""The multi-day trace generator: deterministic, in time order, prefix-chained, multi-day,
and the CLI commands around it (generate, simulate with a capacity, plan's errors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcache.errors import ConfigError
from kvcache.retention.cli import main
from kvcache.retention.tracegen import TraceModel, generate_trace
from kvcache.workload import TRACE_BLOCK_TOKENS, read_trace

SMALL = TraceModel(days=3, seed=2, agent_rate=2, chat_rate=3)


def test_a_trace_is_seeded_ordered_and_spans_days() -> None:
    first, again = list(generate_trace(SMALL)), list(generate_trace(SMALL))
    assert first == again and first != list(generate_trace(TraceModel(days=3, seed=3)))
    times = [r.timestamp_ms for r in first]
    assert times == sorted(times) and times[-1] - times[0] > 2 * 86_400_000
    assert {r.traffic_class for r in first} == {"agent", "chat"}
    for r in first:
        assert r.full_blocks == len(r.hash_ids) - 1 and r.input_length % TRACE_BLOCK_TOKENS


def test_block_ids_name_their_prefix() -> None:
    # Equal ids at a position mean equal ids before it: Mooncake's chained hash ids.
    seen: dict[int, tuple[int, ...]] = {}
    for r in generate_trace(SMALL):
        for i, block in enumerate(r.hash_ids[: r.full_blocks]):
            prefix = r.hash_ids[:i]
            assert seen.setdefault(block, prefix) == prefix


def test_sessions_come_back_after_days() -> None:
    by_id: dict[int, list[int]] = {}
    for r in generate_trace(TraceModel(days=6, seed=4)):
        if r.traffic_class == "chat" and r.full_blocks > 4:
            by_id.setdefault(r.hash_ids[4], []).append(r.timestamp_ms)  # a session's own block
    gaps = [max(t) - min(t) for t in by_id.values()]
    assert any(g > 3 * 86_400_000 for g in gaps)  # what a 7-day chat TTL keeps


def test_bad_models_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="chat_return"):
        TraceModel(chat_return=1.5)
    with pytest.raises(ConfigError, match="days"):
        TraceModel(days=0)


def test_generate_simulate_with_a_capacity_and_plan_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t.jsonl"
    assert main(["generate", "--days", "1", "--seed", "9", "--out", str(out)]) == 0
    n = len(list(read_trace(out)))
    assert f"{n} requests" in capsys.readouterr().out
    args = ["simulate", "--trace", str(out), "--classes", "agent=3d,chat=7d", "--json"]
    assert main(args) == 0
    unbounded = json.loads(capsys.readouterr().out)["results"][0]
    assert unbounded["evicted_before_ttl"] == 0
    assert main([*args, "--capacity-blocks", str(unbounded["peak_blocks"] // 2)]) == 0
    bounded = json.loads(capsys.readouterr().out)["results"][0]
    assert bounded["evicted_before_ttl"] > 0 and bounded["hit_rate"] <= unbounded["hit_rate"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["plan", "--trace", str(empty)]) == 1
    assert "holds no requests" in capsys.readouterr().err
