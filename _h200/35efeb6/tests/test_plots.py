"""Plots: the figure functions draw what they are given, and the CLIs write real PNGs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from matplotlib.figure import Figure

from kvcache.cli import main as kvcache_main
from kvcache.errors import ConfigError
from kvcache.plots import (
    DemoPoint,
    RetentionPoint,
    demo_figure,
    demo_series,
    human_duration,
    latency_cdf_figure,
    retention_figure,
    write_png,
)
from kvcache.retention.cli import main as retention_main
from kvcache.retention.policy import RetentionPolicy
from kvcache.retention.simulate import simulate
from kvcache.workload import Request

PNG = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parent.parent


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_retention_figure_draws_one_line_per_class_on_both_axes(tmp_path: Path) -> None:
    curves = {
        name: [RetentionPoint(ttl_s=t, hit_rate=h, stored_bytes=b) for t, h, b in points]
        for name, points in {
            "agent": [(60, 0.2, 1e9), (3600, 0.5, 2e9), (86400, 0.6, 3e9)],
            "chat": [(60, 0.1, 1e9), (3600, 0.3, 4e9), (86400, 0.7, 9e9)],
            "all": [(60, 0.15, 2e9), (3600, 0.4, 6e9), (86400, 0.65, 12e9)],
        }.items()
    }
    fig = retention_figure(curves)
    hit_ax, bytes_ax = fig.axes
    assert [line.get_label() for line in hit_ax.lines] == ["agent", "chat", "all"]
    assert len(bytes_ax.lines) == 3
    assert list(hit_ax.lines[1].get_ydata()) == [10, 30, 70]  # percent
    assert list(bytes_ax.lines[1].get_ydata()) == [1, 4, 9]  # GB
    assert [t.get_text() for t in bytes_ax.get_xticklabels()] == ["1m", "1h", "1d"]
    assert png_size(write_png(fig, tmp_path / "r.png"))[0] > 400


def test_latency_cdf_is_a_step_up_to_one_per_series() -> None:
    rng = np.random.default_rng(3)
    fig = latency_cdf_figure({"healthy": rng.gamma(4, 2, 300), "stopped": rng.gamma(4, 3, 200)})
    (ax,) = fig.axes
    assert len(ax.lines) == 2
    for line, n in zip(ax.lines, (300, 200), strict=True):
        ys = np.asarray(line.get_ydata())
        assert len(ys) == n and ys[-1] == pytest.approx(1.0) and np.all(np.diff(ys) > 0)
        assert f"n={n}" in str(line.get_label())


@given(
    points=st.lists(
        st.tuples(
            st.integers(0, 10_000), st.integers(0, 10_000), st.integers(0, 10**9), st.floats(0, 1)
        ),
        min_size=1,
        max_size=60,
    ),
    window=st.integers(1, 20),
)
def test_demo_series_stay_in_range(points: list[tuple[int, int, int, float]], window: int) -> None:
    demo = [
        DemoPoint(input_tokens=t, hit_tokens=min(h, t), loaded_bytes=b, load_seconds=s)
        for t, h, b, s in points
    ]
    series = demo_series(demo, window=window)
    for pct in (series.cumulative_hit_pct, series.window_hit_pct):
        assert len(pct) == len(demo) and np.all((pct >= 0) & (pct <= 100 + 1e-9))
    gbps = series.window_gbps
    assert np.all(np.isfinite(gbps)) and np.all(gbps >= 0)
    # The last window's rate is its bytes over its seconds.
    tail = demo[-window:]
    secs = sum(p.load_seconds for p in tail)
    if secs > 1e-6:
        assert gbps[-1] == pytest.approx(sum(p.loaded_bytes for p in tail) / secs / 1e9)


def test_demo_figure_draws_the_series_and_the_fault() -> None:
    demo = [
        DemoPoint(
            input_tokens=1000, hit_tokens=100 * (i % 10), loaded_bytes=10**6, load_seconds=0.01
        )
        for i in range(30)
    ]
    fig = demo_figure(demo, window=5, fault_at=10)
    hit_ax, gbps_ax = fig.axes
    # Two hit-rate lines and the fault marker; one throughput line and the marker.
    assert len(hit_ax.lines) == 3 and len(gbps_ax.lines) == 2
    assert list(hit_ax.lines[2].get_xdata()) == [11, 11]
    assert np.asarray(gbps_ax.lines[0].get_ydata())[-1] == pytest.approx(0.1)  # 1 MB / 10 ms
    assert isinstance(fig, Figure)


def test_plots_refuse_empty_input() -> None:
    with pytest.raises(ConfigError):
        retention_figure({})
    with pytest.raises(ConfigError):
        latency_cdf_figure({"healthy": []})
    with pytest.raises(ConfigError):
        demo_figure([])


def test_human_duration() -> None:
    assert [human_duration(s) for s in (10, 60, 90, 3600, 7200, 86400 * 3)] == [
        "10s",
        "1m",
        "90s",
        "1h",
        "2h",
        "3d",
    ]


def _trace(path: Path) -> Path:
    """Agent requests a minute apart on one prefix, chat requests an hour apart on another."""
    rows = []
    for i in range(6):
        rows.append({"timestamp": i * 60_000, "input_length": 2048, "output_length": 1,
                     "hash_ids": [1, 2, 3, 4], "traffic_class": "agent"})  # fmt: skip
        rows.append({"timestamp": i * 3_600_000, "input_length": 1024, "output_length": 1,
                     "hash_ids": [7, 8], "traffic_class": "chat"})  # fmt: skip
    rows.sort(key=lambda r: r["timestamp"])
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_simulation_splits_hits_and_capacity_by_class(tmp_path: Path) -> None:
    from kvcache.workload import read_trace

    requests: list[Request] = list(read_trace(_trace(tmp_path / "t.jsonl")))
    res = simulate(requests, RetentionPolicy(classes={"agent": 120, "chat": 120, "default": 120}))
    assert set(res.classes) == {"agent", "chat"}
    assert res.classes["agent"].hit_rate == pytest.approx(5 / 6)  # every later minute hits
    assert res.classes["chat"].hit_rate == 0.0  # an hour apart: always expired
    assert sum(c.hit_tokens for c in res.classes.values()) == res.hit_tokens
    assert sum(c.mean_blocks for c in res.classes.values()) == pytest.approx(res.mean_blocks)


def test_retention_simulate_plot_writes_a_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _trace(tmp_path / "t.jsonl")
    out = tmp_path / "ttl.png"
    argv = ["simulate", "--trace", str(trace), "--sweep", "1m,2m,2h", "--plot", str(out)]
    assert retention_main(argv) == 0
    assert f"plot written to {out}" in capsys.readouterr().out
    assert png_size(out) == (880, 770)  # 8 x 7 inches at 110 dpi
    assert retention_main(["simulate", "--trace", str(trace), "--plot", str(out)]) == 1
    assert "--plot draws the --sweep TTLs" in capsys.readouterr().err


def test_demo_plot_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "demo.png"
    argv = ["--log-level", "WARNING", "demo", "--limit", "24", "--capacity", "256MiB"]
    assert kvcache_main([*argv, "--plot", str(out), "--json", str(tmp_path / "s.json")]) == 0
    assert png_size(out) == (880, 715)
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["requests"] == 24 and summary["wrong_bytes"] == 0


def test_bench_cluster_has_a_plot_flag_that_draws_the_cdfs(tmp_path: Path) -> None:
    help_text = subprocess.run(
        [sys.executable, str(REPO / "bench" / "cluster.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--plot PNG" in help_text
    spec = importlib.util.spec_from_file_location("bench_cluster", REPO / "bench" / "cluster.py")
    assert spec is not None and spec.loader is not None
    bench_cluster = importlib.util.module_from_spec(spec)
    saved_path = list(sys.path)  # the script puts bench/ on sys.path for its _common
    sys.modules["bench_cluster"] = bench_cluster  # its dataclasses look their module up
    try:
        spec.loader.exec_module(bench_cluster)
    finally:
        del sys.modules["bench_cluster"]
        sys.path[:] = saved_path
    out = tmp_path / "cdf.png"
    rng = np.random.default_rng(1)
    bench_cluster.plot_latencies(out, list(rng.gamma(3, 3, 100)), list(rng.gamma(3, 4, 100)), "x")
    assert png_size(out) == (880, 495)
