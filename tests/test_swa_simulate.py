"""``kvcache swa simulate``: the replay (by example and by property), the PNG, the CLI."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.cli import main
from kvcache.errors import ArgumentError
from kvcache.swa_local.plot import SERIES, Canvas, hit_rate_chart, png_bytes
from kvcache.swa_local.simulate import Routing, simulate
from kvcache.workload import TRACE_BLOCK_TOKENS, Request, WorkloadSpec, generate_workload

B = TRACE_BLOCK_TOKENS


def req(t_s: float, ids: tuple[int, ...], tokens: int | None = None) -> Request:
    return Request(
        timestamp_ms=int(t_s * 1000),
        input_length=tokens if tokens is not None else len(ids) * B,
        output_length=10,
        hash_ids=ids,
    )


# Turns of one conversation at 0, 60 and 400 s; then another conversation sharing block 1.
TRACE = [
    req(0, (1, 2)),
    req(60, (1, 2, 3)),
    req(400, (1, 2, 3, 4)),
    req(410, (1, 9)),
]


def test_states_live_for_their_ttl_from_creation() -> None:
    short = simulate(TRACE, workers=1, ttl_s=180, state_bytes=1000)
    # Continuations: turns 2 and 3, and the request sharing block 1.
    assert short.continuations == 3
    # Turn 2 finds turn 1's state (60 s old); turn 3's is 340 s old: expired.
    assert short.hits == 1 and short.boundary_hit_rate == pytest.approx(1 / 3)
    # Nobody ever ended at block 1: that continuation is unreachable for any TTL.
    assert short.unreachable == 1 and short.reachable_hit_rate == pytest.approx(1 / 2)
    assert short.peak_states_per_worker == 2 and short.peak_bytes_per_worker == 2000
    assert short.fetch_bytes_per_s == 0.0
    long = simulate(TRACE, workers=1, ttl_s=500, state_bytes=1000)
    assert long.hits == 2
    assert long.state_tokens == (2 + 3) * B and long.store_hit_tokens == (2 + 3 + 1) * B


def test_random_routing_fetches_what_another_worker_holds() -> None:
    result = simulate(TRACE, workers=4, ttl_s=500, routing=Routing.RANDOM, state_bytes=1000)
    assert result.hits == 2
    assert result.fetches == result.hits - result.same_worker_hits
    assert result.fetch_bytes_per_s == pytest.approx(result.fetches * 1000 / 410)
    affinity = simulate(TRACE, workers=4, ttl_s=500, routing=Routing.AFFINITY)
    assert affinity.same_worker_hits == affinity.hits == 2 and affinity.fetches == 0


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ArgumentError):
        simulate(TRACE, workers=0, ttl_s=10)
    with pytest.raises(ArgumentError):
        simulate(TRACE, workers=1, ttl_s=0)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 1000),
    workers=st.integers(1, 6),
    ttls=st.lists(st.integers(1, 900), min_size=2, max_size=4, unique=True),
)
def test_rates_are_ordered_and_grow_with_the_ttl(seed: int, workers: int, ttls: list[int]) -> None:
    spec = WorkloadSpec(seed=seed, conversations=6, span_ms=120_000)
    trace = generate_workload(spec)
    results = [simulate(trace, workers=workers, ttl_s=t, seed=seed) for t in sorted(ttls)]
    for r in results:
        assert 0 <= r.same_worker_hit_rate <= r.boundary_hit_rate <= r.reachable_hit_rate <= 1
        assert r.fetches == r.hits - r.same_worker_hits
        if workers == 1:
            assert r.fetches == 0
    # Same routing draws for every TTL: a longer life never loses a hit.
    hits = [r.hits for r in results]
    assert hits == sorted(hits)


# ---------------------------------------------------------------------- the PNG


def _decode_png(raw: bytes) -> tuple[int, int, bytes]:
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width, height = 8, b"", 0, 0
    while pos < len(raw):
        (length,) = struct.unpack(">I", raw[pos : pos + 4])
        kind = raw[pos + 4 : pos + 8]
        data = raw[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", raw[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + data)
        if kind == b"IHDR":
            width, height = struct.unpack(">II", data[:8])
        elif kind == b"IDAT":
            idat += data
        pos += 12 + length
    rows = zlib.decompress(idat)
    stride = width * 3 + 1
    assert all(rows[y * stride] == 0 for y in range(height))
    return width, height, b"".join(rows[y * stride + 1 : (y + 1) * stride] for y in range(height))


def test_png_round_trips_the_pixels() -> None:
    canvas = Canvas(7, 5)
    canvas.line(0, 0, 6, 4, (200, 10, 30))
    width, height, pixels = _decode_png(canvas.png())
    assert (width, height) == (7, 5)
    assert pixels == bytes(canvas.pixels)
    assert canvas.get(0, 0) == (200, 10, 30) and canvas.get(6, 4) == (200, 10, 30)
    with pytest.raises(ValueError):
        png_bytes(2, 2, b"\x00" * 5)


def test_chart_draws_each_series(tmp_path: Path) -> None:
    path = tmp_path / "chart.png"
    canvas = hit_rate_chart(
        [10, 60, 180],
        [("any worker", [0.2, 0.5, 0.9]), ("same worker", [0.1, 0.2, 0.3])],
        title="t",
        mark_ttl_s=60,
        path=path,
    )
    _, _, pixels = _decode_png(path.read_bytes())
    colors = {tuple(pixels[i : i + 3]) for i in range(0, len(pixels), 3)}
    assert SERIES[0] in colors and SERIES[1] in colors
    assert pixels == bytes(canvas.pixels)


# ---------------------------------------------------------------------- the command


def _write(trace: list[Request], path: Path) -> Path:
    with path.open("w") as fh:
        for r in trace:
            row = {
                "timestamp": r.timestamp_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            fh.write(json.dumps(row) + "\n")
    return path


def test_cli_prints_one_json_object_and_draws_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write(TRACE, tmp_path / "trace.jsonl")
    plot = tmp_path / "hit.png"
    argv = ["swa", "simulate", "--trace", str(trace), "--workers", "1", "--ttl", "3m"]
    assert main([*argv, "--json", "--plot", str(plot), "--sweep", "1m,3m,10m"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("exact_hit_rate", "replayed_tokens", "boundary_hit_rate", "fetch_bytes_per_s"):
        assert key in out
    assert "hit_rate" not in out  # the looser figure only under its own name
    assert out["boundary_hit_rate"] == pytest.approx(1 / 3)
    assert [s["ttl_s"] for s in out["sweep"]] == [60, 180, 600]
    assert _decode_png(plot.read_bytes())[:2] == (760, 460)
    assert main(argv) == 0
    assert "state at any boundary, any worker:       33.3%" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ttl", "3x"], "--ttl"),
        (["--workers", "0"], "--workers"),
        (["--trace", "/nonexistent/trace.jsonl"], "cannot open trace"),
    ],
)
def test_cli_user_mistakes_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    trace = _write(TRACE, tmp_path / "trace.jsonl")
    assert main(["swa", "simulate", "--trace", str(trace), *extra]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_exact_hits_need_the_state_at_the_hits_end_and_the_rest_replay() -> None:
    # A state at block 2 is live when C arrives, the one at block 3 (C's hit end) is not.
    trace = [req(0, (1, 2, 3)), req(90, (1, 2)), req(150, (1, 2, 3, 4))]
    sim = simulate(trace, workers=1, ttl_s=100, state_bytes=1000, replay_tokens=128)
    assert sim.continuations == 2
    assert sim.hits == 1 and sim.exact_hits == 0  # C: a boundary hit, not an exact one
    assert sim.exact_hit_rate == 0 and sim.boundary_hit_rate == pytest.approx(1 / 2)
    assert sim.replayed_tokens == 2 * 128  # B and C replay one window each
    long = simulate(TRACE, workers=1, ttl_s=500, state_bytes=1000)
    assert long.exact_hits == 2 and long.replayed_tokens == 128  # only (1, 9) replays


@given(st.integers(1, 4), st.floats(1, 1000))
def test_exact_hits_are_boundary_hits(workers: int, ttl: float) -> None:
    sim = simulate(TRACE, workers=workers, ttl_s=ttl, state_bytes=1)
    assert sim.exact_hits <= sim.hits <= sim.continuations
    assert sim.replayed_tokens == 128 * (sim.continuations - sim.exact_hits)
