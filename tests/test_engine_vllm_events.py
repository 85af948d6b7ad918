"""End to end: the vLLM connector's KV events reach vLLM's own publisher.

A real vLLM engine on the CPU (the tier of ``tests/test_engine_vllm.py``) runs with
``kv_events_config`` on, publishing to a SUB socket of ``tests/vllm_e2e/run_engine.py``
that decodes with vLLM's own ``KVEventBatch``. The first engine stores a prompt's blocks,
a second one loads them: each reports them as ``BlockStored`` with ``medium="STORAGE"``,
keyed by kvcache block keys (``docs/spec/hashing.md``), with their token ids, the parent
key, the full-attention group and ``locality="REMOTE"``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_e2e.harness import E2E, build_vllm_python, run_engine
from vllm_e2e.harness import run as run_cmd

from kvcache.engine.vllm_meta import namespace_from_dict
from kvcache.keys import block_keys
from kvcache.testing.localcluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

BLOCK = 32
rng = random.Random(20261202)
PROMPT = [rng.randrange(3, 1024) for _ in range(100)]  # 3 full blocks


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    return build_vllm_python()


@pytest.fixture(scope="module")
def tiny_model(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    run_cmd([str(vllm_python), str(E2E / "make_model.py"), str(out)], out / "build.log", 300)
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("vllm-events-cluster"))
    c.start(nodes=12, capacity="64MiB")
    yield c
    c.stop()


def storage_events(out: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = json.loads(out.read_text())["kv_events"]
    return [e for e in events if e.get("medium") == "STORAGE"]


def test_stores_and_loads_reach_vllms_publisher(
    vllm_python: Path, tiny_model: Path, cluster: LocalCluster, tmp_path: Path
) -> None:
    first = run_engine(vllm_python, tiny_model, tmp_path, "first", {"p": PROMPT}, cluster,
                       max_tokens=4, kv_events=True)  # fmt: skip
    ns = namespace_from_dict(first.final["worker"]["namespace"])
    keys = [k.hex() for k in block_keys(ns, PROMPT)]
    assert len(keys) == 3
    stored = storage_events(tmp_path / "first-out.json")
    assert [e["type"] for e in stored] == ["BlockStored"]
    [event] = stored
    assert event["block_hashes"] == keys
    assert event["parent_block_hash"] is None
    assert event["token_ids"] == PROMPT[: 3 * BLOCK]
    assert event["block_size"] == BLOCK
    assert (event["group_idx"], event["kv_cache_spec_kind"]) == (0, "full_attention")
    assert event["kv_cache_spec_sliding_window"] is None
    assert (event["locality"], event["ownership"]) == ("REMOTE", "kvcache")
    assert event["session_id"]

    # A second engine loads what the first stored: a reuse report of the same blocks.
    run_engine(vllm_python, tiny_model, tmp_path, "second", {"p": PROMPT}, cluster,
               max_tokens=4, kv_events=True)  # fmt: skip
    second = storage_events(tmp_path / "second-out.json")
    loaded = [e for e in second if e["block_hashes"] == keys[: (len(PROMPT) - 1) // BLOCK]]
    assert loaded, second
    assert loaded[0]["token_ids"] == PROMPT[: 3 * BLOCK]
    assert loaded[0]["locality"] == "REMOTE"
