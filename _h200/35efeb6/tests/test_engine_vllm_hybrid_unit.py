"""Hybrid-model planning without vLLM: group roles, hits cut to held states, when a state is
taken, what a load fills, and the shared settings' ``swa_*`` keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvcache.engine.vllm_meta as vm
from kvcache.engine.hybrid import HybridLayout, state_hit, state_position, window_ids
from kvcache.engine.settings import SwaMode, split_engine_config
from kvcache.engine.vllm_context import group_roles, hybrid_layout, kv_geometry
from kvcache.errors import ConfigError
from kvcache.layout import DType

B, W = 32, 64


def layout(**kw: Any) -> HybridLayout:
    args: dict[str, Any] = {
        "block_size": B,
        "window": W,
        "main_group": 2,
        "swa_groups": (0, 1),
        "swa_block_bytes": (16384, 16384),
        "swa_layers": 4,
        "dtype": DType.FLOAT32,
        "packing": "SlidingWindowSpec,layout=default,heads=1,k=32,v=32,quant=NONE",
    }
    args.update(kw)
    return HybridLayout(**args)


# ---------------------------------------------------------------------- vLLM's groups, by attribute


class FullAttentionSpec:
    def __init__(self, window: int | None = None) -> None:
        self.block_size = B
        self.page_size_bytes = 8192
        self.num_kv_heads = 1
        self.head_size = 32
        self.dtype = _torch_float32()
        self.sliding_window = window


class SlidingWindowSpec(FullAttentionSpec):
    pass


class MambaSpec(FullAttentionSpec):
    pass


def _torch_float32() -> Any:
    import torch

    return torch.float32


@dataclass
class Group:
    kv_cache_spec: Any
    layer_names: list[str] = field(default_factory=lambda: ["a", "b"])


@dataclass
class KVConfig:
    kv_cache_groups: list[Group]
    kv_cache_layout: str | None = None


@dataclass
class CacheConfig:
    kv_cache_layout: str | None = None


@dataclass
class VConfig:
    cache_config: CacheConfig = field(default_factory=CacheConfig)


def test_groups_of_a_hybrid_model_get_their_roles() -> None:
    cfg = KVConfig(
        [Group(SlidingWindowSpec(W)), Group(SlidingWindowSpec(W)), Group(FullAttentionSpec())]
    )
    roles = group_roles(cfg)
    assert (roles.main, roles.swa, roles.window) == (2, (0, 1), W)
    hybrid = hybrid_layout(VConfig(), cfg, roles)
    assert hybrid.swa_block_bytes == (2 * 8192, 2 * 8192) and hybrid.swa_layers == 4
    # The block store's geometry is the full group's alone.
    assert kv_geometry(VConfig(), cfg, roles.main).num_layers == 2
    assert group_roles(KVConfig([Group(FullAttentionSpec())])).swa == ()


@pytest.mark.parametrize(
    "groups",
    [
        [Group(SlidingWindowSpec(W))],  # no full-attention group
        [Group(FullAttentionSpec()), Group(FullAttentionSpec())],
        [Group(FullAttentionSpec()), Group(MambaSpec())],
        [Group(FullAttentionSpec()), Group(SlidingWindowSpec(64)), Group(SlidingWindowSpec(128))],
    ],
)
def test_unsupported_group_mixes_are_refused_by_name(groups: list[Group]) -> None:
    with pytest.raises(ConfigError):
        group_roles(KVConfig(groups))


# ---------------------------------------------------------------------- hits and states


def test_hit_is_cut_to_the_longest_held_state() -> None:
    # Store holds 6 blocks; states at 2 and 4 blocks: the hit is 4 blocks.
    assert (
        state_hit(hit_blocks=6, loadable=6, local_tokens=0, block_size=B, positions=[64, 128]) == 4
    )
    # Past what is loadable or stored, or within vLLM's own prefix hit: not usable.
    assert state_hit(hit_blocks=3, loadable=6, local_tokens=0, block_size=B, positions=[128]) == 0
    assert state_hit(hit_blocks=6, loadable=3, local_tokens=0, block_size=B, positions=[128]) == 0
    assert state_hit(hit_blocks=6, loadable=6, local_tokens=128, block_size=B, positions=[128]) == 0
    # No state anywhere: nothing can be served exactly.
    assert state_hit(hit_blocks=6, loadable=6, local_tokens=0, block_size=B, positions=[]) == 0


@given(
    hit=st.integers(0, 20),
    loadable=st.integers(0, 20),
    local=st.integers(0, 20),
    positions=st.lists(st.integers(1, 700)),
)
def test_state_hits_are_always_servable(
    hit: int, loadable: int, local: int, positions: list[int]
) -> None:
    blocks = state_hit(
        hit_blocks=hit, loadable=loadable, local_tokens=local * B, block_size=B, positions=positions
    )
    if blocks:
        assert blocks * B in positions and local < blocks <= min(hit, loadable)


def test_state_bytes_and_window_ids() -> None:
    h = layout()
    assert h.window_blocks(128) == (2, 4) and h.state_bytes(128) == 2 * (16384 + 16384)
    assert h.state_layout().layers_in_block == 4
    assert state_position(150, B) == 128 and state_position(31, B) == 0
    assert window_ids([[0, 0, 7, 8, 9], [0, 0, 3, 4, 5]], 2, 4) == ((7, 8), (3, 4))
    # A window block already freed (the null block) or not tracked: no state to take.
    assert window_ids([[0, 0, 0, 8]], 2, 4) is None
    assert window_ids([[0, 0, 7]], 2, 4) is None


def test_book_takes_the_state_in_the_step_that_completes_the_prompt() -> None:
    book = vm.SchedulerBook(block_size=B, hybrid=layout())
    prompt = list(range(150))  # 4 full blocks: the state is taken at 128
    swa_ids = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    first = book.plan_step(
        [vm.NewReq("r", prompt, [11, 12, 13, 14, 15], 0, swa_block_ids=swa_ids)], [], {"r": 100}
    )
    assert first.swa_saves == ()  # tokens 0..99: the window at 128 is not complete yet
    second = book.plan_step([], [vm.CachedReq("r", False, None, 100, None)], {"r": 50})
    (state,) = second.swa_saves
    assert (state.position, state.first_block) == (128, 2)
    assert state.block_ids == ((3, 4), (8, 9))
    assert len(state.tokens) == 128
    # Taken once: decoding steps take nothing more.
    assert book.plan_step([], [vm.CachedReq("r", False, None, 150, None)], {"r": 1}).swa_saves == ()


def test_book_skips_a_state_whose_window_was_freed() -> None:
    book = vm.SchedulerBook(block_size=B, hybrid=layout())
    plan = book.plan_step(
        [
            vm.NewReq(
                "r", list(range(150)), [1, 2, 3, 4, 5], 150, swa_block_ids=[[0, 0, 0, 7, 8]] * 2
            )
        ],
        [],
        {"r": 1},
    )
    assert plan.swa_saves == ()


def test_a_state_load_is_asynchronous_only() -> None:
    from kvcache.engine.hybrid import SwaLoadSpec

    book = vm.SchedulerBook(block_size=B, hybrid=layout())
    spec = SwaLoadSpec(key=None, holders=(), first_block=2, write_from=2, block_ids=())
    with pytest.raises(ConfigError, match="asynchronously"):
        book.on_alloc("r", list(range(150)), local_tokens=0, external=128, swa=spec)
    book.on_alloc(
        "r", list(range(150)), local_tokens=0, external=128, block_ids=[1, 2, 3, 4, 5], swa=spec
    )
    (load,) = book.plan_step([], [], {}).loads
    assert load.asynchronous and load.swa is spec


# ---------------------------------------------------------------------- settings


def test_swa_keys_go_to_the_swa_config() -> None:
    settings, client, swa = split_engine_config(
        {"cluster_file": "c.toml", "swa": "on", "swa_ttl_s": 60, "swa_max_bytes": "1GiB"},
        vm.ConnectorSettings,
        source="test",
    )
    assert settings.swa is SwaMode.ON
    assert client == {"cluster_file": "c.toml"}
    assert swa == {"ttl_s": 60, "max_bytes": "1GiB"}
    with pytest.raises(ConfigError, match=r"unknown key 'swa_tll_s'.*swa_ttl_s"):
        split_engine_config({"cluster_file": "c", "swa_tll_s": 1}, vm.ConnectorSettings, source="t")
    with pytest.raises(ConfigError):
        split_engine_config({"cluster_file": "c", "swa": "maybe"}, vm.ConnectorSettings, source="t")
