"""``kvcache demo``: bring up a local cluster and replay a workload against it.

Per request: match the prompt's cached prefix, load the hit blocks, "prefill"
the missed blocks (synthesise their KV bytes from their keys) and store them.
Every loaded byte is compared with what was stored, so the summary's
``wrong_bytes`` is a real check, not a claim.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvcache.client.client import Client
from kvcache.client.localcluster import LocalCluster
from kvcache.errors import ConfigError
from kvcache.keys import Namespace
from kvcache.layout import REFERENCE_LAYOUT
from kvcache.workload import (
    Request,
    generate_workload,
    ideal_hit_blocks,
    payload_for_key,
    tokens_for,
)

__all__ = ["DemoOptions", "DemoSummary", "run_demo"]

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
        }


def _parse_fault(spec: str | None, nodes: int) -> tuple[str, int] | None:
    if not spec:
        return None
    kind, _, count = spec.partition(":")
    if kind not in ("kill", "pause") or not count.isdigit() or not 1 <= int(count) < nodes:
        raise ConfigError(f"--fault must be kill:N or pause:N with 1 <= N < {nodes}, got {spec!r}")
    return kind, int(count)


def load_requests(options: DemoOptions) -> list[Request]:
    """The workload: the trace file if given, else the seeded generator."""
    from kvcache.workload import WorkloadSpec, read_trace

    if options.trace is not None:
        reqs: Sequence[Request] = list(read_trace(options.trace, traffic_class=options.trace_class))
    else:
        reqs = generate_workload(WorkloadSpec(seed=options.seed))
    return list(reqs[: options.limit] if options.limit else reqs)


def run_demo(options: DemoOptions, *, out: TextIO = sys.stderr) -> DemoSummary:
    """Start a cluster, replay, stop the cluster; returns the summary."""
    requests = load_requests(options)
    fault = _parse_fault(options.fault, options.nodes)
    with tempfile.TemporaryDirectory(prefix="kvcache-demo-") as tmp:
        root = options.root or Path(tmp)
        print(f"starting {options.nodes} storage daemons under {root} ...", file=out)
        with LocalCluster(root).start(nodes=options.nodes, capacity=options.capacity) as cluster:
            config = cluster.client_config()
            with Client(config) as client:
                return _replay(client, cluster, requests, options, fault, out)


def _replay(
    client: Client,
    cluster: LocalCluster,
    requests: list[Request],
    options: DemoOptions,
    fault: tuple[str, int] | None,
    out: TextIO,
) -> DemoSummary:
    ns = Namespace(model="demo/synthetic-kv", revision="1", layout=REFERENCE_LAYOUT)
    payload_len = REFERENCE_LAYOUT.payload_bytes
    tpb = REFERENCE_LAYOUT.tokens_per_block
    ideal = ideal_hit_blocks(requests)
    summary = DemoSummary(fault=options.fault or "")
    fault_at = len(requests) // 3 if fault else -1
    resume_at = 2 * len(requests) // 3
    started = time.perf_counter()
    t0_ms = requests[0].timestamp_ms if requests else 0
    bar = _Progress(len(requests), out)
    for n, req in enumerate(requests):
        if n == fault_at and fault:
            kind, count = fault
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
        match = client.match_prefix(ns, tokens)
        t = time.perf_counter()
        result = client.load(ns, match, traffic_class=req.traffic_class)
        elapsed = time.perf_counter() - t
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
        summary.requests += 1
        summary.input_tokens += req.input_length
        summary.hit_tokens += result.tokens
        summary.ideal_hit_tokens += ideal[n] * tpb
        bar.update(n + 1, summary)
    bar.close()
    summary.wall_seconds = time.perf_counter() - started
    return summary


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


def print_summary(summary: DemoSummary, out: TextIO = sys.stdout) -> None:
    """The closing table of a replay."""
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
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}", file=out)


def write_json(summary: DemoSummary, path: Path) -> None:
    """Write the flat JSON summary."""
    path.write_text(json.dumps(summary.as_dict(), indent=2, sort_keys=True))
