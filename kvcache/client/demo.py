"""``kvcache demo``: bring up a local cluster and replay a workload against it.

Per request: match the prompt's cached prefix, load the hit blocks, "prefill"
the missed blocks (synthesise their KV bytes from their keys) and store them.
Every loaded byte is compared with what was stored, so the summary's
``wrong_bytes`` is a real check, not a claim. ``--plot`` draws the hit rate
and load throughput over the replay (:func:`kvcache.plots.demo_figure`).

Blocks are the reference layout's: DeepSeek V4.1 Flash's 128-token MLA blocks of
114,688 bytes, 4 per 512-token hash id of a trace. With ``--swa-workers N`` the
replay also runs N workers' SWA tiers (:mod:`kvcache.swa_local.fleet`): each request
goes to a worker, fetches the sliding-window state at the end of its store hit if
some worker holds it, and takes its own; ``swa_exact_hit_rate`` and
``swa_replayed_tokens`` are then measured, beside the simulator's prediction of the
same figures on the same requests (``swa_simulated``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvcache.client.client import Client
from kvcache.errors import ClusterError, ConfigError
from kvcache.keys import Namespace, block_keys
from kvcache.layout import REFERENCE_LAYOUT
from kvcache.plots import DemoPoint
from kvcache.swa_local.fleet import SwaFleet
from kvcache.swa_local.simulate import DSV41_STATE_BYTES, Routing, simulate
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import (
    Request,
    generate_workload,
    ideal_hit_blocks,
    payload_for_key,
    tokens_for,
)

__all__ = ["DemoOptions", "DemoSummary", "run_cli", "run_demo", "write_plot"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    """What the demo replays and how."""

    trace: Path | None = None
    trace_class: str = "chat"
    limit: int | None = None
    speed: float = 0.0
    fault: str | None = None
    nodes: int = 12
    seed: int = 7
    root: Path | None = None
    capacity: str = "4GiB"
    #: Write a PNG of hit rate and load throughput over the replay here.
    plot: Path | None = None
    #: Keep membership in an etcd of the cluster's own (``kvcache up --etcd``).
    etcd: bool = False
    #: The daemons' etcd lease, seconds.
    lease_ttl_s: int = 10
    #: Workers whose SWA tiers the replay runs (0: none).
    swa_workers: int = 0
    #: A state's life, seconds of trace time.
    swa_ttl_s: float = 180.0
    #: Bytes of one state (DeepSeek V4.1 Flash on SM100 by default).
    swa_state_bytes: int = DSV41_STATE_BYTES

    def __post_init__(self) -> None:
        # Checked before any daemon starts (a bad value used to cost a whole replay first).
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")
        if self.swa_workers < 0:
            raise ConfigError(f"--swa-workers must be >= 0, got {self.swa_workers}")
        if not (math.isfinite(self.swa_ttl_s) and 0 < self.swa_ttl_s <= 3600):
            raise ConfigError(f"--swa-ttl must lie in (0, 3600] seconds, got {self.swa_ttl_s}")
        if self.swa_state_bytes < 1:
            raise ConfigError(f"--swa-state-bytes must be >= 1, got {self.swa_state_bytes}")
        if not (math.isfinite(self.speed) and self.speed >= 0):
            raise ConfigError(f"--speed must be a finite number >= 0, got {self.speed}")
        for path in (self.plot,):
            if path is not None and Path(path).is_dir():
                raise ConfigError(f"{path} is a directory: name a file to write")


@dataclass(slots=True)
class DemoSummary:
    """Figures of one replay."""

    requests: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    ideal_hit_tokens: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    wrong_bytes: int = 0
    blocks_stored: int = 0
    store_failures: int = 0
    load_latencies_ms: list[float] = field(default_factory=list)
    wall_seconds: float = 0.0
    fault: str = ""
    #: One entry per replayed request, in order (what ``--plot`` draws).
    points: list[DemoPoint] = field(default_factory=list)
    #: Index of the request before which the fault was injected.
    fault_at: int | None = None
    #: With SWA workers: the fleet's figures, and the simulator's on the same requests.
    swa: dict[str, Any] | None = None
    swa_simulated: dict[str, Any] | None = None

    @property
    def hit_rate_after_fault(self) -> float:
        """Hit rate over the requests from the fault on (a third of the way in, also
        without a fault, so runs with and without one compare like for like)."""
        start = self.fault_at if self.fault_at is not None else len(self.points) // 3
        rest = self.points[start:]
        return sum(p.hit_tokens for p in rest) / max(1, sum(p.input_tokens for p in rest))

    def as_dict(self) -> dict[str, Any]:
        """The flat summary written by ``--json``."""
        lat = np.array(self.load_latencies_ms or [0.0])
        return {
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_tokens / max(1, self.input_tokens),
            "ideal_hit_rate": self.ideal_hit_tokens / max(1, self.input_tokens),
            "tokens_served_from_cache": self.hit_tokens,
            "wrong_bytes": self.wrong_bytes,
            "loaded_bytes": self.loaded_bytes,
            "load_gbps": self.loaded_bytes / max(1e-9, self.load_seconds) / 1e9,
            "load_p50_ms": float(np.percentile(lat, 50)),
            "load_p99_ms": float(np.percentile(lat, 99)),
            "blocks_stored": self.blocks_stored,
            "store_failures": self.store_failures,
            "wall_seconds": self.wall_seconds,
            "fault": self.fault,
            "hit_rate_after_fault": self.hit_rate_after_fault,
            **self._swa_dict(),
        }

    def _swa_dict(self) -> dict[str, Any]:
        if self.swa is None:
            return {}
        out: dict[str, Any] = {
            "swa_exact_hit_rate": self.swa["exact_hit_rate"],
            "swa_replayed_tokens": self.swa["replayed_tokens"],
            "swa": self.swa,
        }
        if self.swa_simulated is not None:
            out["swa_simulated"] = self.swa_simulated
        return out


def _parse_fault(spec: str | None, nodes: int) -> tuple[str, int] | None:
    if not spec:
        return None
    kind, _, count = spec.partition(":")
    limit = 64 if kind == "join" else nodes - 1
    if kind not in ("kill", "pause", "join") or not count.isdigit() or not 1 <= int(count) <= limit:
        raise ConfigError(
            f"--fault must be kill:N or pause:N with 1 <= N < {nodes}, or join:N (N <= 64), "
            f"got {spec!r}"
        )
    return kind, int(count)


def load_requests(options: DemoOptions) -> list[Request]:
    """The workload: the trace file if given, else the seeded generator."""
    from kvcache.workload import WorkloadSpec, read_trace

    if options.trace is not None:
        reqs: Sequence[Request] = list(read_trace(options.trace, traffic_class=options.trace_class))
    else:
        reqs = generate_workload(WorkloadSpec(seed=options.seed))
    return list(reqs[: options.limit] if options.limit else reqs)


def run_demo(options: DemoOptions, *, out: TextIO | None = None) -> DemoSummary:
    """Start a cluster, replay, stop the cluster; returns the summary. Progress goes to
    ``out`` (default: ``sys.stderr`` as it is at the call, not at import)."""
    out = sys.stderr if out is None else out
    requests = load_requests(options)
    fault = _parse_fault(options.fault, options.nodes)
    with tempfile.TemporaryDirectory(prefix="kvcache-demo-") as tmp:
        root = options.root or Path(tmp)
        print(f"starting {options.nodes} storage daemons under {root} ...", file=out)
        with LocalCluster(root).start(
            nodes=options.nodes,
            capacity=options.capacity,
            etcd=options.etcd,
            lease_ttl_s=options.lease_ttl_s,
        ) as cluster:
            config = cluster.client_config()
            with Client(config) as client:
                summary = _replay_with_swa(client, cluster, requests, options, fault, out)
    if options.plot is not None:
        write_plot(summary, options.plot)
        print(f"plot written to {options.plot}", file=out)
    return summary


_NAMESPACE = Namespace(model="demo/synthetic-kv", revision="1", layout=REFERENCE_LAYOUT)


def _replay_with_swa(
    client: Client,
    cluster: LocalCluster,
    requests: list[Request],
    options: DemoOptions,
    fault: tuple[str, int] | None,
    out: TextIO,
) -> DemoSummary:
    """:func:`_replay`, with the SWA fleet when ``options.swa_workers`` asks for one."""
    if options.swa_workers < 1:
        return _replay(client, cluster, requests, options, fault, out)
    fleet = SwaFleet(
        client,
        _NAMESPACE,
        workers=options.swa_workers,
        ttl_s=options.swa_ttl_s,
        state_bytes=options.swa_state_bytes,
        seed=options.seed,
    )
    with fleet:
        summary = _replay(client, cluster, requests, options, fault, out, fleet=fleet)
    summary.swa = fleet.figures.to_dict()
    summary.wrong_bytes += fleet.figures.wrong_bytes
    predicted = simulate(
        requests,
        workers=options.swa_workers,
        ttl_s=options.swa_ttl_s,
        routing=Routing.RANDOM,
        state_bytes=options.swa_state_bytes,
        seed=options.seed,
        replay_tokens=fleet.figures.replay_tokens,
        tokens_per_block=REFERENCE_LAYOUT.tokens_per_block,
    )
    summary.swa_simulated = predicted.to_dict()
    return summary


def _replay(
    client: Client,
    cluster: LocalCluster,
    requests: list[Request],
    options: DemoOptions,
    fault: tuple[str, int] | None,
    out: TextIO,
    *,
    fleet: SwaFleet | None = None,
) -> DemoSummary:
    ns = _NAMESPACE
    payload_len = REFERENCE_LAYOUT.payload_bytes
    tpb = REFERENCE_LAYOUT.tokens_per_block
    ideal = ideal_hit_blocks(requests, tokens_per_block=tpb)
    summary = DemoSummary(fault=options.fault or "")
    fault_at = len(requests) // 3 if fault else -1
    summary.fault_at = fault_at if fault else None
    resume_at = 2 * len(requests) // 3
    started = time.perf_counter()
    t0_ms = requests[0].timestamp_ms if requests else 0
    bar = _Progress(len(requests), out)
    for n, req in enumerate(requests):
        if n == fault_at and fault:
            kind, count = fault
            if kind == "join":
                _join(client, cluster, count)
            else:
                for i in range(count):
                    (cluster.kill if kind == "kill" else cluster.pause)(i)
            print(f"\nfault: {kind} {count} daemon(s)", file=out)
        if n == resume_at and fault and fault[0] == "pause":
            for i in range(fault[1]):
                cluster.resume(i)
            print("\nfault: resumed paused daemon(s)", file=out)
        if options.speed > 0:
            due = (req.timestamp_ms - t0_ms) / 1000.0 / options.speed
            delay = due - (time.perf_counter() - started)
            if delay > 0:
                time.sleep(delay)
        tokens = tokens_for(req)
        if fleet is None:
            match = client.match_prefix(ns, tokens)
        else:
            worker = fleet.route(req.timestamp_ms / 1000.0)
            keys = block_keys(ns, tokens)
            match, holders = fleet.lookup(worker, keys)
        t = time.perf_counter()
        result = client.load(ns, match, traffic_class=req.traffic_class)
        elapsed = time.perf_counter() - t
        if fleet is not None:
            fleet.continue_at(worker, keys, result.blocks, holders)
        summary.points.append(
            DemoPoint(
                input_tokens=req.input_length,
                hit_tokens=result.tokens,
                loaded_bytes=result.bytes_loaded if result.blocks else 0,
                load_seconds=elapsed if result.blocks else 0.0,
            )
        )
        if result.blocks:
            summary.load_latencies_ms.append(elapsed * 1000)
            summary.load_seconds += elapsed
            summary.loaded_bytes += result.bytes_loaded
        for i, payload in enumerate(result.payloads):
            expected = payload_for_key(match.keys[i], payload_len)
            summary.wrong_bytes += int(np.count_nonzero(payload != expected))
        missing = match.keys[result.blocks :]
        if missing:
            payloads = [payload_for_key(key, payload_len) for key in missing]
            stored = client.store(
                ns, tokens, payloads, traffic_class=req.traffic_class, first_block=result.blocks
            )
            summary.blocks_stored += stored.written
            summary.store_failures += stored.failed
        if fleet is not None:
            fleet.take(worker, keys)
        summary.requests += 1
        summary.input_tokens += req.input_length
        summary.hit_tokens += result.tokens
        summary.ideal_hit_tokens += ideal[n] * tpb
        bar.update(n + 1, summary)
    bar.close()
    summary.wall_seconds = time.perf_counter() - started
    return summary


def _join(client: Client, cluster: LocalCluster, count: int, timeout_s: float = 60.0) -> None:
    """Start ``count`` more daemons and wait until the client places on them."""
    want = {cluster.add_node().id for _ in range(count)}
    deadline = time.monotonic() + timeout_s
    while not want <= {n.id for n in client.core.cluster.nodes}:
        if time.monotonic() > deadline:
            raise ClusterError(f"the client did not see {sorted(want)} join in {timeout_s} s")
        time.sleep(0.02)


class _Progress:
    def __init__(self, total: int, out: TextIO) -> None:
        self.total = total
        self.out = out
        self.tty = out.isatty()
        self.last = -1

    def update(self, done: int, s: DemoSummary) -> None:
        pct = done * 100 // max(1, self.total)
        if not self.tty and pct // 10 == self.last // 10 and done != self.total:
            return
        width = 30
        filled = done * width // max(1, self.total)
        hit = s.hit_tokens / max(1, s.input_tokens)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} requests, hit rate {hit:.1%}"
        print(
            ("\r" if self.tty else "") + line,
            end="" if self.tty else "\n",
            file=self.out,
            flush=True,
        )
        self.last = pct

    def close(self) -> None:
        if self.tty:
            print(file=self.out)


def print_summary(summary: DemoSummary, out: TextIO | None = None) -> None:
    """The closing table of a replay (to ``out``, default ``sys.stdout`` at the call)."""
    out = sys.stdout if out is None else out
    d = summary.as_dict()
    rows = [
        ("requests", f"{d['requests']}"),
        ("hit rate", f"{d['hit_rate']:.1%} (ideal {d['ideal_hit_rate']:.1%})"),
        ("tokens served from cache", f"{d['hit_tokens']:,} of {d['input_tokens']:,}"),
        ("load throughput", f"{d['load_gbps']:.2f} GB/s"),
        ("load latency p50 / p99", f"{d['load_p50_ms']:.1f} ms / {d['load_p99_ms']:.1f} ms"),
        ("blocks stored", f"{d['blocks_stored']:,} ({d['store_failures']} failed)"),
        ("wrong bytes", f"{d['wrong_bytes']}"),
        ("wall time", f"{d['wall_seconds']:.1f} s"),
    ]
    if summary.fault:
        rows.append(("fault injected", summary.fault))
    if summary.swa is not None:
        sim = summary.swa_simulated or {}
        rows.append(
            (
                "SWA exact hit rate",
                f"{summary.swa['exact_hit_rate']:.1%} "
                f"(simulator {sim.get('exact_hit_rate', float('nan')):.1%})",
            )
        )
        rows.append(
            (
                "SWA tokens replayed",
                f"{summary.swa['replayed_tokens']:,} (simulator {sim.get('replayed_tokens', 0):,})",
            )
        )
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}", file=out)


def write_json(summary: DemoSummary, path: Path) -> None:
    """Write the flat JSON summary."""
    path.write_text(json.dumps(summary.as_dict(), indent=2, sort_keys=True))


def write_plot(summary: DemoSummary, path: Path) -> None:
    """Hit rate and load throughput over the replay, as a PNG."""
    from kvcache.plots import demo_figure, write_png

    title = "kvcache demo: hit rate and load throughput over the replay"
    if summary.fault:
        title += f" (fault {summary.fault})"
    window = max(1, min(20, len(summary.points) // 10))
    fig = demo_figure(summary.points, window=window, fault_at=summary.fault_at, title=title)
    write_png(fig, path)


def run_cli(args: argparse.Namespace) -> int:
    """``kvcache demo``: replay, print the summary, write ``--json`` and ``--plot``."""
    options = DemoOptions(
        trace=args.trace,
        trace_class=args.trace_class,
        limit=args.limit,
        speed=args.speed,
        fault=args.fault,
        nodes=args.nodes,
        seed=args.seed,
        root=args.dir,
        capacity=args.capacity,
        plot=getattr(args, "plot", None),
        etcd=getattr(args, "etcd", False),
        lease_ttl_s=getattr(args, "lease_ttl", 10),
        swa_workers=getattr(args, "swa_workers", 0),
        swa_ttl_s=getattr(args, "swa_ttl", 180.0),
        swa_state_bytes=getattr(args, "swa_state_bytes", DSV41_STATE_BYTES),
    )
    if args.json and Path(args.json).is_dir():
        raise ConfigError(f"--json {args.json} is a directory: name a file to write")
    summary = run_demo(options)
    print_summary(summary)
    if args.json:
        try:
            write_json(summary, args.json)
        except OSError as exc:
            raise ConfigError(f"cannot write --json {args.json}: {exc.strerror or exc}") from None
    return 0 if summary.wrong_bytes == 0 else 3
