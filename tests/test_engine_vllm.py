"""End to end: kvcache's vLLM connector inside a real vLLM engine on the CPU.

The tier builds (or reuses) the vLLM venv with ``scripts/vllm-venv.sh``, makes
a tiny random-weight Llama, starts a local 12-node cluster and runs the engine
five times, each in a fresh process (``tests/vllm_e2e/run_engine.py``), one
prompt per ``generate`` call, greedy:

1. no connector: the reference tokens of prompts P1, P2 and P3;
2. with the connector on an empty cluster, P1 and P3: nothing to load, their
   full prompt blocks are stored, the output is unchanged;
3. then three shards of P3's second block are damaged beyond repair, and a
   new engine (asynchronous loads, the default) runs P1, P2 (sharing P1's
   first two blocks only) and P3;
4. synchronous loads (``load_mode = "sync"``), P1 and P3;
5. a store predicted slower than recomputing (``load_gbps`` tiny), P1.

Run 3 must load P1's blocks instead of computing them while the request waits
in WAITING_FOR_REMOTE_KVS (the connector's counters and vLLM's own
cached-token count agree), load only the shared blocks of P2, and for P3 load
the first block, report the damaged one and everything after it as failed,
recompute them, and still produce exactly the reference tokens. The failed
load also drops the broken stripe and the recomputed blocks are stored again,
so run 4 loads all of P3, before the forward pass. Run 5 declines every hit
(fetch or recompute) and computes everything. Every engine process runs with
VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1: vLLM must never send
usage statistics.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm_e2e.damage import damage_block
from vllm_e2e.harness import E2E, EngineRun, build_vllm_python
from vllm_e2e.harness import run as run_cmd
from vllm_e2e.harness import run_engine as _run_engine

from kvcache.client import Client
from kvcache.engine.vllm_meta import namespace_from_dict
from kvcache.keys import Namespace, block_keys
from kvcache.testing.localcluster import LocalCluster

# Building the vLLM venv (first run only, ~2 min) and three engine processes take a while.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

BLOCK = 32
MAX_TOKENS = 16

rng = random.Random(20261130)
P1 = [rng.randrange(3, 1024) for _ in range(100)]  # 3 full blocks, 3 loadable
P2 = P1[: 2 * BLOCK] + [rng.randrange(3, 1024) for _ in range(60)]  # shares 2 blocks with P1
P3 = [rng.randrange(3, 1024) for _ in range(160)]  # 5 full blocks, 4 loadable
DAMAGED_BLOCK = 1


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    """The vLLM venv's python, built by scripts/vllm-venv.sh if it is not there yet."""
    return build_vllm_python()


@pytest.fixture(scope="module")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama and its tokenizer, built offline."""
    out = tmp_path_factory.mktemp("tiny-llama")
    run_cmd([str(vllm_python), str(E2E / "make_model.py"), str(out)], out / "build.log", 300)
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A fresh 12-node cluster for this module (its blocks get damaged)."""
    c = LocalCluster(tmp_path_factory.mktemp("vllm-cluster"))
    c.start(nodes=12, capacity="256MiB")
    yield c
    c.stop()


def run_engine(
    python: Path,
    model: Path,
    workdir: Path,
    name: str,
    prompts: dict[str, list[int]],
    cluster: LocalCluster | None,
    **settings: Any,
) -> EngineRun:
    """One engine process over ``prompts`` (one generate call each), with or without the
    connector; ``settings`` are added to the connector's extra config."""
    return _run_engine(
        python, model, workdir, name, prompts, cluster, max_tokens=MAX_TOKENS, **settings
    )


@dataclass
class Scenario:
    baseline: EngineRun
    first: EngineRun
    second: EngineRun
    sync: EngineRun
    recompute: EngineRun
    namespace: Namespace
    damaged_shards: list[int]
    hit_after_damage: int
    loaded_after_damage: int


@pytest.fixture(scope="module")
def scenario(
    vllm_python: Path,
    tiny_model: Path,
    cluster: LocalCluster,
    tmp_path_factory: pytest.TempPathFactory,
) -> Scenario:
    work = tmp_path_factory.mktemp("vllm-runs")
    prompts = {"p1": P1, "p2": P2, "p3": P3}
    baseline = run_engine(vllm_python, tiny_model, work, "baseline", prompts, None)
    first = run_engine(vllm_python, tiny_model, work, "first", {"p1": P1, "p3": P3}, cluster)
    ns = namespace_from_dict(first.final["worker"]["namespace"])
    key = block_keys(ns, P3)[DAMAGED_BLOCK]
    damaged = damage_block(cluster, key)
    # The damage is what the test claims: the block still matches, but cannot be loaded.
    with Client(cluster.client_config(timeout_s=5.0, read_repair=False)) as client:
        match = client.match_prefix(ns, P3)
        loaded = client.load(ns, match).blocks
    second = run_engine(vllm_python, tiny_model, work, "second", prompts, cluster)
    sync = run_engine(
        vllm_python, tiny_model, work, "sync", {"p1": P1, "p3": P3}, cluster, load_mode="sync"
    )
    recompute = run_engine(
        vllm_python,
        tiny_model,
        work,
        "recompute",
        {"p1": P1},
        cluster,
        load_gbps=1e-6,
        prefill_tokens_per_s=1000.0,
    )
    return Scenario(baseline, first, second, sync, recompute, ns, damaged, match.hit_blocks, loaded)


def test_connector_namespace_covers_model_layout_and_rank(scenario: Scenario) -> None:
    ns = scenario.namespace
    assert ns.layout.tokens_per_block == BLOCK
    assert ns.layout.dtype.value == "float32"
    assert ns.layout.layers_in_block == 2
    # 2 layers x (2 heads x 32 tokens x (32 K + 32 V) x 4 bytes) per block.
    assert ns.layout.payload_bytes == 2 * 2 * BLOCK * 64 * 4
    assert ns.parallel == "tp0of1"
    assert "layout=LBHNC" in ns.revision and "engine=vllm" in ns.revision
    # Scheduler and worker halves, in different processes, agree on every key.
    for run in (scenario.first, scenario.second):
        assert run.final["scheduler"]["namespace"] == run.final["worker"]["namespace"]


def test_first_run_stores_prompt_blocks_and_changes_nothing(scenario: Scenario) -> None:
    first, baseline = scenario.first, scenario.baseline
    for phase in ("p1", "p3"):
        assert first.tokens(phase) == baseline.tokens(phase)
        assert first.delta(phase, "scheduler")["tokens_matched"] == 0
        assert first.delta(phase, "worker")["blocks_loaded"] == 0
    worker = first.final["worker"]
    assert worker["blocks_saved"] == len(P1) // BLOCK + len(P3) // BLOCK
    assert worker["blocks_save_failed"] == 0
    assert worker["blocks_save_dropped"] == 0


def test_second_run_loads_instead_of_recomputing(scenario: Scenario) -> None:
    run = scenario.second
    loadable = (len(P1) - 1) // BLOCK * BLOCK
    assert run.tokens("p1") == scenario.baseline.tokens("p1")
    assert run.delta("p1", "scheduler")["tokens_matched"] == loadable
    worker = run.delta("p1", "worker")
    assert worker["tokens_loaded"] == loadable
    assert worker["blocks_loaded"] == loadable // BLOCK
    assert worker["load_error_blocks"] == 0
    # The load ran in the background while the request waited for it.
    assert worker["async_loads"] == 1
    assert run.delta("p1", "scheduler")["fetch_decisions"] == 1
    # The worker's load measurements reached the scheduler's fetch-or-recompute planner.
    assert run.final["scheduler"]["load_gbps_estimate"] > 0
    # vLLM's own count: these prompt tokens were not computed.
    assert run.phases["p1"]["num_cached_tokens"] == [loadable]


def test_shared_prefix_loads_only_the_shared_blocks(scenario: Scenario) -> None:
    run = scenario.second
    assert run.tokens("p2") == scenario.baseline.tokens("p2")
    assert run.delta("p2", "scheduler")["tokens_matched"] == 2 * BLOCK
    worker = run.delta("p2", "worker")
    assert worker["blocks_loaded"] == 2
    assert worker["load_error_blocks"] == 0
    assert run.phases["p2"]["num_cached_tokens"] == [2 * BLOCK]
    # The block after the shared prefix was computed here and stored.
    assert run.final["worker"]["blocks_saved"] >= 1


def test_damaged_block_is_recomputed_with_identical_output(scenario: Scenario) -> None:
    # The damage is real: every stored block still matches, but the load stops before it.
    assert len(scenario.damaged_shards) == 3
    assert scenario.hit_after_damage == len(P3) // BLOCK
    assert scenario.loaded_after_damage == DAMAGED_BLOCK
    run = scenario.second
    assert run.tokens("p3") == scenario.baseline.tokens("p3")
    loadable = (len(P3) - 1) // BLOCK
    assert run.delta("p3", "scheduler")["tokens_matched"] == loadable * BLOCK
    worker = run.delta("p3", "worker")
    assert worker["blocks_loaded"] == DAMAGED_BLOCK
    # The damaged block and every block after it go back to vLLM for recomputation.
    assert worker["load_error_blocks"] == loadable - DAMAGED_BLOCK
    assert worker["load_failed_requests"] == 1
    # An asynchronous load fails before anything is computed over it: nothing to withhold
    # (the recomputed blocks are stored; run 4 loads them).
    assert worker["saves_skipped"] == 0


def test_synchronous_loads_and_the_healed_block(scenario: Scenario) -> None:
    run = scenario.sync
    for phase, prompt in (("p1", P1), ("p3", P3)):
        loadable = (len(prompt) - 1) // BLOCK * BLOCK
        assert run.tokens(phase) == scenario.baseline.tokens(phase)
        worker = run.delta(phase, "worker")
        # Run 3 dropped P3's broken stripe and stored the recomputed block: all of P3 loads.
        assert worker["tokens_loaded"] == loadable, phase
        assert worker["load_error_blocks"] == 0
        assert worker["async_loads"] == 0
        assert run.phases[phase]["num_cached_tokens"] == [loadable]


def test_a_store_slower_than_recompute_is_not_waited_for(scenario: Scenario) -> None:
    run = scenario.recompute
    assert run.tokens("p1") == scenario.baseline.tokens("p1")
    scheduler = run.delta("p1", "scheduler")
    assert scheduler["recompute_decisions"] == 1 and scheduler["fetch_decisions"] == 0
    assert scheduler["tokens_recompute_chosen"] == (len(P1) - 1) // BLOCK * BLOCK
    assert scheduler["tokens_matched"] == 0
    assert run.delta("p1", "worker")["blocks_loaded"] == 0
    assert run.phases["p1"]["num_cached_tokens"] == [0]
