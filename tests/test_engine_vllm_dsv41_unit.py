"""DeepSeek V4.1 Flash's KV layout in the connector, without vLLM: block-outermost spans from
``KVCacheTensor`` records, the groups' roles, the geometry both halves agree on, the state
of 32-token SWA blocks under 128-token main blocks plus the ring, MLA stored once per TP
group, and the book skipping replayed blocks.

The records below are the ones vLLM 0.32's ``get_kv_cache_configs`` produced for V4.1 on
SM100 (nvfp4 MLA + MXFP4 indexer), printed from the real function and copied here; the
real-scheduler test (``tests/test_engine_vllm_dsv41.py``) runs vLLM itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcache.engine.vllm_meta as vm
from kvcache.engine.block_span import GroupSpan, group_span, is_block_outermost
from kvcache.engine.hybrid import HybridLayout, window_ids
from kvcache.engine.paged import PagedKVAdapter
from kvcache.engine.vllm_context import (
    group_roles,
    group_spans,
    hybrid_layout,
    kv_geometry,
    replica_ranks,
)
from kvcache.errors import ConfigError
from kvcache.layout import DType

STRIDE = 114_688


@dataclass
class T:
    """vLLM's KVCacheTensor, by attribute."""

    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int = 0
    size: int = 0


class KVCacheSpec:
    def __init__(self, block_size: int, page: int, **kw: Any) -> None:
        self.block_size = block_size
        self.page_size_bytes = page
        self.dtype = torch.uint8
        self.num_kv_heads = 1
        self.head_size = 512
        self.head_size_v = 0
        for k, v in kw.items():
            setattr(self, k, v)


class FullAttentionSpec(KVCacheSpec):
    pass


class MLAAttentionSpec(FullAttentionSpec):
    pass


class SlidingWindowSpec(KVCacheSpec):
    pass


class SlidingWindowMLASpec(SlidingWindowSpec):
    pass


class CircularBufferSpec(KVCacheSpec):
    pass


class UniformTypeKVCacheSpecs:
    def __init__(self, specs: dict[str, Any], replay: int = 0) -> None:
        self.kv_cache_specs = specs
        first = next(iter(specs.values()))
        self.block_size = first.block_size
        self.page_size_bytes = sum(s.page_size_bytes for s in specs.values())
        self.prefix_replay_tokens = replay


@dataclass
class Group:
    layer_names: list[str]
    kv_cache_spec: Any


@dataclass
class KVConfig:
    kv_cache_groups: list[Group]
    kv_cache_tensors: list[T] = field(default_factory=list)
    kv_cache_layout: str | None = "BLHNC"
    kv_tp_replicas: int = 1


@dataclass
class CacheConfig:
    kv_cache_layout: str | None = None


@dataclass
class VConfig:
    cache_config: CacheConfig = field(default_factory=CacheConfig)


SWA_SIZES = [6, 6, 6, 6, 6, 5, 5]


def v41(*, flatten: bool) -> KVConfig:
    """V4.1 on SM100 as vLLM groups it (worker view), or as the scheduler sees it."""
    groups: list[Group] = []
    tensors: list[T] = []
    for g, n in enumerate(SWA_SIZES):
        names = [f"l{g + 7 * i}.swa" for i in range(n)]
        specs = {
            name: SlidingWindowMLASpec(32, 16_896, sliding_window=128, cache_dtype_str="fp8_ds_mla")
            for name in names
        }
        groups.append(Group(names, UniformTypeKVCacheSpecs(specs, replay=128)))
        tensors.append(T(names, 16_896, STRIDE))
    mla = {
        "l2.mla": 18_432,
        "l2.idx": 4_608,
        "l8.mla": 18_432,
        "l8.idx": 4_608,
        "l14.mla": 18_432,
        "l14.idx": 4_608,
        "l20.mla": 36_864,
        "l20.idx": 8_704,
    }
    groups.append(
        Group(
            list(mla),
            UniformTypeKVCacheSpecs(
                {
                    n: MLAAttentionSpec(128, p, cache_dtype_str="nvfp4_ds_mla")
                    for n, p in mla.items()
                }
            ),
        )
    )
    tensors += [
        T(["l2.mla", "l8.mla", "l14.mla"], 18_432, STRIDE, 0),
        T(["l2.idx", "l8.idx", "l14.idx"], 4_608, STRIDE, 55_296),
        T(["l20.mla"], 36_864, STRIDE, 69_120),
        T(["l20.idx"], 8_704, STRIDE, 105_984),
    ]
    rings = ["l0.ring", "l1.ring", "l2.ring"]
    groups.append(
        Group(rings, UniformTypeKVCacheSpecs({n: CircularBufferSpec(8, 32_768) for n in rings}))
    )
    tensors.append(T(rings, 32_768, STRIDE))
    cfg = KVConfig(groups, tensors)
    if flatten:  # vLLM's generate_scheduler_kv_cache_config
        for group in cfg.kv_cache_groups:
            spec = group.kv_cache_spec
            replay = spec.prefix_replay_tokens
            group.kv_cache_spec = next(iter(spec.kv_cache_specs.values()))
            group.kv_cache_spec.prefix_replay_tokens = replay
    return cfg


def test_v41_groups_get_their_roles() -> None:
    roles = group_roles(v41(flatten=False))
    assert roles.main == 7 and roles.swa == tuple(range(7)) and roles.ring == (8,)
    assert roles.window == 128 and roles.replay_tokens == 128
    assert group_roles(v41(flatten=True)) == roles


def test_a_ring_without_sliding_window_groups_is_refused() -> None:
    cfg = v41(flatten=False)
    cfg.kv_cache_groups = cfg.kv_cache_groups[7:]
    with pytest.raises(ConfigError, match="ring"):
        group_roles(cfg)


def test_spans_of_the_mla_group_are_contiguous_and_both_halves_agree() -> None:
    worker, sched = v41(flatten=False), v41(flatten=True)
    spans = group_spans(worker)
    assert spans[7] == GroupSpan(
        start=0,
        end=114_688,
        block_stride=STRIDE,
        pages=(18_432,) * 3 + (4_608,) * 3 + (36_864, 8_704),
    )
    assert spans[0].nbytes == 6 * 16_896 and spans[8].nbytes == 98_304
    g_worker, g_sched = kv_geometry(VConfig(), worker, 7), kv_geometry(VConfig(), sched, 7)
    assert g_worker == g_sched
    assert g_worker.payload_bytes == 114_688 and g_worker.bytes_per_token == 896
    # The pitfall: page_size_bytes x layers is what the flattened scheduler spec would give.
    assert sched.kv_cache_groups[7].kv_cache_spec.page_size_bytes * 8 != 114_688
    assert "rec=nvfp4_ds_mla" in g_worker.packing
    assert "pages=18432x3+4608x3+36864+8704" in g_worker.packing


def test_record_formats_with_the_same_total_get_different_namespaces() -> None:
    a = v41(flatten=False)
    b = v41(flatten=False)
    # Swap two tensors' places: same bytes per block, another record layout.
    b.kv_cache_tensors[7:11] = [
        T(["l2.idx", "l8.idx", "l14.idx"], 4_608, STRIDE, 0),
        T(["l2.mla", "l8.mla", "l14.mla"], 18_432, STRIDE, 13_824),
        T(["l20.mla"], 36_864, STRIDE, 69_120),
        T(["l20.idx"], 8_704, STRIDE, 105_984),
    ]
    ga, gb = kv_geometry(VConfig(), a, 7), kv_geometry(VConfig(), b, 7)
    assert ga.payload_bytes == gb.payload_bytes and ga.packing != gb.packing


def test_a_gap_between_a_groups_pages_is_refused() -> None:
    tensors = [T(["a"], 100, 1000, 0), T(["b"], 100, 1000, 200)]
    assert is_block_outermost(tensors)
    with pytest.raises(ConfigError, match="contiguous"):
        group_span(tensors, ["a", "b"])
    with pytest.raises(ConfigError, match="places"):
        group_span(tensors, ["a", "c"])


def test_layer_outermost_layouts_have_no_spans() -> None:
    # Each layer its own region: block_stride is the page, layer_stride the region.
    assert not is_block_outermost([T(["a", "b"], 100 * 64, 100)])
    assert group_spans(KVConfig([], [T(["a", "b"], 6400, 100)])) == {}


def test_v41_state_is_four_swa_blocks_per_group_and_the_ring() -> None:
    layout = hybrid_layout(VConfig(), v41(flatten=True), group_roles(v41(flatten=True)))
    assert layout.swa_tokens_per_block == 32 and layout.block_size == 128
    assert layout.window_blocks(896) == (24, 28)
    assert layout.state_bytes(896) == 2_703_360 + 98_304
    assert layout.state_groups == (*range(7), 8)
    assert "ring=98304" in layout.packing
    assert layout.state_layout().bytes_per_token == 40 * 528


V41_LAYOUT = hybrid_layout(VConfig(), v41(flatten=True), group_roles(v41(flatten=True)))


@given(st.integers(1, 40))
def test_window_blocks_of_32_token_blocks_cover_the_window(blocks: int) -> None:
    layout = V41_LAYOUT
    position = blocks * 128
    first, end = layout.window_blocks(position)
    assert end * 32 == position
    assert first * 32 <= max(0, position - 127) < (first + 1) * 32


def test_window_ids_take_the_ring_block_whole() -> None:
    swa = [[0] * 24 + [5, 6, 7, 8], [0] * 24 + [9, 10, 11, 12]]
    assert window_ids([*swa, [3]], 24, 28, rings=1) == ((5, 6, 7, 8), (9, 10, 11, 12), (3,))
    assert window_ids([*swa, [0]], 24, 28, rings=1) is None  # the ring block is gone
    assert window_ids([*swa, []], 24, 28, rings=1) is None


def test_sliding_blocks_that_do_not_divide_the_main_block_are_refused() -> None:
    with pytest.raises(ConfigError, match="divide"):
        HybridLayout(
            block_size=128,
            window=128,
            main_group=1,
            swa_groups=(0,),
            swa_block_bytes=(100,),
            swa_layers=1,
            dtype=DType.INT8,
            packing="x",
            swa_block_size=48,
        )


def test_mla_is_stored_once_per_tp_group() -> None:
    ranks = {"tp_rank": 3, "tp_size": 4, "pp_rank": 0, "pp_size": 1}
    stored, writes = replica_ranks(ranks, 4)
    assert (stored["tp_rank"], stored["tp_size"], writes) == (0, 1, False)
    assert replica_ranks(ranks | {"tp_rank": 0}, 4) == (stored, True)
    # Two groups of two identical ranks: each group stores its own.
    assert replica_ranks(ranks, 2) == (ranks | {"tp_rank": 1, "tp_size": 2}, False)
    assert replica_ranks(ranks, 1) == (ranks, True)


def test_book_does_not_save_the_blocks_a_bounded_replay_recomputes() -> None:
    book = vm.SchedulerBook(block_size=128, hybrid=V41_LAYOUT)
    prompt = list(range(1000))
    ids = list(range(1, 9))
    book.on_alloc("r", prompt, local_tokens=0, external=896, block_ids=ids)
    book.plan_step([], [], {})
    # vLLM replays tokens 768..895 and computes on to the end: block 6 is not saved again.
    plan = book.plan_step([vm.NewReq("r", prompt, ids, 768)], [], {"r": 232})
    assert plan.saves == ()
    # After a failed load vLLM recomputes from 0: every block is saved.
    book.on_load_failed("r")
    plan = book.plan_step([vm.NewReq("r", prompt, ids, 0)], [], {"r": 1000})
    (save,) = plan.saves
    assert (save.first_block, save.block_ids) == (0, tuple(ids[:7]))
    # Without bounded replay a loaded block is recomputed only after a failed load: saved.
    plain = vm.SchedulerBook(block_size=128)
    plain.on_alloc("r", prompt, local_tokens=0, external=896, block_ids=ids)
    plain.plan_step([], [], {})
    (again,) = plain.plan_step([vm.NewReq("r", prompt, ids, 768)], [], {"r": 232}).saves
    assert again.first_block == 6


def test_span_adapter_moves_one_groups_block_and_nothing_else() -> None:
    backing = torch.arange(10 * 64, dtype=torch.int64).to(torch.uint8)
    # Blocks of 64 bytes; the group owns bytes 16..40 of each.
    view = backing.as_strided((10, 24), (64, 1), 16)
    adapter = PagedKVAdapter([view], page_tokens=8)
    assert adapter.payload_bytes == 24
    out = adapter.gather([[3], [7]])
    assert bytes(out.host[0].numpy()) == bytes(backing[3 * 64 + 16 : 3 * 64 + 40].numpy())
    before = backing.clone()
    adapter.scatter(out.host.flip(0).contiguous(), [[3], [7]])
    assert torch.equal(backing[3 * 64 + 16 : 3 * 64 + 40], before[7 * 64 + 16 : 7 * 64 + 40])
    changed = (backing != before).nonzero().flatten().tolist()
    assert all(16 <= i % 64 < 40 and i // 64 in (3, 7) for i in changed)


def test_counter_deltas_hand_over_increments_once() -> None:
    from kvcache.engine.stats import EXPORTED_COUNTERS, ConnectorStats, CounterDeltas

    assert {"swa_state_restores", "swa_bounded_replays", "swa_full_recomputes"} <= set(
        EXPORTED_COUNTERS
    )
    stats = ConnectorStats(role="scheduler", pid=1)
    deltas = CounterDeltas()
    assert deltas.take(stats) == {}
    stats.swa_state_restores += 2
    stats.lookups += 5
    assert deltas.take(stats) == {"swa_state_restores": 2, "lookups": 5}
    assert deltas.take(stats) == {}  # nothing counted twice
    stats.swa_full_recomputes += 1
    assert deltas.take(stats) == {"swa_full_recomputes": 1}
