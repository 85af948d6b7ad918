"""The benchmarks' own arithmetic and orchestration: bench/_load_worker.py (client processes
loading together, the aggregate over their common interval) and bench/_runs.py (median and
range over repeated runs). The integration test starts real daemons and real worker
processes on loopback."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.client import Client
from kvcache.keys import Namespace
from kvcache.layout import DType, KVLayout
from kvcache.testing.localcluster import LocalCluster

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


load_worker = _module("_load_worker")
runs = _module("_runs")


def test_common_rate_counts_bytes_inside_the_interval_all_workers_ran() -> None:
    a = [(0.0, 1.0, 100), (1.0, 2.0, 100)]
    b = [(0.5, 1.5, 100), (1.5, 2.5, 100)]
    rate, lo, hi = load_worker.common_rate([a, b])
    # From b's first start (0.5) to a's last end (2.0): 50 + 100 from a, 100 + 50 from b.
    assert (lo, hi) == (0.5, 2.0)
    assert rate == pytest.approx(300 / 1.5)


def test_common_rate_refuses_workers_that_never_ran_together() -> None:
    with pytest.raises(ValueError, match="never ran together"):
        load_worker.common_rate([[(0.0, 1.0, 10)], [(2.0, 3.0, 10)]])
    with pytest.raises(ValueError, match="at least one load"):
        load_worker.common_rate([[(0.0, 1.0, 10)], []])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0.0, 1.0),  # first start
            st.floats(0.01, 0.5),  # seconds per load
            st.integers(1, 10**9),  # bytes per load
        ),
        min_size=1,
        max_size=12,
    )
)
def test_common_rate_of_steady_workers_is_the_sum_of_their_rates(
    workers: list[tuple[float, float, int]],
) -> None:
    """Workers loading back to back at constant rates, all running from t=1 to t=2 at
    least: the aggregate over the common interval is the sum of their rates."""
    loads = []
    for start, secs, nbytes in workers:
        count = math.ceil((2.0 - start) / secs) + 1
        loads.append([(start + i * secs, start + (i + 1) * secs, nbytes) for i in range(count)])
    rate, lo, hi = load_worker.common_rate(loads)
    assert lo <= 1.0 < 2.0 <= hi
    assert rate == pytest.approx(sum(n / s for _, s, n in workers), rel=1e-9)


def test_combine_takes_medians_and_keeps_each_run_and_the_range() -> None:
    combined = runs.combine(
        [
            {"gbps": 3.0, "ok": True, "commit": "abc", "n": 4, "rows": [{"x": 1.0}], "c": {"h": 1}},
            {"gbps": 1.0, "ok": True, "commit": "abc", "n": 4, "rows": [{"x": 3.0}], "c": {"h": 5}},
            {
                "gbps": 2.0,
                "ok": False,
                "commit": "abc",
                "n": 4,
                "rows": [{"x": 2.0}],
                "c": {"h": 3},
            },
        ]
    )
    assert combined["gbps"] == 2.0
    assert combined["gbps_runs"] == [3.0, 1.0, 2.0]
    assert combined["gbps_range"] == [1.0, 3.0]
    assert combined["ok"] is False and combined["ok_runs"] == [True, True, False]
    assert combined["commit"] == "abc" and "commit_runs" not in combined
    assert combined["n"] == 4 and isinstance(combined["n"], int)
    assert combined["rows"][0]["x"] == 2.0
    assert combined["c"]["h"] == 3


def test_combine_leaves_nan_out_of_the_median_and_lists_disagreements() -> None:
    combined = runs.combine([{"r": float("nan"), "gpu": "a"}, {"r": 2.0, "gpu": "b"}])
    assert combined["r"] == 2.0 and combined["r_range"] == [2.0, 2.0]
    assert combined["gpu_runs"] == ["a", "b"]
    assert math.isnan(runs.combine([{"r": float("nan")}])["r"])
    with pytest.raises(ValueError):
        runs.combine([])


LAYOUT = KVLayout(tokens_per_block=16, bytes_per_token=256, dtype=DType.BFLOAT16, layers_in_block=1)


def _spec(cluster: LocalCluster, space: Namespace, tokens: np.ndarray) -> dict[str, object]:
    return {
        "client_file": str(cluster.client_file),
        "namespace": {"model": space.model, "revision": space.revision},
        "layout": {
            "tokens_per_block": LAYOUT.tokens_per_block,
            "bytes_per_token": LAYOUT.bytes_per_token,
            "layers_in_block": LAYOUT.layers_in_block,
        },
        "tokens": tokens.tolist(),
        "seconds": 0.3,
        "overrides": {"timeout_s": 10.0},
    }


def test_run_together_releases_its_workers_at_once_against_real_daemons(tmp_path: Path) -> None:
    space = Namespace(model="bench/test", revision="1", layout=LAYOUT)
    tokens = np.random.default_rng(3).integers(0, 50_000, 32 * 16).astype(np.uint32)
    payloads = np.random.default_rng(4).integers(0, 256, (32, LAYOUT.payload_bytes), np.uint8)
    with LocalCluster(tmp_path / "c").start(nodes=12, capacity="64MiB") as cluster:
        with Client(cluster.client_config(timeout_s=10.0)) as client:
            assert client.store(space, tokens, payloads).failed == 0
        row = load_worker.run_together(_spec(cluster, space, tokens), 2, timeout_s=120)
        assert row["processes"] == 2
        assert row["loads"] >= 2
        assert row["gbps"] > 0 and row["cpu_s_per_gb"] > 0 and row["client_cores_busy"] > 0
        # Released together: the first loads began well inside the common interval.
        assert 0 <= row["start_spread_s"] < row["interval_s"]
        missing = _spec(
            cluster, Namespace(model="bench/absent", revision="1", layout=LAYOUT), tokens
        )
        with pytest.raises(RuntimeError, match="failed to start"):
            load_worker.run_together(missing, 2, timeout_s=120)
