"""``kvcache swa``: the SWA tier's tools.

    kvcache swa simulate --trace trace.jsonl --workers 8 --ttl 3m --routing random|affinity
                         [--json] [--plot hit-rate.png]

``simulate`` replays a Mooncake-format trace (see ``kvcache.swa_local.simulate``)
and prints the SWA hit rate (a state held anywhere, and on the request's own
worker), the peak state bytes one worker holds and the cross-worker fetch
traffic; ``--plot`` also draws the hit rates against a sweep of TTLs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvcache.errors import ConfigError
from kvcache.retention.policy import parse_duration
from kvcache.swa_local.plot import hit_rate_chart
from kvcache.swa_local.simulate import REFERENCE_STATE_BYTES, Routing, simulate, sweep_ttl
from kvcache.workload import TRACE_BLOCK_TOKENS, read_trace

__all__ = ["register"]

DEFAULT_SWEEP = "10s,30s,1m,2m,3m,5m,10m,20m"


def register(sub: Any) -> None:
    """Add ``swa`` and its subcommands to the ``kvcache`` parser."""
    parser = sub.add_parser("swa", help="the SWA tier: simulate its hit rate on a trace")
    ssub = parser.add_subparsers(dest="swa_command", metavar="ACTION", required=True)
    sim = ssub.add_parser(
        "simulate",
        help="SWA hit rate, RAM per worker and fetch traffic on a request trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    sim.add_argument("--workers", type=int, default=8, help="inference workers (default 8)")
    sim.add_argument("--ttl", default="3m", help="state life from creation (default 3m)")
    sim.add_argument(
        "--routing",
        choices=[r.value for r in Routing],
        default=Routing.RANDOM.value,
        help="random, or affinity (to a worker holding the state; default random)",
    )
    sim.add_argument(
        "--state-bytes",
        type=int,
        default=REFERENCE_STATE_BYTES,
        help=f"bytes of one state (default {REFERENCE_STATE_BYTES}: 20 layers x 134 x 528)",
    )
    sim.add_argument("--seed", type=int, default=0, help="routing seed (default 0)")
    sim.add_argument(
        "--tokens-per-block",
        type=int,
        default=TRACE_BLOCK_TOKENS,
        help=f"the store's block (default {TRACE_BLOCK_TOKENS}, the trace's; 128: DeepSeek V4.1, "
        "4 blocks per hash id, as `kvcache demo --swa-workers` replays it)",
    )
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.add_argument("--plot", type=Path, help="draw hit rate against TTL into this PNG")
    sim.add_argument(
        "--sweep", default=DEFAULT_SWEEP, help=f"TTLs of the plot (default {DEFAULT_SWEEP})"
    )
    sim.set_defaults(func=_simulate)


def _simulate(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    if args.tokens_per_block < 1:
        raise ConfigError(f"--tokens-per-block must be >= 1, got {args.tokens_per_block}")
    if args.state_bytes < 1:
        raise ConfigError(f"--state-bytes must be >= 1, got {args.state_bytes}")
    ttl = parse_duration(args.ttl, what="--ttl")
    routing = Routing(args.routing)
    requests = list(read_trace(args.trace))
    if not requests:
        raise ConfigError(f"trace {args.trace} has no requests")
    options = {
        "workers": args.workers,
        "routing": routing,
        "state_bytes": args.state_bytes,
        "seed": args.seed,
        "tokens_per_block": args.tokens_per_block,
    }
    result = simulate(requests, ttl_s=ttl, **options)
    out = result.to_dict()
    if args.plot is not None:
        ttls = sorted({parse_duration(t, what="--sweep") for t in args.sweep.split(",") if t})
        if len(ttls) < 2:
            raise ConfigError("--sweep needs two or more TTLs")
        sims = sweep_ttl(requests, ttls, **options)
        try:
            hit_rate_chart(
                ttls,
                [
                    ("any worker", [s.boundary_hit_rate for s in sims]),
                    ("same worker", [s.same_worker_hit_rate for s in sims]),
                ],
                title=f"swa hit rate vs ttl: {args.workers} workers, {routing.value}",
                mark_ttl_s=ttl,
                path=args.plot,
            )
        except OSError as exc:
            raise ConfigError(f"cannot write {args.plot}: {exc}") from None
        out["plot"] = str(args.plot)
        out["sweep"] = [
            {
                "ttl_s": s.ttl_s,
                "exact_hit_rate": s.exact_hit_rate,
                "boundary_hit_rate": s.boundary_hit_rate,
                "same_worker_hit_rate": s.same_worker_hit_rate,
            }
            for s in sims
        ]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{out['requests']} requests over {out['duration_s']:.0f} s, {args.workers} workers, "
        f"{routing.value} routing, TTL {ttl} s, {args.state_bytes} bytes per state"
    )
    print(f"  continuations (store hit):  {out['continuations']}")
    print(f"  exact hit rate (state at the hit's end): {out['exact_hit_rate']:.1%}")
    print(f"  tokens replayed (bounded replay):        {out['replayed_tokens']}")
    print(f"  state at any boundary, any worker:       {out['boundary_hit_rate']:.1%}")
    print(f"  state at any boundary, same worker:      {out['same_worker_hit_rate']:.1%}")
    print(
        f"  hit rate, reachable only:   {out['reachable_hit_rate']:.1%} "
        f"({out['unreachable']} continuations no state could serve)"
    )
    print(f"  peak state bytes / worker:  {out['peak_bytes_per_worker'] / 2**20:.1f} MiB")
    print(f"  cross-worker fetches:       {out['fetch_bytes_per_s'] / 2**20:.2f} MiB/s")
    if args.plot is not None:
        print(f"  plot: {args.plot}")
    return 0
