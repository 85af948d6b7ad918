"""The vLLM connector's scheduler half (``kvcache.engine.vllm_scheduler.SchedulerSide``)
against a real 12-daemon cluster, driven the way vLLM's scheduler calls it, without vLLM:
requests are plain objects with the attributes vLLM's ``Request`` has."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import kvcache.engine.vllm_meta as vm
from kvcache.client import Client
from kvcache.engine.stats import StatsFile
from kvcache.engine.vllm_context import ConnectorContext, GroupRoles
from kvcache.engine.vllm_scheduler import SchedulerSide
from kvcache.layout import DType
from kvcache.testing.localcluster import LocalCluster

B = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("vllm-scheduler"))
    c.start(nodes=12, capacity="64MiB")
    yield c
    c.stop()


def side(cluster: LocalCluster) -> SchedulerSide:
    """A scheduler half for a one-group model of 16-token blocks (vLLM's ``build``, by hand)."""
    settings, overrides, swa = vm.split_extra_config(
        {"client_config": str(cluster.client_file), "match_wait_ms": 5000}
    )
    geometry = vm.KVGeometry(
        block_size=B,
        num_layers=2,
        page_bytes=16 * 2 * 2 * 2 * 16 * 4,
        dtype=DType.FLOAT32,
        packing="FullAttentionSpec,layout=LBHNC,heads=2,k=16,v=16,quant=NONE",
    )
    namespace = vm.make_namespace(
        model="test/scheduler", revision="1", geometry=geometry, parallel="tp0of1"
    )
    stats = vm.ConnectorStats(role="scheduler", pid=os.getpid(), namespace={})
    ctx = ConnectorContext(
        settings=settings,
        client_overrides=overrides,
        swa_overrides=swa,
        roles=GroupRoles(main=0),
        geometry=geometry,
        hybrid=None,
        namespace=namespace,
        state_namespace=None,
        load=True,
        save=True,
        stats=stats,
        stats_file=StatsFile(None, "scheduler", os.getpid()),
    )
    return SchedulerSide(ctx)


def request(req_id: str, prompt: list[int], **extra: Any) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=prompt,
        num_tokens=len(prompt),
        kv_transfer_params=None,
        lora_request=extra.get("lora_request"),
        cache_salt=extra.get("cache_salt"),
    )


def offer(s: SchedulerSide, req: SimpleNamespace, local: int) -> tuple[int | None, bool]:
    """vLLM's ask, repeated while the lookup is still out ("ask again")."""
    deadline = time.monotonic() + 30
    while True:
        got = s.get_num_new_matched_tokens(req, local)
        if got[0] is not None:
            return got
        assert time.monotonic() < deadline, "the lookup never answered"


def stored_prompt(cluster: LocalCluster, s: SchedulerSide, blocks: int, seed: int) -> list[int]:
    prompt = np.random.default_rng(seed).integers(0, 30_000, blocks * B + 1).tolist()
    ns = s.ctx.namespace
    payloads = np.zeros((blocks, ns.layout.payload_bytes), np.uint8)
    with Client(cluster.client_config()) as client:
        done = client.store(ns, prompt[: blocks * B], payloads)
        assert done.written + done.touched == blocks  # (stored by an earlier case: touched)
    return prompt


def test_an_offer_asked_again_counts_the_tokens_vllm_has_by_then(cluster: LocalCluster) -> None:
    """vLLM asks again when it could not allocate the request's blocks; by then its own
    prefix cache may hold part of the prompt. The connector answered with the offer of the
    first ask, so local + external tokens overran the prompt, vLLM's scheduler asserted and
    the engine died (prefix caching on, KV memory tight)."""
    s = side(cluster)
    try:
        prompt = stored_prompt(cluster, s, 16, seed=1)  # 257 tokens, 16 blocks stored
        req = request("r1", prompt)
        assert offer(s, req, 0) == (16 * B, True)
        ext, _ = offer(s, req, 4 * B)  # vLLM's prefix cache now holds 4 blocks of it
        assert ext == 12 * B and 4 * B + ext <= len(prompt)
        assert offer(s, req, 16 * B) == (0, False)  # it holds them all now: nothing to load
    finally:
        s.client.close()


@pytest.mark.parametrize(
    "extra",
    [{"lora_request": SimpleNamespace(lora_name="adapter", lora_int_id=1)}, {"cache_salt": "t2"}],
    ids=["lora", "cache-salt"],
)
def test_a_lora_or_salted_request_neither_loads_nor_saves(
    cluster: LocalCluster, extra: dict[str, Any]
) -> None:
    """Block keys name the model and the tokens, not a LoRA adapter nor a cache_salt: a LoRA
    request loaded the base model's KV for its prompt (and a base request a LoRA one's),
    and the engine produced other tokens. Such requests are not offered what is stored,
    and their blocks are not saved."""
    s = side(cluster)
    try:
        prompt = stored_prompt(cluster, s, 8, seed=2)
        assert offer(s, request("plain", prompt), 0) == (8 * B, True)
        req = request("isolated", prompt, **extra)
        assert offer(s, req, 0) == (0, False)
        assert s.ctx.stats.requests_isolated == 1
        new = vm.NewReq("isolated", prompt, list(range(9)), 0)
        plan = s.book.plan_step([new], [], {"isolated": len(prompt)}, {})
        assert plan.saves  # the book would save it...
        assert not s._without_isolated(plan).saves  # ...the connector does not
    finally:
        s.client.close()
