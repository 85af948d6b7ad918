"""``kvcache retention`` (also installed as ``kvcache-retention``): show, change and simulate
the retention policy of a cluster.

    kvcache retention show     --cluster cluster.toml
    kvcache retention set      --cluster cluster.toml --classes agent=3d,chat=7d,default=3d
    kvcache retention reset    --cluster cluster.toml
    kvcache retention usage    --cluster cluster.toml
    kvcache retention simulate --trace trace.jsonl --classes agent=3d,chat=7d [--sweep 1h,1d,3d,7d]
                               [--plot ttl.png]
    kvcache retention plan     --trace trace.jsonl --classes agent=3d,chat=7d [--nodes 12]
    kvcache retention generate --days 7 --out trace.jsonl [--seed 1 --agent-rate 6 --chat-rate 12]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcache.cluster import ClusterMap
from kvcache.credentials import Credentials
from kvcache.errors import ConfigError, KVCacheError
from kvcache.logs import add_logging_flags, configure_logging
from kvcache.retention.policy import RetentionPolicy, parse_duration
from kvcache.retention.simulate import SimulationResult, simulate

if TYPE_CHECKING:
    from kvcache.workload import Request

__all__ = ["main", "register"]

DEFAULT_CLUSTER = Path("kvcache-local/cluster.toml")


def register(sub: Any) -> None:
    """Add ``retention`` and its subcommands to the ``kvcache`` parser."""
    parser = sub.add_parser("retention", help="show, change and simulate the retention policy")
    _add_subcommands(parser)


def _add_subcommands(parser: argparse.ArgumentParser) -> None:
    rsub = parser.add_subparsers(dest="retention_command", metavar="ACTION", required=True)

    def with_cluster(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument(
            "--cluster",
            type=Path,
            default=DEFAULT_CLUSTER,
            help="cluster file (default %(default)s)",
        )
        p.add_argument(
            "--credentials",
            type=Path,
            help="credentials file with the admin token (default: credentials.toml next to the "
            "cluster file, when there is one)",
        )
        p.add_argument(
            "--token",
            default=os.environ.get("KVCACHE_ADMIN_TOKEN", ""),
            help="admin token, instead of a credentials file (env KVCACHE_ADMIN_TOKEN)",
        )
        return p

    with_cluster(rsub.add_parser("show", help="each node's policy")).set_defaults(func=_show)
    setp = with_cluster(rsub.add_parser("set", help="set the policy on every node"))
    setp.add_argument("--classes", required=True, help="e.g. agent=3d,chat=7d,default=3d")
    setp.add_argument(
        "--default-class",
        help="class for unknown names (default: 'default' if listed, else the longest)",
    )
    setp.add_argument(
        "--ttl-bounds",
        help="the TTLs hints may ask for, per class: e.g. chat=1h..14d,agent=10m..5d; 'none' "
        "clears them (default: each node keeps its bounds for the classes still listed)",
    )
    setp.set_defaults(func=_set)
    with_cluster(
        rsub.add_parser("reset", help="back to each node's configured policy")
    ).set_defaults(func=_reset)
    with_cluster(
        rsub.add_parser("usage", help="shards and bytes per class across the cluster")
    ).set_defaults(func=_usage)
    sim = rsub.add_parser("simulate", help="hit rate and capacity of a policy on a request trace")
    sim.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    sim.add_argument("--trace-class", default="chat", help="class of trace records without one")
    sim.add_argument("--classes", default="agent=3d,chat=7d,default=3d", help="policy to simulate")
    sim.add_argument("--sweep", help="also try one TTL for every class: e.g. 10m,1h,1d,3d,7d")
    sim.add_argument(
        "--block-bytes", type=int, default=112 * 1024, help="payload bytes per 512-token block"
    )
    sim.add_argument(
        "--touch-resolution",
        default="60s",
        help="the daemons' touch_resolution_s: slides shorter than this are not written "
        "(default %(default)s, as the daemons)",
    )
    sim.add_argument(
        "--capacity-blocks",
        type=int,
        help="also bound the cluster to this many live blocks (the daemons' watermark "
        "eviction), and report the blocks evicted before their TTL",
    )
    sim.add_argument(
        "--replay-keys",
        action="store_true",
        help="order expiry ties by the block keys a replay of the trace writes "
        "(kvcache.workload.replay_namespace at --block-bytes), as the daemons order them: the "
        "figures are then exactly a replayed cluster's; without it, by a scrambled block id",
    )
    sim.add_argument("--json", action="store_true", help="print JSON")
    sim.add_argument(
        "--plot",
        type=Path,
        metavar="PNG",
        help="draw hit rate and stored bytes against the --sweep TTLs, per class, into PNG",
    )
    sim.set_defaults(func=_simulate)
    plan = rsub.add_parser(
        "plan",
        help="the capacity at which no class is evicted before its TTL, and what less costs",
    )
    plan.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    plan.add_argument("--trace-class", default="chat", help="class of trace records without one")
    plan.add_argument("--classes", default="agent=3d,chat=7d,default=3d", help="policy to plan for")
    plan.add_argument(
        "--block-bytes", type=int, default=112 * 1024, help="payload bytes per 512-token block"
    )
    plan.add_argument("--nodes", type=int, default=12, help="daemons the capacity is spread over")
    plan.add_argument("--high-watermark", type=float, default=0.9, help="the daemons' (0.9)")
    plan.add_argument("--low-watermark", type=float, default=0.8, help="the daemons' (0.8)")
    plan.add_argument("--touch-resolution", default="60s", help="the daemons' (60s)")
    plan.add_argument(
        "--replay-keys",
        action="store_true",
        help="order expiry ties by the block keys a replay of the trace writes "
        "(kvcache.workload.replay_namespace at --block-bytes), as the daemons order them: the "
        "figures are then exactly a replayed cluster's; without it, by a scrambled block id",
    )
    plan.add_argument("--json", action="store_true", help="print JSON")
    plan.set_defaults(func=_plan)
    gen = rsub.add_parser("generate", help="write a multi-day agent and chat trace")
    gen.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    gen.add_argument("--days", type=float, default=7.0)
    gen.add_argument("--seed", type=int, default=1)
    gen.add_argument("--agent-rate", type=float, default=6.0, help="agent sessions per hour")
    gen.add_argument("--chat-rate", type=float, default=12.0, help="chat sessions per hour")
    gen.add_argument("--chat-return", type=float, default=0.6, help="chance a chat comes back")
    gen.add_argument("--agent-return", type=float, default=0.1, help="chance an agent comes back")
    gen.set_defaults(func=_generate)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvcache-retention``."""
    parser = argparse.ArgumentParser(
        prog="kvcache-retention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_logging_flags(parser)
    _add_subcommands(parser)
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level, args.log_format)
        return int(args.func(args))
    except KVCacheError as exc:
        print(f"kvcache-retention: error: {exc}", file=sys.stderr)
        return 1


def _policy(classes: str, default_class: str | None, ttl_bounds: object = None) -> RetentionPolicy:
    table: dict[str, Any] = {"classes": classes}
    if default_class:
        table["default_class"] = default_class
    if ttl_bounds:
        table["ttl_bounds"] = ttl_bounds
    return RetentionPolicy.from_mapping(table, source="--classes/--ttl-bounds")


def _call(url: str, method: str, token: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        raise KVCacheError(f"{method} {url}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise KVCacheError(f"{method} {url}: {exc}") from None


def _token(args: argparse.Namespace, method: str) -> str:
    """The admin token: --token, else the credentials file's (needed for changes only)."""
    if args.token:
        return str(args.token)
    path = args.credentials or Path(args.cluster).parent / "credentials.toml"
    if args.credentials is None and not path.exists():
        if method != "GET":
            raise KVCacheError(
                "changing the policy needs the admin token: pass --credentials FILE (the "
                "cluster's credentials.toml) or --token"
            )
        return ""
    token = Credentials.load(path).admin_token
    if token is None and method != "GET":
        raise KVCacheError(f"{path} holds no admin_token")
    return token or ""


def _one_node(
    args: argparse.Namespace, node_id: str, method: str, path: str, body: dict[str, Any]
) -> list[tuple[str, Any]]:
    """``_each_node`` for the node ``node_id`` only (a body of its own)."""
    for node in ClusterMap.load(args.cluster).nodes:
        if node.id == node_id:
            try:
                return [(node.id, _call(node.admin + path, method, _token(args, method), body))]
            except KVCacheError as exc:
                return [(node.id, exc)]
    return [(node_id, KVCacheError("no longer in the cluster file"))]


def _each_node(
    args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None
) -> list[tuple[str, Any]]:
    cluster = ClusterMap.load(args.cluster)
    _token(args, method)  # a missing token is one clear error, not one per node
    out: list[tuple[str, Any]] = []
    for node in cluster.nodes:
        if not node.admin:
            out.append((node.id, KVCacheError("no admin address in the cluster file")))
            continue
        try:
            out.append((node.id, _call(node.admin + path, method, _token(args, method), body)))
        except KVCacheError as exc:
            out.append((node.id, exc))
    return out


def _print_policies(results: list[tuple[str, Any]]) -> int:
    seen = set()
    for node, res in results:
        if isinstance(res, Exception):
            print(f"{node:<12} error: {res}")
            continue
        classes = ", ".join(f"{k}={_human(v)}" for k, v in sorted(res["classes"].items()))
        bounds = ", ".join(
            f"{k}={_human(lo)}..{_human(hi)}"
            for k, (lo, hi) in sorted(res.get("ttl_bounds", {}).items())
        )
        more = f"; ttl bounds: {bounds}" if bounds else ""
        print(f"{node:<12} {classes}  (default class: {res['default_class']}{more})")
        seen.add(json.dumps(res, sort_keys=True))
    if len(seen) > 1:
        print("warning: nodes disagree on the policy", file=sys.stderr)
    return 0 if all(not isinstance(r, Exception) for _, r in results) else 1


def _show(args: argparse.Namespace) -> int:
    return _print_policies(_each_node(args, "GET", "/retention"))


def _set(args: argparse.Namespace) -> int:
    """PUT the policy on every node. The bounds of ``--ttl-bounds`` (``none``: none), else
    each node's own for the classes still listed: a policy PUT replaces the whole policy,
    and ``set --classes`` alone used to erase bounds an operator had configured."""
    if args.ttl_bounds is not None and args.ttl_bounds.strip().lower() != "none":
        policy = _policy(args.classes, args.default_class, args.ttl_bounds)
        return _print_policies(_each_node(args, "PUT", "/retention", policy.to_dict()))
    base = _policy(args.classes, args.default_class)
    if args.ttl_bounds is not None:  # "none": cleared everywhere
        return _print_policies(_each_node(args, "PUT", "/retention", base.to_dict()))
    results: list[tuple[str, Any]] = []
    for node, current in _each_node(args, "GET", "/retention"):
        if isinstance(current, Exception):
            results.append((node, current))
            continue
        kept = {
            name: pair
            for name, pair in dict(current.get("ttl_bounds") or {}).items()
            if name in base.classes
        }
        policy = _policy(args.classes, args.default_class, kept)
        results += _one_node(args, node, "PUT", "/retention", policy.to_dict())
    return _print_policies(results)


def _reset(args: argparse.Namespace) -> int:
    return _print_policies(_each_node(args, "DELETE", "/retention"))


def _usage(args: argparse.Namespace) -> int:
    totals: dict[str, dict[str, int]] = {}
    failed = 0
    for node, res in _each_node(args, "GET", "/stats"):
        if isinstance(res, Exception):
            print(f"{node}: error: {res}", file=sys.stderr)
            failed += 1
            continue
        for name, c in res.get("usage", {}).get("classes", {}).items():
            t = totals.setdefault(name, {"shards": 0, "bytes": 0})
            t["shards"] += int(c.get("shards", 0))
            t["bytes"] += int(c.get("bytes", 0))
    print(f"{'class':<16} {'shards':>10} {'bytes':>16}")
    for name, t in sorted(totals.items()):
        print(f"{name:<16} {t['shards']:>10} {t['bytes']:>16,}")
    return 1 if failed else 0


def _replay_tie_key(
    args: argparse.Namespace, requests: list[Request]
) -> Callable[[int], bytes] | None:
    """With ``--replay-keys``, each block id's key in a replay of ``requests``."""
    if not args.replay_keys:
        return None
    from kvcache.workload import replay_keys, replay_namespace

    return replay_keys(requests, replay_namespace(args.block_bytes)).__getitem__


def _simulate(args: argparse.Namespace) -> int:
    from kvcache.workload import read_trace

    requests = list(read_trace(args.trace, traffic_class=args.trace_class))
    if not requests:
        raise ConfigError(f"{args.trace} holds no requests")
    if args.plot is not None and not args.sweep:
        raise ConfigError("--plot draws the --sweep TTLs: give --sweep, e.g. 10m,1h,1d,3d,7d")
    candidates: list[tuple[str, RetentionPolicy, int | None]] = [
        (args.classes, _policy(args.classes, None), None)
    ]
    for ttl in args.sweep.split(",") if args.sweep else []:
        seconds = parse_duration(ttl.strip(), what="--sweep")
        names = {r.traffic_class for r in requests} | {"default"}
        policy = RetentionPolicy(classes={n: seconds for n in names}, default_class="default")
        candidates.append((f"all={ttl.strip()}", policy, seconds))
    tie_key = _replay_tie_key(args, requests)
    rows: list[dict[str, Any]] = []
    swept: list[tuple[int, SimulationResult]] = []
    for label, policy, ttl_s in candidates:
        res = simulate(
            requests,
            policy,
            touch_resolution_s=parse_duration(args.touch_resolution, what="--touch-resolution"),
            capacity_blocks=args.capacity_blocks,
            tie_key=tie_key,
        )
        if ttl_s is not None:
            swept.append((ttl_s, res))
        rows.append(
            {
                "policy": label,
                "hit_rate": res.hit_rate,
                "peak_blocks": res.peak_blocks,
                "peak_stored_bytes": res.stored_bytes(args.block_bytes),
                "mean_stored_bytes": res.stored_bytes(args.block_bytes, peak=False),
                "expirations": res.expirations,
                "evicted_before_ttl": res.evicted_before_ttl,
                "classes": {
                    name: {
                        "hit_rate": c.hit_rate,
                        "evicted_before_ttl": c.evicted_before_ttl,
                        "peak_stored_bytes": c.stored_bytes(args.block_bytes),
                        "mean_stored_bytes": c.stored_bytes(args.block_bytes, peak=False),
                    }
                    for name, c in res.classes.items()
                },
            }
        )
    if args.plot is not None:
        _plot_sweep(swept, args.block_bytes, args.plot, title=f"{args.trace.name}: TTL sweep")
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    if args.json:
        print(json.dumps({"requests": len(requests), "span_s": span_s, "results": rows}, indent=2))
        return 0
    print(f"{len(requests)} requests over {_human(int(span_s))} of trace time")
    print(
        f"{'policy':<34} {'hit rate':>9} {'peak blocks':>12} {'peak stored':>12} {'mean stored':>12}"
    )
    for r in rows:
        print(
            f"{r['policy']:<34} {r['hit_rate']:>9.1%} {r['peak_blocks']:>12,} "
            f"{r['peak_stored_bytes'] / 1e9:>10.2f}GB {r['mean_stored_bytes'] / 1e9:>10.2f}GB"
        )
    if args.capacity_blocks is not None:
        for r in rows:
            print(
                f"{r['policy']}: {r['evicted_before_ttl']:,} blocks evicted before their TTL at "
                f"{args.capacity_blocks:,} blocks of capacity"
            )
    if args.plot is not None:
        print(f"plot written to {args.plot}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from kvcache.retention.plan import plan_capacity
    from kvcache.workload import read_trace

    requests = list(read_trace(args.trace, traffic_class=args.trace_class))
    if not requests:
        raise ConfigError(f"{args.trace} holds no requests")
    if args.nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {args.nodes}")
    plan = plan_capacity(
        requests,
        _policy(args.classes, None),
        block_bytes=args.block_bytes,
        nodes=args.nodes,
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
        touch_resolution_s=parse_duration(args.touch_resolution, what="--touch-resolution"),
        tie_key=_replay_tie_key(args, requests),
    )
    full = plan.full
    points: list[dict[str, Any]] = [
        {
            "fraction": p.fraction,
            "capacity_blocks": p.capacity_blocks,
            "node_bytes": plan.capacity_for(p.fraction),
            "hit_rate": p.result.hit_rate,
            "hit_rate_lost_pp": p.lost_pp(full),
            "evicted_before_ttl": p.result.evicted_before_ttl,
            "classes": {
                name: {"hit_rate": c.hit_rate, "evicted_before_ttl": c.evicted_before_ttl}
                for name, c in p.result.classes.items()
            },
        }
        for p in plan.points
    ]
    if args.json:
        print(json.dumps({
            "requests": len(requests), "classes": args.classes,
            "capacity_blocks": plan.capacity_blocks, "total_bytes": plan.total_bytes,
            "node_bytes": plan.node_bytes, "nodes": plan.nodes, "hit_rate": full.hit_rate,
            "points": points,
        }, indent=2))  # fmt: skip
        return 0
    span_s = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000
    print(f"{len(requests)} requests over {span_s / 86400:.2f} days of trace time, {args.classes}")
    print(
        f"capacity at which no class is evicted before its TTL: {plan.capacity_blocks:,} blocks "
        f"= {plan.total_bytes / 1e9:.2f} GB with the {plan.k} + {plan.m} overhead, "
        f"{plan.node_bytes / 1e9:.3f} GB on each of {plan.nodes} nodes; hit rate {full.hit_rate:.1%}"
    )
    for p in points:
        per_class = ", ".join(
            f"{name} {c['evicted_before_ttl']:,}" for name, c in p["classes"].items()
        )
        print(
            f"at {p['fraction']:.0%} ({p['node_bytes'] / 1e9:.3f} GB a node): hit rate "
            f"{p['hit_rate']:.1%} ({-p['hit_rate_lost_pp']:+.2f} pp), "
            f"{p['evicted_before_ttl']:,} blocks evicted before their TTL ({per_class})"
        )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from kvcache.retention.tracegen import TraceModel, generate_trace, write_trace

    model = TraceModel(
        days=args.days, seed=args.seed, agent_rate=args.agent_rate, chat_rate=args.chat_rate,
        chat_return=args.chat_return, agent_return=args.agent_return,
    )  # fmt: skip
    n = write_trace(generate_trace(model), args.out)
    print(f"{n} requests over {args.days:g} days written to {args.out}")
    return 0


def _plot_sweep(
    swept: list[tuple[int, SimulationResult]], block_bytes: int, path: Path, *, title: str
) -> None:
    """Hit rate and mean stored bytes per class (and for the whole trace) against TTL."""
    from kvcache.plots import RetentionPoint, retention_figure, write_png

    curves: dict[str, list[RetentionPoint]] = {}
    for ttl_s, res in swept:
        for name, c in res.classes.items():
            curves.setdefault(name, []).append(
                RetentionPoint(
                    ttl_s=ttl_s,
                    hit_rate=c.hit_rate,
                    stored_bytes=c.stored_bytes(block_bytes, peak=False),
                )
            )
        if len(res.classes) > 1:
            curves.setdefault("all", []).append(
                RetentionPoint(
                    ttl_s=ttl_s,
                    hit_rate=res.hit_rate,
                    stored_bytes=res.stored_bytes(block_bytes, peak=False),
                )
            )
    write_png(retention_figure(curves, title=title), path)


def _human(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
