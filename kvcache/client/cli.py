"""Client-side commands: ``kvcache up``, ``status``, ``down`` and ``demo``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvcache.errors import ConfigError
from kvcache.testing.localcluster import LocalCluster

__all__ = ["register"]

DEFAULT_ROOT = Path("kvcache-local")


def register(sub: Any) -> None:
    """Add the client subcommands to the ``kvcache`` parser."""
    up = sub.add_parser("up", help="start a local cluster of storage daemons")
    up.add_argument(
        "--dir", type=Path, default=DEFAULT_ROOT, help="cluster directory (default ./kvcache-local)"
    )
    up.add_argument("--nodes", type=int, default=12, help="daemons to start (default 12)")
    up.add_argument("--capacity", default="2GiB", help="capacity per daemon (default 2GiB)")
    up.add_argument(
        "--etcd",
        action="store_true",
        help="keep membership in an etcd of the cluster's own (needs the etcd binary: "
        "apt-get install etcd-server); daemons register under leases",
    )
    up.add_argument(
        "--lease-ttl", type=int, default=10, help="daemons' etcd lease seconds (default 10)"
    )
    up.add_argument(
        "--domains",
        type=int,
        default=0,
        metavar="N",
        help="spread the daemons over N failure domains host-0..host-N-1 (default: one each)",
    )
    up.set_defaults(func=_up)

    status = sub.add_parser("status", help="show the nodes of a local cluster")
    status.add_argument("--dir", type=Path, default=DEFAULT_ROOT)
    status.add_argument("--json", action="store_true", help="print raw JSON")
    status.set_defaults(func=_status)

    down = sub.add_parser("down", help="stop a local cluster")
    down.add_argument("--dir", type=Path, default=DEFAULT_ROOT)
    down.set_defaults(func=_down)

    demo = sub.add_parser(
        "demo",
        help="start a local cluster and replay a workload against it",
        description="Replays a seeded multi-turn agent/chat workload (or a Mooncake trace) "
        "against a fresh local cluster: match, load, prefill misses, store. Every loaded "
        "byte is verified.",
    )
    demo.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace to replay")
    demo.add_argument(
        "--trace-class", default="chat", help="traffic class for trace requests (default chat)"
    )
    demo.add_argument("--limit", type=int, help="replay only the first N requests")
    demo.add_argument(
        "--speed",
        type=float,
        default=0.0,
        help="time compression (e.g. 60 = 60x real time; 0 = no pacing)",
    )
    demo.add_argument(
        "--fault",
        help="a third of the way in: kill:N or pause:N daemons (paused ones resume at two "
        "thirds), or join:N new daemons",
    )
    demo.add_argument("--etcd", action="store_true", help="membership in an etcd of the demo's own")
    demo.add_argument("--lease-ttl", type=int, default=10, help="etcd lease seconds (default 10)")
    demo.add_argument("--nodes", type=int, default=12, help="daemons (default 12)")
    demo.add_argument(
        "--swa-workers", type=int, default=0, help="also run N workers' SWA tiers (default 0)"
    )
    demo.add_argument("--swa-ttl", type=float, default=180.0, help="SWA state life, trace seconds")
    demo.add_argument("--swa-state-bytes", type=int, default=2_801_664, help="bytes per state")
    demo.add_argument("--seed", type=int, default=7, help="seed of the generated workload")
    demo.add_argument("--capacity", default="4GiB", help="capacity per daemon")
    demo.add_argument("--dir", type=Path, help="cluster directory (default: a temporary one)")
    demo.add_argument("--json", type=Path, help="write the summary as a flat JSON object")
    demo.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="draw hit rate and load throughput over the replay into PNG (needs matplotlib)",
    )
    demo.set_defaults(func=_demo)


def _up(args: argparse.Namespace) -> int:
    if args.domains is not None and args.domains < 0:
        raise ConfigError(f"--domains must be >= 1 (0: one domain each), got {args.domains}")
    domains = [f"host-{i % args.domains}" for i in range(args.nodes)] if args.domains else None
    cluster = LocalCluster(args.dir).start(
        nodes=args.nodes,
        capacity=args.capacity,
        etcd=args.etcd,
        lease_ttl_s=args.lease_ttl,
        domains=domains,
    )
    where = (
        f" (membership in etcd {cluster.etcd_settings.endpoints[0]})"
        if cluster.etcd_settings
        else ""
    )
    print(f"{len(cluster.nodes)} nodes up{where}; cluster file: {cluster.cluster_file}")
    return 0


def _status(args: argparse.Namespace) -> int:
    cluster = LocalCluster.attach(args.dir)
    stats = cluster.node_stats()
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(format_status(stats))
    return 0 if all(s.get("up") for s in stats) else 1


def format_status(stats: list[dict[str, Any]]) -> str:
    """The ``kvcache status`` table from each node's ``/stats``: capacity, bytes, shards,
    and per class shards / bytes / shard hits (GET)."""
    lines = [
        f"{'node':<10} {'up':<4} {'shards':>9} {'bytes':>14} {'capacity':>14}  "
        "per class: shards / bytes / hits"
    ]
    for s in stats:
        if not s.get("up"):
            lines.append(f"{s['node']:<10} {'no':<4} {s.get('error', '')}")
            continue
        usage = s.get("usage", {})
        hits = s.get("hits", {}).get("get", {})
        classes = usage.get("classes", {})
        per_class = ", ".join(
            f"{name}: {classes.get(name, {}).get('shards', 0)} / "
            f"{classes.get(name, {}).get('bytes', 0):,} / {hits.get(name, 0)}"
            for name in sorted(set(classes) | set(hits))
        )
        lines.append(
            f"{s['node']:<10} {'yes':<4} {usage.get('shards', 0):>9} "
            f"{usage.get('used_bytes', 0):>14,} {usage.get('capacity_bytes', 0):>14,}  {per_class}"
        )
    return "\n".join(lines)


def _down(args: argparse.Namespace) -> int:
    LocalCluster.attach(args.dir).stop()
    print(f"stopped the cluster under {args.dir}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvcache.client.demo import run_cli  # the client is imported only when a demo runs

    return run_cli(args)
