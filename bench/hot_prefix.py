"""Where a workload's shards and reads land, with placement groups and without (issue 21).

Placement groups (block keys v2) give the blocks of one group the placement tag of the
group's first block, so a call for a prompt's blocks touches about 12 nodes a group. The
price: every prompt that shares a group's first block shares its holders for the rest of
that group, even where the prompts differ. A system prompt shared by many conversations,
ending inside the first group, sends the different continuations of all of them to the
same 12 nodes. This benchmark measures that on workloads, with the real key chain
(:func:`kvcache.keys.block_keys`) and the real placement (:class:`kvcache.placement.Placement`):

- ``groups of 64``: the keys as the client makes them (DeepSeek V4.1's 112 KiB blocks of
  128 tokens: groups of 64 blocks, 8,192 tokens);
- ``groups of 16``, ``groups of 4``: the same chain with smaller groups (what-ifs: the
  chain of :func:`kvcache.keys.block_keys` with another group size);
- ``first group per key``: groups of 64, but the first 64 blocks of a prompt (where
  conversations share a system prompt) each placed by a tag of its own (a what-if);
- ``per key``: every key placed by a tag of its own (what block keys v1 did).

Per workload, rule and cluster size it prints the shards each node holds (each distinct
block's 12 shards) and the shards each node serves (every request loads its full prefix
once: 12 asks a block), as max / mean over the nodes, and the cost side of the trade: the
nodes a 64-block call asks (each request's prefix cut in 64-block calls; issue 21 bounds
it). A uniform spread gives max / mean near 1.

Workloads: the shared trace (``--trace``, Mooncake's synthetic release: few prompts share a
first block), and generated agent + chat conversations whose classes share a system prompt
(:func:`kvcache.workload.generate_workload`) of ``--system-tokens`` tokens each (several
values), ``--conversations`` of them. Usage::

    python bench/hot_prefix.py [--trace PATH] [--nodes 48,1000] [--conversations N]
                               [--system-tokens 2048,5120,11776] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import commit, machine, print_table, write_json

from kvcache.cluster import ClusterMap, NodeInfo
from kvcache.keys import BLOCK_TAG, PLACEMENT_TAG_BYTES, BlockKey, Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.placement import Placement
from kvcache.workload import Request, WorkloadSpec, generate_workload, read_trace, tokens_for

WIDTH = 12
#: DeepSeek V4.1 Flash's prefix-cacheable group: 128 tokens x 896 bytes (112 KiB blocks).
LAYOUT = KVLayout(
    tokens_per_block=128, bytes_per_token=896, dtype=DType.BFLOAT16, layers_in_block=1
)


#: Rules: (name, group size, blocks from a prompt's start placed alone).
RULES = [
    ("groups of 64", 64, 0),
    ("groups of 16", 16, 0),
    ("groups of 4", 4, 0),
    ("first group per key", 64, 64),
    ("per key", 1, 0),
]


def chain(space: Namespace, tokens: np.ndarray, group: int) -> list[bytes]:
    """:func:`kvcache.keys.block_keys`'s chain with groups of ``group`` blocks."""
    if group == space.group_blocks:
        return [bytes(k) for k in block_keys(space, tokens)]
    step = space.tokens_per_block * 4
    raw = tokens[: len(tokens) // space.tokens_per_block * space.tokens_per_block].tobytes()
    parent, out, tag = space.seed, [], PLACEMENT_TAG_BYTES
    for i, start in enumerate(range(0, len(raw), step)):
        own = xxhash.xxh3_128_digest(BLOCK_TAG + parent + raw[start : start + step])
        parent = own if i % group == 0 else parent[:tag] + own[tag:]
        out.append(parent)
    return out


def own_tag(key: bytes) -> bytes:
    """``key`` with a placement tag of its own (a hash of the whole key): no group."""
    return xxhash.xxh3_64_digest(key)[:PLACEMENT_TAG_BYTES] + key[PLACEMENT_TAG_BYTES:]


def prompt_keys(
    requests: list[Request], space: Namespace, group: int, alone: int
) -> list[list[bytes]]:
    """Each request's full blocks' keys as placed under a rule: the chain with groups of
    ``group``, the first ``alone`` blocks with tags of their own."""
    out = []
    for r in requests:
        keys = chain(space, tokens_for(r), group)
        out.append([own_tag(k) if i < alone else k for i, k in enumerate(keys)])
    return out


def spread(per_request: list[list[bytes]], nodes: int) -> dict[str, float]:
    """Shards held and served per node (max / mean, the top node's share), and the nodes
    a 64-block call asks (mean over the calls)."""
    cluster = ClusterMap(
        epoch=1,
        nodes=tuple(
            NodeInfo(id=f"node-{i:04d}", data=f"tcp://127.0.0.1:{10000 + i}") for i in range(nodes)
        ),
    )
    placement = Placement(cluster, width=WIDTH)
    distinct = sorted({k for keys in per_request for k in keys})
    placed = {k: i for i, k in enumerate(distinct)}
    asked = [BlockKey(k) for k in distinct]
    holders = np.concatenate(
        [placement.holders(asked[i : i + 4096]) for i in range(0, len(asked), 4096)]
    )
    held = np.bincount(holders.ravel(), minlength=nodes).astype(np.float64)
    uses = np.zeros(len(distinct), np.int64)
    for keys in per_request:
        uses[[placed[k] for k in keys]] += 1
    served = np.bincount(
        holders.ravel(), weights=np.repeat(uses, WIDTH).astype(np.float64), minlength=nodes
    )
    fan_out = [
        len(np.unique(holders[[placed[k] for k in keys[i : i + 64]]]))
        for keys in per_request
        for i in range(0, len(keys), 64)
    ]
    return {
        "nodes_per_64_block_call": float(np.mean(fan_out)) if fan_out else 0.0,
        "held_max_vs_mean": float(held.max() / held.mean()),
        "held_top_share": float(held.max() / held.sum()),
        "served_max_vs_mean": float(served.max() / served.mean()),
        "served_top_share": float(served.max() / served.sum()),
        "blocks": float(len(distinct)),
    }


def main() -> None:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--trace", default=str(here.parent.parent / "shared/traces/mooncake_synthetic_trace.jsonl")
    )
    parser.add_argument("--nodes", default="48,1000")
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--system-tokens", default="2048,5120,11776")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    space = Namespace(model="bench/hot-prefix", revision="1", layout=LAYOUT)
    workloads: list[tuple[str, list[Request]]] = []
    if args.trace and Path(args.trace).exists():
        workloads.append(("shared trace", list(read_trace(args.trace))))
    for system in (int(s) for s in args.system_tokens.split(",") if s):
        spec = WorkloadSpec(conversations=args.conversations, shared_prefix_tokens=system)
        workloads.append((f"generated, system prompt {system:,} tokens", generate_workload(spec)))
    figures: dict[str, object] = {"commit": commit(), "machine": machine()}
    results: list[dict[str, object]] = []
    rows = []
    for name, requests in workloads:
        for rule, group, alone in RULES:
            per_request = prompt_keys(requests, space, group, alone)
            for nodes in (int(n) for n in args.nodes.split(",")):
                got = spread(per_request, nodes)
                results.append({"workload": name, "rule": rule, "nodes": nodes, **got})
                rows.append(
                    [
                        name,
                        rule,
                        str(nodes),
                        f"{got['held_max_vs_mean']:.2f}",
                        f"{got['served_max_vs_mean']:.2f}",
                        f"{100 * got['served_top_share']:.2f} %",
                        f"{got['nodes_per_64_block_call']:.1f}",
                    ]
                )
    figures["rows"] = results
    print(f"kvcache hot prefixes — commit {figures['commit']}, {figures['machine']}")
    print(
        "workloads: "
        + "; ".join(f"{name}: {len(r):,} requests" for name, r in workloads)
        + f"; 112 KiB blocks of 128 tokens, {WIDTH} shards a block"
    )
    print_table(
        "Shards held and served per node, and the nodes a 64-block call asks, by placement rule",
        [
            "workload",
            "rule",
            "nodes",
            "held max/mean",
            "served max/mean",
            "busiest node's share served",
            "nodes a 64-block call asks",
        ],
        rows,
    )
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
