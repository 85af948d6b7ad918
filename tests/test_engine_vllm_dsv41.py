"""DeepSeek V4.1 Flash's KV cache through vLLM 0.32's real scheduler and kvcache's connector.

``tests/vllm_e2e/dsv41.py`` (in the vLLM venv) says what is vLLM's own and what is not:
vLLM's config, spec classes, grouping, allocation, scheduler and requests are real; V4.1's
model is not (no forward pass runs on the CPU build), so its per-layer specs are built
with V4.1's parameters. Against a real local cluster, per format (SM100 nvfp4 MLA +
MXFP4 indexer; SM90 584-byte records in 64-token blocks):

- ``held``: a 1,000-token prompt stored by engine A, whose state A holds: B loads it with
  the window, vLLM replays nothing (``replay_start == 0``, every stored token computed);
- ``lost``: the state withdrawn: B offers the MLA hit without claiming the window and vLLM
  replays exactly one window (128 tokens) of it;
- ``short``: a 150-token prompt (a 128-token hit) without a state: not offered, nothing used;
- ``failed``: the directory names a holder that is gone: B claims the window, the fetch
  fails, and vLLM recomputes the request from token 0;
- bytes: every MLA block of ``held``, the 4 window blocks of every SWA group and the ring
  block are byte-identical in B (at other block ids) and in A;
- the store holds the MLA group only: 896 bytes per token on SM100.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vllm_e2e.harness import E2E, build_vllm_python, run

from kvcache.testing.localcluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

WINDOW = 128


@pytest.fixture(scope="module", params=["sm100", "sm90"])
def result(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    python = build_vllm_python()
    work = tmp_path_factory.mktemp(f"dsv41-{request.param}")
    cluster = LocalCluster(work / "cluster")
    cluster.start(nodes=12, capacity="256MiB")
    try:
        spec = work / "spec.json"
        spec.write_text(
            json.dumps(
                {
                    "cluster_file": str(cluster.cluster_file),
                    "credentials_file": str(cluster.credentials_file),
                    "format": request.param,
                }
            )
        )
        out = work / "out.json"
        run([str(python), str(E2E / "dsv41.py"), str(spec), str(out)], work / "dsv41.log", 900)
        return json.loads(Path(out).read_text())
    finally:
        cluster.stop()


def block(result: Any) -> int:
    return 128 if result["format"] == "sm100" else 64


def hit(result: Any) -> int:
    return 1000 // block(result) * block(result)


def test_v41_groups_start_the_connector_with_the_mla_group_in_the_store(result: Any) -> None:
    geo = result["geometry"]
    groups = geo["groups"]
    assert groups.count("UniformTypeKVCacheSpecs") == len(groups)  # vLLM's worker-side view
    assert geo["group_block_sizes"].count(32) == 7 and 8 in geo["group_block_sizes"]
    if result["format"] == "sm100":
        assert geo["payload_bytes"] == 114_688 and geo["bytes_per_token"] == 896
        assert geo["state_bytes"] == 2_703_360 + 98_304
    else:
        assert geo["payload_bytes"] % 64 == 0 and geo["bytes_per_token"] != 896
    assert "BLHNC" in geo["namespace"]["revision"] or "pages=" in geo["namespace"]["revision"]
    # Stored bytes per cached token are the MLA group's only.
    a = result["a"]["stats"]["worker"]
    assert a["blocks_saved"] == 1000 // block(result)
    assert a["swa_states_saved"] == 1


def test_held_state_restores_the_window_and_nothing_is_replayed(result: Any) -> None:
    held = result["held"]
    assert held["claimed"]
    assert held["replay_start"] == 0
    assert held["num_computed_tokens"] == hit(result)


def test_lost_state_means_exactly_one_window_replayed_and_no_claim(result: Any) -> None:
    lost = result["lost"]
    assert not lost["claimed"]
    assert lost["num_computed_tokens"] == hit(result) - WINDOW
    assert lost["replay_start"] == hit(result) - WINDOW


def test_short_hit_without_state_is_not_used(result: Any) -> None:
    short = result["short"]
    assert not short["claimed"]
    assert short["num_computed_tokens"] == 0


def test_claimed_window_whose_load_fails_is_recomputed_whole(result: Any) -> None:
    failed = result["failed"]
    assert failed["claimed"]
    assert failed["num_computed_tokens"] == 0
    sched = result["b"]["stats"]["scheduler"]
    assert sched["swa_state_restores"] == 2  # held, failed
    assert sched["swa_bounded_replays"] == 1  # lost
    assert sched["swa_full_recomputes"] == 1  # failed
    # The same counters on vLLM's Prometheus /metrics, through vLLM's connector-stats path
    # (Scheduler.make_stats -> KVConnectorProm -> KVCachePromMetrics).
    metrics = result["b"]["metrics"]
    assert metrics["swa_state_restores"] == 2
    assert metrics["swa_bounded_replays"] == 1
    assert metrics["swa_full_recomputes"] == 1
    assert metrics["lookups"] == sched["lookups"] > 0


def test_bytes_through_the_store_and_the_tier_are_identical(result: Any) -> None:
    b = result["bytes"]
    assert b["diff_bytes"] == {"mla": 0, "swa": 0, "ring": 0}
    checked = b["checked_bytes"]
    assert checked["mla"] == hit(result) // block(result) * result["geometry"]["payload_bytes"]
    assert checked["swa"] + checked["ring"] == result["geometry"]["state_bytes"]
    assert checked["ring"] == 98_304
    assert b["mla_blocks_moved"] > 0  # B's block ids are not A's
