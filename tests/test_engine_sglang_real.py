"""kvcache's HiCache backend through SGLang 0.5.23's own interfaces (the SGLang venv).

``tests/sglang_e2e/hicache.py`` runs in the venv ``scripts/sglang-venv.sh`` builds (sglang
0.5.23 from PyPI without its GPU stack; that script and the harness say what is installed
and where SGLang stops on a CPU machine): SGLang's ``StorageBackendFactory`` loads the
backend as ``--hicache-storage-backend dynamic`` does, from SGLang's ``HiCacheStorageConfig``
with kvcache's extra config; the backend is a real ``HiCacheStorage``; pages written from one
of SGLang's ``MHATokenToKVPoolHost`` pools through ``batch_set_v1`` come back byte-identical
into another at other indices through ``batch_get_v1``, against a real local cluster; absent
pages come back missing; and SGLang's loader refuses a class that is not a ``HiCacheStorage``.
(This tier found that SGLang 0.5.23's host pools name their page getter ``get_data_page``.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from vllm_e2e.harness import run

from kvcache.testing.localcluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parent.parent


def build_sglang_python() -> Path:
    """The SGLang venv's python, built by scripts/sglang-venv.sh if it is not there yet."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "sglang-venv.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(
            "scripts/sglang-venv.sh could not build the SGLang venv this tier needs "
            f"(exit {proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    python = Path(proc.stdout.strip().splitlines()[-1])
    assert python.exists(), python
    return python


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> Any:
    python = build_sglang_python()
    work = tmp_path_factory.mktemp("sglang-real")
    cluster = LocalCluster(work / "cluster")
    cluster.start(nodes=12, capacity="128MiB")
    try:
        spec = work / "spec.json"
        spec.write_text(
            json.dumps(
                {
                    "cluster_file": str(cluster.cluster_file),
                    "credentials_file": str(cluster.credentials_file),
                }
            )
        )
        out = work / "out.json"
        harness = REPO / "tests" / "sglang_e2e" / "hicache.py"
        run([str(python), str(harness), str(spec), str(out)], work / "hicache.log", 600)
        return json.loads(out.read_text())
    finally:
        cluster.stop()


def test_sglangs_dynamic_loader_builds_a_real_hicache_storage(result: Any) -> None:
    assert result["class"] == "kvcache.engine.sglang_backend.KVCacheStorage"
    assert result["pool"] == "MHATokenToKVPoolHost"
    assert result["is_hicache_storage"]
    assert result["refused_non_backend"]


def test_pages_round_trip_between_host_pools_through_the_cluster(result: Any) -> None:
    assert result["set"] == [True] * 6
    assert result["exists"] == 6
    assert result["exists_longer"] == 6
    assert result["get"] == [True] * 6
    assert result["equal"]
    assert result["missing_get"] == [False, False]
    assert result["stats"]["pages_loaded"] == 6


def test_deepseek_v4s_anchor_pool_is_refused_with_what_it_needs(result: Any) -> None:
    """V4 / V4.1's HiCache stack registers a LogicalHostPool (no bytes; the KV is in side
    pools moved through SGLang's batch v2 interface): refused by name, not an AttributeError."""
    refused = result["v4_anchor_refused"]
    assert refused.startswith("ConfigError: SGLang registered a LogicalHostPool")
    assert "batch_get_v2" in refused
