"""Retention hints through the engine adapters: the SGLang backend against a real cluster
(two calls of different classes end with their own expiries on every daemon), the parsing
both adapters share, and their one default class."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from retention_fixtures import shard_retention
from test_engine_sglang import HostPool, StorageConfig, page_hashes

from kvcache.client import ClientConfig
from kvcache.engine.hints import hint_from_params
from kvcache.engine.sglang_backend import KVCacheStorage
from kvcache.engine.vllm_plan import SaveSpec, StepPlan
from kvcache.retention import Hint
from kvcache.retention.decide import write_expiry
from kvcache.testing.localcluster import LocalCluster

DAY_MS = 86_400_000
#: The class every engine adapter uses for a request without a hint: the client's default.
ENGINE_DEFAULT = ClientConfig.__dataclass_fields__["traffic_class"].default


@dataclass
class ExtraInfo:
    """SGLang's HiCacheStorageExtraInfo (sglang.srt.mem_cache.hicache_storage), its two fields."""

    prefix_keys: list[str] | None = None
    extra_info: dict[str, Any] | None = None


def hinted(**fields: Any) -> ExtraInfo:
    return ExtraInfo(extra_info={"kvcache": fields})


@pytest.fixture
def backend(shared_cluster: LocalCluster) -> Any:
    cfg = StorageConfig(
        extra_config={
            "cluster_file": str(shared_cluster.cluster_file),
            "credentials_file": str(shared_cluster.credentials_file),
        }
    )
    b = KVCacheStorage(cfg, {})
    b.register_mem_pool_host(HostPool(tokens=16 * 32, page_size=16))
    yield b
    b.close()


def test_sglang_calls_of_two_classes_keep_their_own_expiries(
    backend: Any, shared_cluster: LocalCluster
) -> None:
    agent, chat, plain = page_hashes(3, "hint-a"), page_hashes(3, "hint-c"), page_hashes(2, "p")
    before = int(time.time() * 1000)
    ok = backend.batch_set_v1(agent, torch.arange(0, 48), hinted(traffic_class="agent", ttl="2h"))
    assert ok == [True] * 3
    assert (
        backend.batch_set_v1(chat, torch.arange(48, 96), hinted(traffic_class="chat")) == [True] * 3
    )
    assert backend.batch_set_v1(plain, torch.arange(96, 128)) == [True] * 2
    after = int(time.time() * 1000)
    ns = backend._require_layout()
    keys_a, keys_c, keys_p = (backend._keys(ns, h) for h in (agent, chat, plain))
    held = shard_retention(shared_cluster, [*keys_a, *keys_c, *keys_p])
    for keys, cls, ttl_ms in (
        (keys_a, "agent", 2 * 3_600_000),
        (keys_c, "chat", 7 * DAY_MS),
        (keys_p, ENGINE_DEFAULT, 3 * DAY_MS),  # the adapters' one default
    ):
        for key in keys:
            assert len(held[key]) == 12
            for _node, expiry, name in held[key]:
                assert name == cls
                assert before + ttl_ms <= expiry <= write_expiry(after, ttl_ms // 1000)


def test_sglang_store_false_and_a_bad_hint_never_fail_the_call(backend: Any) -> None:
    keys = page_hashes(2, "declined")
    assert backend.batch_set_v1(keys, torch.arange(0, 32), hinted(store=False)) == [True] * 2
    assert backend.batch_exists(keys) == 0
    assert backend.get_stats()["pages_declined"] == 2
    bad = page_hashes(2, "bad-hint")
    assert backend.batch_set_v1(bad, torch.arange(0, 32), hinted(ttl="forever")) == [True] * 2
    assert backend.batch_exists(bad) == 2  # stored under the backend's class
    assert backend.get_stats()["hints_bad"] == 1
    assert backend.batch_get_v1(bad, torch.arange(64, 96), hinted(pin="yes")) == [True] * 2
    assert backend.get_stats()["hints_bad"] == 2


def test_hint_parsing_is_shared_and_never_raises() -> None:
    assert hint_from_params(None, request="r") == (None, None)
    assert hint_from_params({"other": 1}, request="r") == (None, None)
    assert hint_from_params({"kvcache": {}}, request="r") == (None, None)
    hint, error = hint_from_params(
        {"kvcache": {"traffic_class": "agent", "ttl": 3600, "pin": True}}, request="r"
    )
    assert hint == Hint(traffic_class="agent", ttl_s=3600, pin=True) and error is None
    hint, error = hint_from_params({"kvcache": {"ttl": -1}}, request="r7")
    assert hint is None and error is not None and "ttl" in error
    hint, error = hint_from_params({"kvcache": "agent"}, request="r8")
    assert hint is None and error is not None and "object" in error


def test_one_default_class_for_every_adapter(shared_cluster: LocalCluster) -> None:
    backend = KVCacheStorage(
        StorageConfig(
            extra_config={
                "cluster_file": str(shared_cluster.cluster_file),
                "credentials_file": str(shared_cluster.credentials_file),
            }
        ),
        {},
    )
    try:
        assert backend._traffic_class == ENGINE_DEFAULT == "default"
    finally:
        backend.close()


def test_a_step_plan_carries_hints_and_pickles() -> None:
    import pickle

    import numpy as np

    plan = StepPlan(
        saves=(SaveSpec("r1", np.arange(32, dtype=np.uint32), 0, (1,)),),
        hints={"r1": Hint(traffic_class="agent", ttl_s=60)},
    )
    assert pickle.loads(pickle.dumps(plan)).hints["r1"] == Hint(traffic_class="agent", ttl_s=60)
