"""Prefix-key hashing cost: kvcache's chained xxh3-128 vs chained SHA-256 of the same blocks;
and the cost of placing a call's keys, against hashing them.

A 77K-token prompt (the reference deployment's average) is hashed into block
keys for several block sizes, from a numpy token array (what engines hold) and
from a Python list. The baseline is the same chain with SHA-256 over the same
bytes (vLLM's default block hashing is SHA-256 over a pickled tuple, which is
slower still). Target: <= 10 ns per token.

The second table places the keys of 64-block calls over the 77K-token prompt (DeepSeek
V4.1's 112 KiB blocks, whose placement groups are 64 blocks) with ``Placement.order``, its
rows cached as a client's are after the prompt's match, at 12 and 48 nodes; and puts that
beside hashing the same calls' tokens into their keys.

Usage: python bench/keys.py [--quick] [--json PATH]
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import best_of, commit, machine, parser, print_table, write_json

from kvcache.cluster import ClusterMap, NodeInfo
from kvcache.keys import BLOCK_TAG, Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.placement import Placement

TOKENS = 77_000


def sha256_chain(seed: bytes, tokens: np.ndarray, block: int) -> list[bytes]:
    raw = tokens.astype("<u4").tobytes()
    step = 4 * block
    parent, out = seed, []
    for start in range(0, (len(tokens) // block) * step, step):
        parent = hashlib.sha256(BLOCK_TAG + parent + raw[start : start + step]).digest()
        out.append(parent)
    return out


def main() -> None:
    args = parser(__doc__ or "").parse_args()
    repeat = 5 if args.quick else 30
    tokens = np.random.default_rng(0).integers(0, 150_000, TOKENS).astype(np.int64)
    as_list = tokens.tolist()
    figures: dict[str, object] = {"commit": commit(), "machine": machine(), "tokens": TOKENS}
    rows = []
    for block in (16, 64, 256, 512):
        ns = Namespace(
            model="bench",
            revision="1",
            layout=KVLayout(
                tokens_per_block=block, bytes_per_token=224, dtype=DType.BFLOAT16, layers_in_block=1
            ),
        )
        t_arr = best_of(lambda ns=ns: block_keys(ns, tokens), repeat)
        t_list = best_of(lambda ns=ns: block_keys(ns, as_list), repeat)
        t_sha = best_of(lambda ns=ns, block=block: sha256_chain(ns.seed, tokens, block), repeat)
        arr_ns, list_ns, sha_ns = (t / TOKENS * 1e9 for t in (t_arr, t_list, t_sha))
        figures.update(
            {
                f"ns_per_token_array_b{block}": arr_ns,
                f"ns_per_token_list_b{block}": list_ns,
                f"sha256_ns_per_token_b{block}": sha_ns,
                f"sha256_vs_xxh3_b{block}": sha_ns / arr_ns,
            }
        )
        rows.append(
            [
                str(block),
                f"{arr_ns:.2f}",
                f"{list_ns:.2f}",
                f"{sha_ns:.2f}",
                f"{sha_ns / arr_ns:.1f}x",
            ]
        )
    figures["ns_per_token_77k"] = figures["ns_per_token_array_b512"]
    print(f"kvcache key hashing — commit {figures['commit']}, {figures['machine']}")
    print_table(
        f"Hashing a {TOKENS:,}-token prompt into chained block keys (best of {repeat}), target <= 10 ns/token",
        [
            "tokens/block",
            "xxh3-128, numpy input (ns/token)",
            "xxh3-128, list input",
            "SHA-256 chain",
            "SHA-256 / xxh3",
        ],
        rows,
    )
    place_rows = placement_rows(tokens, repeat, figures)
    print_table(
        "Placing a 64-block call's keys (Placement.order, rows cached) vs hashing its tokens "
        f"(best of {repeat}, whole prompt in 64-block calls)",
        ["nodes", "order µs / call", "ns / block", "hashing µs / call", "order / hashing"],
        place_rows,
    )
    write_json(args.json, figures)


def placement_rows(tokens: np.ndarray, repeat: int, figures: dict[str, object]) -> list[list[str]]:
    """Time ``Placement.order`` per 64-block call of the prompt, at 12 and 48 nodes."""
    ns = Namespace(
        model="bench",
        revision="1",
        layout=KVLayout(
            tokens_per_block=128, bytes_per_token=896, dtype=DType.BFLOAT16, layers_in_block=1
        ),
    )
    keys = block_keys(ns, tokens)
    calls = [keys[i : i + 64] for i in range(0, len(keys) - 63, 64)]
    per_call_tokens = 64 * 128
    t_hash = best_of(lambda: block_keys(ns, tokens[: len(calls) * per_call_tokens]), repeat)
    hash_us = t_hash / len(calls) * 1e6
    rows = []
    for nodes in (12, 48):
        cluster = ClusterMap(
            epoch=1,
            nodes=tuple(
                NodeInfo(id=f"node-{i:02d}", data=f"tcp://127.0.0.1:{7000 + i}")
                for i in range(nodes)
            ),
        )
        placement = Placement(cluster, width=12)
        for call in calls:  # the match placed them: cached from here on
            placement.order(call)

        def place_all(p: Placement = placement) -> None:
            for call in calls:
                p.order(call)

        order_us = best_of(place_all, repeat) / len(calls) * 1e6
        figures[f"placement_order_us_per_64_keys_{nodes}_nodes"] = order_us
        figures[f"placement_order_vs_hashing_{nodes}_nodes"] = order_us / hash_us
        rows.append(
            [
                str(nodes),
                f"{order_us:.1f}",
                f"{order_us / 64 * 1e3:.0f}",
                f"{hash_us:.1f}",
                f"{order_us / hash_us:.2f}x",
            ]
        )
    figures["hash_us_per_64_blocks"] = hash_us
    return rows


if __name__ == "__main__":
    main()
