"""The parity scratch kept from one load to the next: the cache's rules (hypothesis), and
loads through the real client on a real cluster that reuse it, healthy and degraded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.client import Client, ClientConfig
from kvcache.client.scratch import GRAIN, ScratchCache
from kvcache.errors import ArgumentError, ConfigError
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.testing.localcluster import LocalCluster
from kvcache.workload import payload_for_key

# (take, size) or (give, which of the held buffers)
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("take"), st.integers(0, 5 * GRAIN)),
        st.tuples(st.just("give"), st.integers(0, 50)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(limit=st.integers(0, 8 * GRAIN), ops=_OPS)
def test_a_buffer_has_one_holder_and_the_cache_stays_within_its_limit(
    limit: int, ops: list[tuple[str, int]]
) -> None:
    cache = ScratchCache(limit)
    held: list[tuple[np.ndarray, int]] = []
    given_back: list[np.ndarray] = []
    for op, arg in ops:
        if op == "take":
            buf, reused = cache.take(arg)
            assert buf.dtype == np.uint8 and buf.ndim == 1 and buf.nbytes >= arg
            # Never the memory of a buffer someone holds.
            at = buf.ctypes.data
            for other, _ in held:
                o = other.ctypes.data
                assert at + buf.nbytes <= o or o + other.nbytes <= at
            assert reused == any(buf is b for b in given_back)
            given_back = [b for b in given_back if b is not buf]
            held.append((buf, arg))
        elif held:
            buf, _ = held.pop(arg % len(held))
            cache.give(buf)
            if buf.nbytes <= limit:
                given_back.append(buf)
        assert cache.cached_bytes <= limit
    assert cache.reused + cache.allocated == sum(1 for op, _ in ops if op == "take")


def test_a_buffer_given_back_serves_the_next_take_that_fits() -> None:
    cache = ScratchCache(4 * GRAIN)
    small, _ = cache.take(GRAIN // 2)
    assert small.nbytes == GRAIN  # rounded up to the grain
    cache.give(small)
    again, reused = cache.take(GRAIN)
    assert reused and again is small
    with pytest.raises(ArgumentError, match="twice"):
        cache.give(again)
        cache.give(again)
    big, reused = cache.take(5 * GRAIN)  # past the limit: allocated, never kept
    assert not reused and big.nbytes == 5 * GRAIN
    cache.give(big)
    assert cache.cached_bytes == GRAIN


def test_a_negative_limit_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match="scratch_cache_bytes"):
        ClientConfig(cluster_file=Path("c.toml"), scratch_cache_bytes=-1)


LAYOUT = KVLayout(
    tokens_per_block=64, bytes_per_token=1792, dtype=DType.BFLOAT16, layers_in_block=7
)


def _prompt(blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, blocks * 64).astype(np.uint32)


def test_loads_reuse_the_scratch_and_still_rebuild_blocks_when_holders_die(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    """The second load's parity lands where the first one's did; stale parity bytes from
    an earlier load never pass for a shard of a later one, even when two holders are dead
    and every block is rebuilt from parity."""
    cluster = cluster_factory()
    space = Namespace(model="scratch", revision="1", layout=LAYOUT)
    prompts = [_prompt(40, seed) for seed in (1, 2)]
    with Client(cluster.client_config(timeout_s=2.0)) as client:
        for tokens in prompts:
            rows = [payload_for_key(k, LAYOUT.payload_bytes) for k in block_keys(space, tokens)]
            assert client.store(space, tokens, rows).failed == 0
        for tokens in prompts:
            assert client.load_prefix(space, tokens).blocks == 40
        assert client.counters["scratch_reused"] >= 1
        cluster.kill(0)
        cluster.kill(1)
        before = client.counters["blocks_rebuilt"]
        for tokens in (*prompts, *prompts):
            result = client.load_prefix(space, tokens)
            assert result.blocks == 40
            for got, key in zip(result.payloads, block_keys(space, tokens), strict=True):
                assert np.array_equal(got, payload_for_key(key, LAYOUT.payload_bytes))
        assert client.counters["blocks_rebuilt"] > before
        assert client.counters["scratch_reused"] >= 5


def test_a_client_that_keeps_no_scratch_loads_the_same(
    cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = cluster_factory()
    space = Namespace(model="no-scratch", revision="1", layout=LAYOUT)
    tokens = _prompt(16, 3)
    rows = [payload_for_key(k, LAYOUT.payload_bytes) for k in block_keys(space, tokens)]
    with Client(cluster.client_config(scratch_cache_bytes=0)) as client:
        client.store(space, tokens, rows)
        for _ in range(2):
            result = client.load_prefix(space, tokens)
            assert result.blocks == 16
            assert all(np.array_equal(g, w) for g, w in zip(result.payloads, rows, strict=True))
        assert client.counters["scratch_reused"] == 0
