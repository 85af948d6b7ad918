"""The cluster simulator's figures: balance, data moved, repair time and unreadability.

Runs ``kvcache.sim`` (the real placement and repair planner, no I/O) over clusters of
1,000 and 10,000 nodes, with and without failure domains of 40 nodes, and prints
each figure against issue 21's targets:

- balance: shards per node, max / mean, at 10,000 nodes [<= 1.10]: measured on the
  sample (beside a perfectly fair placement's figure for the same sample), and
  projected to a 100 TB node's 8.6 x 10⁹ shards from the placement's measured spread;
- data moved on one join, against the ideal 1/(N+1) [<= 1.2x];
- repair: hours to full redundancy after losing a node and a domain of 40, at the
  per-node repair rate ``bench/membership.py`` measured (``repair_gbps``), beside it;
- unreadable blocks per year, 10+2 / 8+4 / 3-way: the Markov chain against a Monte
  Carlo run of placed nodes and disks at accelerated rates [within 2x], then the
  chain at MTTF 4 years per node and per disk.

    python bench/sim.py --quick --json bench/results/sim.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, machine, parser, print_table, write_json

from kvcache.sim.balance import holders_of
from kvcache.sim.scenarios import (
    Samples,
    SimSettings,
    run_durability,
    run_move,
    run_repair,
)
from kvcache.sim.topology import Layout, sample_keys, synthetic_map

RESULTS = Path(__file__).resolve().parent / "results"


def placement_us_per_key(nodes: int, domain_size: int, keys: int) -> float:
    """CPU microseconds the real placement takes per key (fresh keys, no cache)."""
    import numpy as np

    cluster = synthetic_map(Layout(nodes=nodes, domain_size=domain_size))
    sample = sample_keys(keys, np.random.default_rng(nodes))
    start = time.process_time()
    holders_of(cluster, sample, width=12)
    return (time.process_time() - start) / keys * 1e6


def measured_membership() -> dict[str, Any]:
    """The repair figures bench/membership.py committed."""
    path = RESULTS / "membership.json"
    return dict(json.loads(path.read_text())) if path.exists() else {}


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    quick = args.quick
    keys = {1000: 10_000, 10000: 4_000} if quick else {1000: 60_000, 10000: 48_000}
    settings = SimSettings(
        keys=keys,
        mc_horizon_repairs=300.0 if quick else 1000.0,
        moved_shards=1000 if quick else 4000,
    )
    figures: dict[str, Any] = {"commit": commit(), "machine": machine(), "quick": quick}
    started = time.monotonic()
    for nodes in (1000, 10000):
        for dom in (0, 40):
            name = f"placement_us_per_key_{nodes}{'_domains' if dom else ''}"
            figures[name] = placement_us_per_key(nodes, dom, 400 if nodes == 1000 else 100)
    samples: Samples = {}
    figures.update(run_move(settings, samples=samples))
    print(f"# balance and moves done at {time.monotonic() - started:.0f} s", flush=True)
    figures.update(run_repair(settings, samples=samples))
    print(f"# repair done at {time.monotonic() - started:.0f} s", flush=True)
    figures.update(run_durability(settings))
    print(f"# durability done at {time.monotonic() - started:.0f} s", flush=True)
    member = measured_membership()
    figures["membership_repair_gbps"] = member.get("repair_gbps", float("nan"))
    figures["membership_load_p99_repair_ratio"] = member.get("load_p99_repair_ratio", float("nan"))

    f = figures
    rows = []
    for n in (1000, 10000):
        for d in ("", "_domains"):
            p = f"balance_{n}{d}"
            rows.append(
                [
                    f"{n:,}{' in racks of 40' if d else ''}",
                    f"{f[p + '_keys']:,}",
                    f"{f[p + '_mean_per_node']:.0f}",
                    f"{f[p + '_max_over_mean']:.3f}",
                    f"{f[p + '_null_max_over_mean']:.3f} (p95 {f[p + '_null_max_over_mean_p95']:.3f})",
                    f"{f[p + '_dispersion']:.3f}",
                    f"{f[p + '_structural_spread_upper']:.4f}",
                    f"{f[p + '_projected_max_over_mean']:.4f}",
                ]
            )
    print_table(
        "Balance: shards per node (10+2), measured on the sample and projected to a 100 TB node",
        ["nodes", "keys", "shards/node", "max/mean", "fair placement, same sample", "var/mean", "spread (95% bound)", "projected max/mean"],
        rows,
    )  # fmt: skip
    rows = []
    for change in ("join", "leave"):
        for n in (1000, 10000):
            for d in ("", "_domains"):
                q = f"move_{change}_{n}{d}"
                rows.append(
                    [
                        change,
                        f"{n:,}{' in racks of 40' if d else ''}",
                        f"{f[q + '_moved_fraction']:.3e}",
                        f"{f[q + '_ideal_fraction']:.3e}",
                        f"{f[q + '_ratio_to_ideal']:.2f}",
                        f"{f[q + '_moved_per_node_slot']:.3f} ({f[q + '_node_slots']:.0f} slots, {f[q + '_changes']:.0f} {change}s)",
                    ]
                )
    print_table(
        "Data moved on one join / one leave",
        ["change", "nodes", "moved", "ideal", "moved / ideal", "moved per slot the node takes/gives"],
        rows,
    )  # fmt: skip
    rows = []
    for what in ("node", "domain"):
        for n in (1000, 10000):
            for d in ("", "_domains"):
                q = f"repair_{what}_{n}{d}"
                rows.append(
                    [
                        f"{what}{' (40 nodes)' if what == 'domain' else ''}",
                        f"{n:,}{' in racks of 40' if d else ''}",
                        f"{f[q + '_traffic_per_lost_shard']:.2f}",
                        f"{f[q + '_source_nodes']:.0f} / {f[q + '_target_nodes']:.0f}",
                        f"{f[q + '_unrecoverable_fraction']:.4f}",
                        f"{f[q + '_hours']:.2f}",
                        f"{f[q + '_hours_at_nic_room']:.2f}",
                        f"{f[q + '_nic_share']:.2f}",
                    ]
                )
    print_table(
        f"Repair at {settings.per_node_gbps} GB/s per node (membership.json repair_gbps "
        f"{f['membership_repair_gbps']:.3f}; load p99 {f['membership_load_p99_repair_ratio']:.2f}x during it), "
        "100 TB per node, foreground 10 TiB/s read + 850 GiB/s write",
        ["lost", "nodes", "shards moved per lost shard", "source / target nodes (sample)", "blocks unrecoverable", "hours to full redundancy", "hours at the NIC's room", "NIC share"],
        rows,
    )  # fmt: skip
    rows = []
    for s in ("10p2", "8p4", "3x"):
        q = f"durability_{s}"
        rows.append(
            [
                s.replace("p", "+"),
                f"{f[q + '_fast_markov_per_hour']:.3e}",
                f"{f[q + '_fast_mc_per_hour']:.3e} ({f[q + '_fast_mc_events']:.0f} events)",
                f"{f[q + '_fast_mc_over_markov']:.3f}",
                f"{f[q + '_node_repair_hours']:.2f} / {f[q + '_disk_repair_hours']:.2f}",
                f"{f[q + '_unreadable_per_year']:.2e}",
                f"{f[q + '_unreadable_per_lifetime']:.2e}",
            ]
        )
    print_table(
        "Unreadable blocks: accelerated check (MTTF 200 h per node, 800 h per disk, repair 10 h / 1.25 h) "
        "and the realistic chain (MTTF 4 y per node and per disk, 8 disks, 1,000 nodes)",
        ["scheme", "Markov, per stripe-hour", "Monte Carlo", "MC / Markov", "repair h (node / disk)", "unreadable per year", "per 3-day life"],
        rows,
    )  # fmt: skip
    worst_balance = max(
        f["balance_10000_projected_max_over_mean"],
        f["balance_10000_domains_projected_max_over_mean"],
    )
    join = max(f["move_join_10000_moved_per_node_slot"], f["move_join_1000_moved_per_node_slot"])
    join_dom = max(
        f["move_join_10000_domains_moved_per_node_slot"],
        f["move_join_1000_domains_moved_per_node_slot"],
    )
    ratios = [f[f"durability_{s}_fast_mc_over_markov"] for s in ("10p2", "8p4", "3x")]
    f["target_balance_10000"] = worst_balance
    f["target_join_moved_per_ideal"] = join
    f["target_join_moved_per_ideal_domains"] = join_dom
    f["target_mc_over_markov_worst"] = max(max(ratios), 1 / min(ratios))
    print_table(
        "Simulator targets (issue 21)",
        ["figure", "value", "target", "met"],
        [
            ["balance max/mean at 10,000 nodes (projected; worst of with/without domains)", f"{worst_balance:.4f}", "<= 1.10", str(worst_balance <= 1.10)],
            ["data moved on one join / ideal, no domains (worst size)", f"{join:.2f}", "<= 1.2", str(join <= 1.2)],
            ["data moved on one join / ideal, racks of 40 (worst size)", f"{join_dom:.2f}", "<= 1.2", str(join_dom <= 1.2)],
            ["Markov vs Monte Carlo (worst factor)", f"{f['target_mc_over_markov_worst']:.2f}", "<= 2", str(f["target_mc_over_markov_worst"] <= 2)],
        ],
    )  # fmt: skip
    print_table(
        "Placement cost (CPU per key, 12 positions; O(nodes) per key)",
        ["nodes", "no domains", "racks of 40"],
        [[f"{n:,}", f"{f[f'placement_us_per_key_{n}']:.0f} us", f"{f[f'placement_us_per_key_{n}_domains']:.0f} us"] for n in (1000, 10000)],
    )  # fmt: skip
    f["wall_seconds"] = time.monotonic() - started
    write_json(args.json, f)


if __name__ == "__main__":
    main()
