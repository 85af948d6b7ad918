"""The I/O process pool through the shipped client: worker processes move the bytes of
loads and stores between the daemons and shared-memory buffers from ``alloc_buffer``."""

from __future__ import annotations

import itertools
import os

import numpy as np

from kvcache.chaos import ShardFault, plant
from kvcache.client import Client
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key

LAYOUT = KVLayout(
    tokens_per_block=64, bytes_per_token=1792, dtype=DType.BFLOAT16, layers_in_block=7
)
P = LAYOUT.payload_bytes
CHUNK = 8 * P  # 8 blocks per chunk: a 40-block load is cut into ranges for both workers


def space(name: str) -> Namespace:
    return Namespace(model=name, revision="1", layout=LAYOUT)


def prompt(blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, blocks * 64).astype(np.uint32)


def test_pooled_store_and_load_through_shared_buffers(shared_cluster: LocalCluster) -> None:
    ns, tokens = space("pool"), prompt(40, 1)
    keys = block_keys(ns, tokens)
    with Client(shared_cluster.client_config(io_processes=2, chunk_bytes=CHUNK)) as client:
        pids = client.io_pids
        assert len(pids) == 2 and os.getpid() not in pids
        src = client.alloc_buffer(40, P)
        for b, key in enumerate(keys):
            src[b] = payload_for_key(key, P)
        assert client.store(ns, tokens, src).written == 40
        out = client.alloc_buffer(40, P)
        ready: list[tuple[int, int]] = []
        result = client.load(
            ns, client.match_prefix(ns, tokens), out=out, on_ready=lambda a, b: ready.append((a, b))
        )
        assert result.blocks == 40
        assert np.array_equal(out, src)
        # The verified prefix is reported in order, without gaps, up to the end.
        assert ready[0][0] == 0 and ready[-1][1] == 40
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ready))
        # Each worker's next load lands its parity shards in the scratch its last one used
        # (kvcache.client.scratch), and the bytes are still right.
        before = client.counters["scratch_reused"]
        out.fill(0)
        assert client.load(ns, client.match_prefix(ns, tokens), out=out).blocks == 40
        assert np.array_equal(out, src)
        assert client.counters["scratch_reused"] >= before + 2


def test_pooled_load_stops_at_a_broken_block_and_never_reports_past_it(
    shared_cluster: LocalCluster,
) -> None:
    ns, tokens = space("pool-broken"), prompt(40, 2)
    keys = block_keys(ns, tokens)
    with Client(shared_cluster.client_config(io_processes=2, chunk_bytes=CHUNK)) as client:
        src = client.alloc_buffer(40, P)
        for b, key in enumerate(keys):
            src[b] = payload_for_key(key, P)
        client.store(ns, tokens, src)
        for index in (0, 5, 10):  # three bad shards: block 13 cannot be rebuilt
            plant(shared_cluster, keys[13], index, ShardFault.CORRUPT_BODY)
        out = client.alloc_buffer(40, P)
        ready: list[tuple[int, int]] = []
        match = client.match_prefix(ns, tokens)
        result = client.load(ns, match, out=out, on_ready=lambda a, b: ready.append((a, b)))
        assert result.blocks == 13
        assert np.array_equal(out[:13], src[:13])
        assert max(b for _, b in ready) == 13
