"""End to end: a hybrid model (sliding-window and full attention) in real vLLM on the CPU,
its window state taken on one engine process and loaded by another.

The model is a tiny random-weight Gemma3 (``tests/vllm_e2e/make_hybrid_model.py``:
six layers, ``[sliding, sliding, full, sliding, sliding, full]``, a 64-token
window, 32-token blocks). vLLM 0.32 keeps its hybrid KV-cache manager on
because the connector supports it (``SupportsHMA``): two sliding-window groups
and one full-attention group. Four engine processes, greedy:

1. no connector: the reference tokens of P1, C1 = P1 + 60 tokens, P2 and
   C2 = P2 + 60 tokens (P1 and P2 are 150 tokens: four full blocks);
2. engine A runs P1: its full-attention blocks go to the cluster, the
   sliding-window state at token 128 (the end of P1's last full block) stays
   in A's RAM and is registered in the directory; A stays up;
3. engine B, another process, runs C1: its lookup finds P1's blocks and A as
   the state's holder, fetches the state from A over TCP and fills both
   sliding-window groups with it, computes only tokens 128.. and produces the
   reference tokens. B also runs P2 with a 50 ms TTL: its state expires at once
   (C starts seconds later, whatever the machine's speed);
4. A stops without withdrawing its records (as a dead worker would leave
   them; A's TTL is an hour, so they are still there), and engine C runs C1 and C2. For C1 the directory still names A: the
   fetch fails, the whole request is recomputed, the output is unchanged. For
   C2 the state expired: only the prefix that can be served exactly is
   offered, which is none of it, and the output is unchanged.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from vllm_e2e.harness import E2E, EngineRun, HeldEngine, build_vllm_python, run, run_engine

from kvcache.engine.vllm_meta import namespace_from_dict
from kvcache.keys import block_keys
from kvcache.testing.localcluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

BLOCK = 32
MAX_TOKENS = 16
STATE_AT = 128  # P1's and P2's last full block ends here

rng = random.Random(20270112)
P1 = [rng.randrange(3, 1024) for _ in range(150)]
C1 = P1 + [rng.randrange(3, 1024) for _ in range(60)]
P2 = [rng.randrange(3, 1024) for _ in range(150)]
C2 = P2 + [rng.randrange(3, 1024) for _ in range(60)]


@dataclass
class Runs:
    baseline: EngineRun
    a: EngineRun
    b: EngineRun
    c: EngineRun
    #: vLLM's KV events of engine b (kv_events_config on), as run_engine.py decoded them.
    b_events: list[dict[str, Any]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    python = build_vllm_python()
    work = tmp_path_factory.mktemp("hybrid-runs")
    model = work / "tiny-gemma3"
    run([str(python), str(E2E / "make_hybrid_model.py"), str(model)], work / "build.log", 300)
    cluster = LocalCluster(work / "cluster")
    cluster.start(nodes=12, capacity="256MiB")
    held: HeldEngine | None = None
    try:

        def engine(name: str, prompts: dict[str, list[int]], **settings: object) -> EngineRun:
            return run_engine(
                python, model, work, name, prompts, cluster, max_tokens=MAX_TOKENS, **settings
            )

        baseline = run_engine(
            python,
            model,
            work,
            "baseline",
            {"p1": P1, "c1": C1, "p2": P2, "c2": C2},
            None,
            max_tokens=MAX_TOKENS,
        )
        held = HeldEngine(
            python,
            model,
            work,
            "a",
            {"p1": P1},
            cluster,
            max_tokens=MAX_TOKENS,
            swa_withdraw_on_close=False,
            # Long enough to outlive the test on a slow machine: C must still find the record.
            swa_ttl_s=3600,
        )
        b = engine("b", {"c1": C1, "p2": P2}, swa_ttl_s=0.05, kv_events=True)
        a = held.release()
        held = None
        c = engine("c", {"c1": C1, "c2": C2})
        yield Runs(baseline, a, b, c, json.loads((work / "b-out.json").read_text())["kv_events"])
    finally:
        if held is not None:
            held.kill()
        cluster.stop()


def test_hybrid_model_keeps_its_groups_and_takes_its_state(runs: Runs) -> None:
    a = runs.a
    assert a.tokens("p1") == runs.baseline.tokens("p1")
    worker = a.delta("p1", "worker")
    # Only the full-attention group's blocks go to the store: 150 tokens, 4 full blocks.
    assert worker["blocks_saved"] == len(P1) // BLOCK
    assert worker["swa_states_saved"] == 1
    # 2 sliding-window groups x 2 layers x 2 window blocks x 8 KiB pages.
    assert worker["swa_state_bytes_saved"] == 2 * 2 * 2 * 8192
    ns = a.final["worker"]["namespace"]
    assert ns["layout"]["layers_in_block"] == 2  # the full-attention layers only
    assert a.final["scheduler"]["namespace"] == ns


def test_state_from_another_engine_process_gives_identical_output(runs: Runs) -> None:
    b = runs.b
    assert b.tokens("c1") == runs.baseline.tokens("c1")
    scheduler, worker = b.delta("c1", "scheduler"), b.delta("c1", "worker")
    assert scheduler["swa_hits"] == 1
    assert scheduler["tokens_matched"] == STATE_AT
    assert worker["swa_remote_hits"] == 1 and worker["swa_local_hits"] == 0
    assert worker["tokens_loaded"] == STATE_AT
    assert worker["load_error_blocks"] == 0 and worker["swa_misses"] == 0
    # vLLM's own count: the first 128 prompt tokens were not computed here.
    assert b.phases["c1"]["num_cached_tokens"] == [STATE_AT]


def test_a_gone_holder_falls_back_to_recompute_with_identical_output(runs: Runs) -> None:
    c = runs.c
    assert c.tokens("c1") == runs.baseline.tokens("c1")
    scheduler, worker = c.delta("c1", "scheduler"), c.delta("c1", "worker")
    # The directory still named A, whose endpoint is closed: offered, then a clean miss.
    assert scheduler["swa_hits"] == 1
    assert worker["swa_misses"] == 1 and worker["swa_remote_hits"] == 0
    assert worker["load_failed_requests"] == 1
    assert worker["tokens_loaded"] == 0


def test_an_expired_state_offers_nothing_and_output_is_identical(runs: Runs) -> None:
    c = runs.c
    assert runs.b.tokens("p2") == runs.baseline.tokens("p2")
    assert c.tokens("c2") == runs.baseline.tokens("c2")
    scheduler, worker = c.delta("c2", "scheduler"), c.delta("c2", "worker")
    # P2's blocks are stored, but the state after them expired: nothing can be served exactly.
    assert scheduler["swa_tokens_without_state"] == len(P2) // BLOCK * BLOCK
    assert scheduler["tokens_matched"] == 0 and scheduler["swa_hits"] == 0
    assert worker["blocks_loaded"] == 0
    assert c.phases["c2"]["num_cached_tokens"] == [0]


def test_held_states_and_stored_blocks_reach_vllms_publisher(runs: Runs) -> None:
    """Engine b ran with vLLM's KV events on: its stores and loads arrive as STORAGE events of
    the full-attention group, each state it holds as one CPU event per sliding-window group,
    with that group's index and window (docs/engine.md, "KV events")."""
    ns = runs.b.final["worker"]["namespace"]
    keys = {k.hex() for k in block_keys(namespace_from_dict(ns), C1)}
    storage = [e for e in runs.b_events if e["medium"] == "STORAGE"]
    held = [e for e in runs.b_events if e["medium"] == "CPU"]
    assert storage and {e["kv_cache_spec_kind"] for e in storage} == {"full_attention"}
    assert {e["locality"] for e in storage} == {"REMOTE"}
    assert set(storage[0]["block_hashes"]) <= keys  # c1's blocks, loaded from the store
    assert held, runs.b_events
    assert {e["kv_cache_spec_kind"] for e in held} == {"sliding_window"}
    assert {e["kv_cache_spec_sliding_window"] for e in held} == {64}
    assert {e["locality"] for e in held} == {"LOCAL"}
    full = storage[0]["group_idx"]
    swa_groups = {e["group_idx"] for e in held}
    assert len(swa_groups) == 2 and full not in swa_groups
    for e in held:
        assert len(e["block_hashes"]) == 1 and e["ownership"] == "kvcache"
