"""``kvcache sim balance|move|repair|durability``: the cluster simulator from the shell.

Each subcommand runs one of :mod:`kvcache.sim.scenarios` with the settings given as
flags and prints its figures (name, value), or writes them as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcache.errors import ArgumentError
from kvcache.sim.scenarios import (
    SCHEMES,
    SimSettings,
    run_balance,
    run_durability,
    run_move,
    run_repair,
)

__all__ = ["register", "settings_from_args"]

_RUNS: dict[str, tuple[Callable[[SimSettings], dict[str, float]], str]] = {
    "balance": (run_balance, "shards per node, max / mean, with and without failure domains"),
    "move": (run_move, "shards moved on a join and on a leave, against the ideal 1/N"),
    "repair": (run_repair, "time to full redundancy after losing a node and a failure domain"),
    "durability": (run_durability, "unreadable blocks per year: Markov chain and Monte Carlo"),
}


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def register(subparsers: Any) -> None:
    """Add the ``sim`` subcommand and its four questions to the ``kvcache`` parser."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sim",
        help="simulate placement, moves, repair and durability of a 1,000-10,000-node cluster",
        description="Run the real placement and repair planner, without I/O, over a synthetic "
        "cluster of many nodes (docs/benchmarks.md, Simulator).",
    )
    sub = parser.add_subparsers(dest="sim_command", metavar="QUESTION", required=True)
    d = SimSettings()
    for name, (_, text) in _RUNS.items():
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--nodes", type=_ints, default=d.nodes, help="cluster sizes (1000,10000)")
        p.add_argument(
            "--keys",
            type=_ints,
            help="sampled keys per cluster size, one per --nodes entry "
            f"(default {d.keys[1000]} at 1,000 nodes, {d.keys[10000]} at 10,000)",
        )
        p.add_argument("--domain-size", type=int, default=d.domain_size, help="nodes per domain")
        p.add_argument("--seed", type=int, default=d.seed, help="random seed of the key samples")
        p.add_argument(
            "--scheme", choices=sorted(SCHEMES), default=d.scheme, help="redundancy (default 10+2)"
        )
        p.add_argument("--node-tb", type=float, default=d.node_bytes / 1e12, help="TB per node")
        p.add_argument(
            "--disks-per-node", type=int, default=d.disks_per_node, help="disks a node's TB span"
        )
        p.add_argument(
            "--per-node-gbps",
            type=float,
            default=d.per_node_gbps,
            help="repair GB/s per node (default: bench/membership.py repair_gbps)",
        )
        p.add_argument("--nic-gbps", type=float, default=d.nic_gbps, help="NIC GB/s per node")
        p.add_argument(
            "--read-gibps", type=float, default=d.read_gibps,
            help="deployment-wide foreground reads, GiB/s (beside repair)",
        )  # fmt: skip
        p.add_argument(
            "--write-gibps", type=float, default=d.write_gibps,
            help="deployment-wide foreground writes, GiB/s",
        )  # fmt: skip
        p.add_argument(
            "--detect-s", type=float, default=d.detect_s,
            help="seconds before a lost holder counts as gone (repair_down_after_s)",
        )  # fmt: skip
        p.add_argument(
            "--node-mttf-years", type=float, default=d.node_mttf_years,
            help="mean time to failure of a node",
        )  # fmt: skip
        p.add_argument(
            "--disk-mttf-years", type=float, default=d.disk_mttf_years,
            help="mean time to failure of a disk",
        )  # fmt: skip
        p.add_argument(
            "--lifetime-days", type=float, default=d.lifetime_days,
            help="how long a block lives (its retention)",
        )  # fmt: skip
        p.add_argument(
            "--durability-nodes", type=int, default=d.durability_nodes,
            help="nodes of the durability figure's cluster",
        )  # fmt: skip
        p.add_argument("--json", type=Path, help="write the figures as a JSON object here")
        p.set_defaults(func=run, sim_run=name)


def settings_from_args(args: argparse.Namespace) -> SimSettings:
    """The settings the flags describe."""
    keys = SimSettings().keys
    if args.keys is not None:
        if len(args.keys) != len(args.nodes):
            raise ArgumentError(
                f"--keys names {len(args.keys)} counts for {len(args.nodes)} --nodes sizes"
            )
        keys = dict(zip(args.nodes, args.keys, strict=True))
    return SimSettings(
        nodes=args.nodes,
        keys=keys,
        domain_size=args.domain_size,
        seed=args.seed,
        scheme=args.scheme,
        node_bytes=args.node_tb * 1e12,
        disks_per_node=args.disks_per_node,
        per_node_gbps=args.per_node_gbps,
        nic_gbps=args.nic_gbps,
        read_gibps=args.read_gibps,
        write_gibps=args.write_gibps,
        detect_s=args.detect_s,
        node_mttf_years=args.node_mttf_years,
        disk_mttf_years=args.disk_mttf_years,
        lifetime_days=args.lifetime_days,
        durability_nodes=args.durability_nodes,
    )


def run(args: argparse.Namespace) -> int:
    """Run one question and print (or write) its figures."""
    settings = settings_from_args(args)
    figures = _RUNS[args.sim_run][0](settings)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    width = max(len(k) for k in figures)
    for name in sorted(figures):
        sys.stdout.write(f"{name:<{width}}  {figures[name]:.6g}\n")
    return 0
