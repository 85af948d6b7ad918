"""Figures of kvcache's own measurements, drawn with matplotlib and written as PNG.

Each ``*_figure`` function is pure: numbers in, a :class:`matplotlib.figure.Figure`
out (no pyplot, no global state, no display), so tests inspect its axes and
lines and the CLIs only call :func:`write_png`. matplotlib is the optional
``plot`` extra (``pip install 'kvcache[plot]'``); without it the ``--plot``
flags fail with a message, and nothing else needs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvcache.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "DemoPoint",
    "DemoSeries",
    "RetentionPoint",
    "demo_figure",
    "demo_series",
    "human_duration",
    "latency_cdf_figure",
    "retention_figure",
    "write_png",
]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_MIN_LOAD_S = 1e-6


@dataclass(frozen=True, slots=True, kw_only=True)
class RetentionPoint:
    """One class's outcome of one simulated TTL."""

    ttl_s: float
    hit_rate: float
    stored_bytes: float


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoPoint:
    """One replayed request: its tokens, hit tokens, and the bytes and time of its load."""

    input_tokens: int
    hit_tokens: int
    loaded_bytes: int
    load_seconds: float


def _figure(rows: int, *, height: float) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(
            "plots need matplotlib: pip install 'kvcache[plot]' (or matplotlib)"
        ) from None
    fig = Figure(figsize=(8, height), layout="constrained")
    fig.subplots(rows, 1, squeeze=False)
    return fig


def retention_figure(curves: Mapping[str, Sequence[RetentionPoint]], *, title: str = "") -> Figure:
    """Hit rate (top) and mean stored bytes (bottom) against TTL: one line per class.

    ``curves`` maps a class name (or ``"all"`` for the whole trace) to its
    points, one per TTL tried.
    """
    if not curves or not all(curves.values()):
        raise ConfigError("a retention plot needs at least one TTL per class")
    fig = _figure(2, height=7)
    hit_ax, bytes_ax = fig.axes
    ttls = sorted({p.ttl_s for points in curves.values() for p in points})
    for name, points in curves.items():
        pts = sorted(points, key=lambda p: p.ttl_s)
        xs = [p.ttl_s for p in pts]
        style = "--" if name == "all" else "-"
        hit_ax.plot(xs, [100 * p.hit_rate for p in pts], style, marker="o", label=name)
        bytes_ax.plot(xs, [p.stored_bytes / 1e9 for p in pts], style, marker="o", label=name)
    for ax in (hit_ax, bytes_ax):
        ax.set_xscale("log")
        ax.set_xticks(ttls, [human_duration(t) for t in ttls])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(title="class")
    hit_ax.set_ylabel("hit rate (% of input tokens)")
    hit_ax.set_ylim(0, 100)
    bytes_ax.set_ylabel("stored, mean (GB, with 10+2)")
    bytes_ax.set_xlabel("TTL (every class)")
    hit_ax.set_title(title or "Retention: hit rate and capacity against TTL")
    return fig


def latency_cdf_figure(series: Mapping[str, Sequence[float]], *, title: str = "") -> Figure:
    """Empirical CDFs of latencies (ms), one line per named series, p50/p99 in the legend."""
    if not series or not all(len(v) for v in series.values()):
        raise ConfigError("a latency CDF needs at least one sample per series")
    fig = _figure(1, height=4.5)
    (ax,) = fig.axes
    for name, values in series.items():
        xs = np.sort(np.asarray(values, dtype=float))
        ys = np.arange(1, len(xs) + 1) / len(xs)
        p50, p99 = np.percentile(xs, [50, 99])
        ax.step(
            xs, ys, where="post", label=f"{name} (n={len(xs)}, p50 {p50:.1f}, p99 {p99:.1f} ms)"
        )
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _pos: ""))
    ax.set_xlabel("load latency (ms, log scale)")
    ax.set_ylabel("fraction of loads")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title or "Load latency CDF")
    return fig


@dataclass(frozen=True, slots=True)
class DemoSeries:
    """What :func:`demo_figure` draws, one value per request (percent and GB/s)."""

    cumulative_hit_pct: npt.NDArray[np.float64]
    window_hit_pct: npt.NDArray[np.float64]
    window_gbps: npt.NDArray[np.float64]


def demo_series(points: Sequence[DemoPoint], *, window: int = 10) -> DemoSeries:
    """Cumulative and windowed hit rate, and load GB/s over the last ``window`` requests
    (0 where the window loaded nothing in a measurable time)."""
    if not points:
        raise ConfigError("a demo plot needs at least one request")
    if window < 1:
        raise ConfigError(f"window must be >= 1, got {window}")
    tokens = np.array([p.input_tokens for p in points], dtype=float)
    hits = np.array([p.hit_tokens for p in points], dtype=float)
    loaded = np.array([p.loaded_bytes for p in points], dtype=float)
    seconds = np.array([p.load_seconds for p in points], dtype=float)
    secs = _rolling(seconds, window)
    return DemoSeries(
        cumulative_hit_pct=100 * np.cumsum(hits) / np.maximum(1, np.cumsum(tokens)),
        window_hit_pct=100 * _rolling(hits, window) / np.maximum(1, _rolling(tokens, window)),
        # A load takes microseconds at least; below that the time is noise, not a rate.
        window_gbps=np.divide(
            _rolling(loaded, window), secs * 1e9, out=np.zeros_like(secs), where=secs > _MIN_LOAD_S
        ),
    )


def demo_figure(
    points: Sequence[DemoPoint],
    *,
    window: int = 10,
    fault_at: int | None = None,
    title: str = "",
) -> Figure:
    """Hit rate (top: cumulative and over the last ``window`` requests) and load throughput
    (bottom: GB/s over the last ``window`` requests) against the request number; a vertical
    line marks the request where a fault was injected."""
    series = demo_series(points, window=window)
    fig = _figure(2, height=6.5)
    hit_ax, gbps_ax = fig.axes
    n = np.arange(1, len(points) + 1)
    hit_ax.plot(n, series.cumulative_hit_pct, label="cumulative")
    hit_ax.plot(n, series.window_hit_pct, alpha=0.7, label=f"last {window} requests")
    gbps_ax.plot(n, series.window_gbps, color="tab:green", label=f"last {window} requests")
    for ax in (hit_ax, gbps_ax):
        if fault_at is not None:
            ax.axvline(fault_at + 1, color="tab:red", linestyle=":", label="fault injected")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best")
    hit_ax.set_ylabel("hit rate (% of input tokens)")
    hit_ax.set_ylim(0, 100)
    gbps_ax.set_ylabel("load throughput (GB/s)")
    gbps_ax.set_xlabel("request")
    hit_ax.set_title(title or "kvcache demo: hit rate and load throughput over the replay")
    return fig


def human_duration(seconds: float) -> str:
    """``90`` → ``"90s"``, ``3600`` → ``"1h"``, ``259200`` → ``"3d"`` (largest exact unit)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _rolling(values: npt.NDArray[np.float64], window: int) -> npt.NDArray[np.float64]:
    """Sum of each element and the ``window - 1`` before it."""
    c = np.cumsum(values)
    out = c.copy()
    out[window:] = c[window:] - c[:-window]
    return out


def write_png(fig: Figure, path: str | Path, *, dpi: int = 110) -> Path:
    """Write ``fig`` as a PNG (Agg, no display needed); raises ConfigError if it cannot."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", dpi=dpi)
    except OSError as exc:
        raise ConfigError(f"cannot write plot {path}: {exc}") from None
    return path
