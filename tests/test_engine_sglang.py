"""The SGLang HiCache backend against a real cluster, with host-pool tensors shaped like SGLang's."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvcache.engine.sglang_backend import KVCacheStorage
from kvcache.errors import ConfigError
from kvcache.testing.localcluster import LocalCluster


@dataclass
class StorageConfig:
    """The fields of SGLang's HiCacheStorageConfig this backend reads."""

    tp_rank: int = 0
    tp_size: int = 1
    is_mla_model: bool = False
    model_name: str = "test/llama-tiny"
    extra_config: dict[str, Any] = field(default_factory=dict)


class HostPool:
    """A layer-first MHA host pool like SGLang's: kv_buffer [2, layers, tokens, heads, head_dim]."""

    def __init__(
        self, tokens: int, page_size: int, layers: int = 4, heads: int = 2, dim: int = 64
    ) -> None:
        self.page_size = page_size
        self.dtype = torch.bfloat16
        self.layout = "layer_first"
        g = torch.Generator().manual_seed(tokens)
        self.kv_buffer = torch.randn((2, layers, tokens, heads, dim), generator=g).to(self.dtype)
        self.heads, self.dim, self.layers = heads, dim, layers

    def get_size_per_token(self) -> int:
        return 2 * self.layers * self.heads * self.dim * self.kv_buffer.element_size()

    def get_flat_data_page(self, index: int) -> torch.Tensor:
        return self.kv_buffer[:, :, index : index + self.page_size].flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, :, index : index + self.page_size] = data_page.reshape(
            2, self.layers, self.page_size, self.heads, self.dim
        )


def page_hashes(count: int, salt: str) -> list[str]:
    out, prior = [], b""
    for i in range(count):
        prior = hashlib.sha256(prior + f"{salt}:{i}".encode()).digest()
        out.append(prior.hex())
    return out


@pytest.fixture
def backend(shared_cluster: LocalCluster) -> Any:
    cfg = StorageConfig(
        extra_config={
            "cluster_file": str(shared_cluster.cluster_file),
            "credentials_file": str(shared_cluster.credentials_file),
            "traffic_class": "agent",
        }
    )
    b = KVCacheStorage(cfg, {})
    b.register_mem_pool_host(HostPool(tokens=16 * 32, page_size=16))
    yield b
    b.close()


def test_batch_set_v1_then_get_v1_into_another_pool(
    backend: Any, shared_cluster: LocalCluster
) -> None:
    pool = backend.mem_pool_host
    keys = page_hashes(6, "a")
    indices = torch.arange(0, 6 * 16)
    assert backend.batch_set_v1(keys, indices) == [True] * 6
    assert backend.batch_exists(keys) == 6
    assert backend.batch_exists(keys[:3] + page_hashes(2, "zz")) == 3
    # A second worker with its own pool loads the pages into other slots.
    other = KVCacheStorage(
        StorageConfig(
            extra_config={
                "cluster_file": str(shared_cluster.cluster_file),
                "credentials_file": str(shared_cluster.credentials_file),
            }
        ),
        {},
    )
    try:
        other_pool = HostPool(tokens=16 * 32, page_size=16)
        other.register_mem_pool_host(other_pool)
        dest = torch.arange(10 * 16, 16 * 16)
        assert other.batch_get_v1(keys, dest) == [True] * 6
        assert torch.equal(other_pool.kv_buffer[:, :, 160:256], pool.kv_buffer[:, :, 0:96])
    finally:
        other.close()


def test_tensor_api_round_trip(backend: Any) -> None:
    pool = backend.mem_pool_host
    keys = page_hashes(3, "b")
    pages = [pool.get_flat_data_page(i * 16).clone() for i in range(3)]
    assert backend.batch_set(keys, pages) is True
    got = backend.batch_get(keys + page_hashes(1, "missing"))
    assert got[3] is None
    for g, p in zip(got[:3], pages, strict=True):
        assert g is not None and torch.equal(g, p)
    target = torch.zeros_like(pages[1])
    assert backend.get(keys[1], target) is target and torch.equal(target, pages[1])
    assert backend.exists(keys[0]) and not backend.exists("f" * 64)
    assert backend.get_stats()["pages_stored"] >= 3


def test_other_tp_rank_never_shares_pages(backend: Any, shared_cluster: LocalCluster) -> None:
    keys = page_hashes(2, "c")
    backend.batch_set_v1(keys, torch.arange(0, 32))
    rank1 = KVCacheStorage(
        StorageConfig(
            tp_rank=1,
            tp_size=2,
            extra_config={
                "cluster_file": str(shared_cluster.cluster_file),
                "credentials_file": str(shared_cluster.credentials_file),
            },
        ),
        {},
    )
    try:
        rank1.register_mem_pool_host(HostPool(tokens=64, page_size=16))
        assert rank1.batch_exists(keys) == 0
    finally:
        rank1.close()


def test_missing_cluster_file_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="cluster_file"):
        KVCacheStorage(StorageConfig(), {})


def test_unknown_keys_are_refused_like_the_vllm_connectors() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'clustr_file'.*cluster_file"):
        KVCacheStorage(StorageConfig(extra_config={"clustr_file": "c.toml"}), {})


def test_sglangs_own_keys_pass_and_shared_settings_parse(shared_cluster: LocalCluster) -> None:
    cfg = StorageConfig(
        extra_config={
            "backend_name": "kvcache",
            "module_path": "kvcache.engine.sglang_backend",
            "class_name": "KVCacheStorage",
            "prefetch_threshold": 256,
            "cluster_file": str(shared_cluster.cluster_file),
            "credentials_file": str(shared_cluster.credentials_file),
            "model_name": "org/model",
            "model_revision": "abc",
            "sliding_window": 129,
            "swa_layers": 20,
        }
    )
    backend = KVCacheStorage(cfg, {})
    try:
        backend.register_mem_pool_host(HostPool(tokens=64, page_size=16))
        ns = backend._require_layout()
        assert ns.model == "org/model"
        assert ns.revision == "abc;engine=sglang;kv=host-page"
        # Tail re-prefill: the bounded replay unless the state at the hit is held.
        assert backend.reprefill_tail_tokens(77_000) == 128
        assert backend.reprefill_tail_tokens(77_000, state_held=True) == 0
        assert backend.replay_plan(100).tokens == 100  # a hit shorter than the replay
    finally:
        backend.close()


def test_a_model_without_sliding_window_reprefills_nothing(backend: Any) -> None:
    assert backend.reprefill_tail_tokens(4096) == 0
