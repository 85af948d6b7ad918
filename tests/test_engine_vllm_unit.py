"""The vLLM connector's planning logic (kvcache.engine.vllm_meta), without vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import Future

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache.engine.vllm_meta as vm
from kvcache.errors import ConfigError
from kvcache.layout import DType

B = 32


def geometry(**kw: object) -> vm.KVGeometry:
    args: dict[str, object] = {
        "block_size": B,
        "num_layers": 2,
        "page_bytes": 16384,
        "dtype": DType.FLOAT32,
        "packing": "FullAttentionSpec,layout=LBHNC,heads=2,k=32,v=32,quant=NONE",
    }
    args.update(kw)
    return vm.KVGeometry(**args)  # type: ignore[arg-type]


def test_public_names_are_pinned() -> None:
    assert sorted(vm.__all__) == [
        "CachedReq",
        "ConnectorSettings",
        "ConnectorStats",
        "FetchPlanner",
        "KVGeometry",
        "LoadMode",
        "LoadSpec",
        "MIN_PREFILL_STEP_TOKENS",
        "NewReq",
        "PendingMatches",
        "SaveSpec",
        "SchedulerBook",
        "StepPlan",
        "external_tokens",
        "failed_block_ids",
        "loadable_blocks",
        "make_namespace",
        "namespace_dict",
        "namespace_from_dict",
        "page_ids",
        "parallel_name",
        "split_extra_config",
    ]


def test_engine_package_does_not_import_vllm() -> None:
    code = (
        "import sys, kvcache.engine, kvcache.engine.vllm_meta; "
        "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.') "
        "or m == 'kvcache.engine.vllm_connector']; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------- settings


def test_extra_config_splits_connector_and_client_settings() -> None:
    settings, client, _ = vm.split_extra_config(
        {
            "cluster_file": "/etc/kvcache/cluster.toml",
            "traffic_class": "chat",
            "timeout_s": 3,
            "stats_dir": "/tmp/stats",
            "model_name": "llama",
            "match-wait-ms": "5",
        }
    )
    assert client == {
        "cluster_file": "/etc/kvcache/cluster.toml",
        "traffic_class": "chat",
        "timeout_s": 3,
    }
    assert settings.model_name == "llama"
    assert settings.match_wait_ms == 5.0
    assert str(settings.stats_dir) == "/tmp/stats"


def test_extra_config_needs_a_cluster() -> None:
    with pytest.raises(ConfigError, match="cluster_file"):
        vm.split_extra_config({"traffic_class": "chat"})
    settings, client, _ = vm.split_extra_config({"client_config": "/etc/kvcache/client.toml"})
    assert client == {} and settings.client_config is not None


def test_extra_config_rejects_unknown_keys_and_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'clustr_file'.*cluster_file"):
        vm.split_extra_config({"clustr_file": "x"})


@pytest.mark.parametrize(
    "bad",
    [
        {"match_wait_ms": -1},
        {"match_wait_ms": 10, "match_deadline_ms": 5},
        # Past what a thread's timeout holds: passed start-up, then killed the engine.
        {"match_wait_ms": 1e13, "match_deadline_ms": 1e13},
        {"max_pending_save_mb": 0},
        {"match_wait_ms": "soon"},
        {"load_mode": "eventually"},
        {"recompute_margin": -0.5},
        {"load_gbps": 0},
        {"prefill_tokens_per_s": -1},
    ],
)
def test_extra_config_rejects_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        vm.split_extra_config({"cluster_file": "c.toml", **bad})


def test_load_mode_and_fetch_settings_parse() -> None:
    settings, client, _ = vm.split_extra_config({"cluster_file": "c.toml"})
    assert settings.load_mode is vm.LoadMode.ASYNC and settings.recompute_margin == 1.0
    settings, client, _ = vm.split_extra_config(
        {"cluster_file": "c.toml", "load_mode": "sync", "recompute_margin": "1.5", "load_gbps": 4}
    )
    assert settings.load_mode is vm.LoadMode.SYNC
    assert (settings.recompute_margin, settings.load_gbps) == (1.5, 4.0)
    assert client == {"cluster_file": "c.toml"}


def test_empty_model_name_means_vllms_own() -> None:
    settings, _, _ = vm.split_extra_config({"cluster_file": "c.toml", "model_name": ""})
    assert settings.model_name is None
    with pytest.raises(ConfigError):
        vm.ConnectorSettings(model_name="")


# ---------------------------------------------------------------------- namespace


def test_geometry_gives_the_block_layout() -> None:
    g = geometry()
    layout = g.kv_layout()
    assert g.payload_bytes == 2 * 16384
    assert layout.tokens_per_block == B
    assert layout.payload_bytes == g.payload_bytes
    assert layout.layers_in_block == 2
    assert layout.dtype is DType.FLOAT32


def test_geometry_refuses_pages_that_do_not_split_into_tokens() -> None:
    with pytest.raises(ConfigError, match="does not split"):
        geometry(num_layers=1, page_bytes=16385)
    with pytest.raises(ConfigError):
        geometry(block_size=0)


def test_parallel_name() -> None:
    assert vm.parallel_name(tp_rank=0, tp_size=1) == "tp0of1"
    assert vm.parallel_name(tp_rank=3, tp_size=8) == "tp3of8"
    assert vm.parallel_name(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2) == "tp1of2-pp1of2"
    with pytest.raises(ConfigError):
        vm.parallel_name(tp_rank=2, tp_size=2)


def test_namespace_separates_everything_that_changes_kv_bytes() -> None:
    def ns(**kw: object) -> bytes:
        args: dict[str, object] = {
            "model": "m",
            "revision": "r1",
            "geometry": geometry(),
            "parallel": "tp0of1",
        }
        args.update(kw)
        return vm.make_namespace(**args).seed  # type: ignore[arg-type]

    base = ns()
    variants = [
        ns(model="other"),
        ns(revision="r2"),
        ns(geometry=geometry(packing="FullAttentionSpec,layout=LBNHC,heads=2,k=32,v=32")),
        ns(geometry=geometry(dtype=DType.BFLOAT16)),
        ns(geometry=geometry(block_size=64)),
        ns(geometry=geometry(num_layers=4, page_bytes=8192)),
        ns(parallel="tp1of2"),
        ns(tenant="t2"),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_namespace_revision_format_is_pinned() -> None:
    ns = vm.make_namespace(model="m", revision=None, geometry=geometry(), parallel="tp0of1")
    assert ns.revision == (
        "unversioned;engine=vllm;kv=FullAttentionSpec,layout=LBHNC,heads=2,k=32,v=32,quant=NONE"
    )


def test_namespace_round_trips_through_json() -> None:
    ns = vm.make_namespace(model="m", revision="abc", geometry=geometry(), parallel="tp0of1")
    data = json.loads(json.dumps(vm.namespace_dict(ns)))
    assert vm.namespace_from_dict(data) == ns
    assert vm.namespace_from_dict(data).seed == ns.seed
    data["seed"] = "00" * 16
    with pytest.raises(ConfigError, match="seed"):
        vm.namespace_from_dict(data)


# ---------------------------------------------------------------------- what to load


def test_loadable_blocks_leaves_a_token_to_compute() -> None:
    assert vm.loadable_blocks(prompt_tokens=100, num_tokens=100, block_size=B) == 3
    assert vm.loadable_blocks(prompt_tokens=96, num_tokens=96, block_size=B) == 2
    assert vm.loadable_blocks(prompt_tokens=97, num_tokens=97, block_size=B) == 3
    assert vm.loadable_blocks(prompt_tokens=1, num_tokens=1, block_size=B) == 0
    assert vm.loadable_blocks(prompt_tokens=0, num_tokens=0, block_size=B) == 0
    # A resumed request has output tokens: all full prompt blocks may load.
    assert vm.loadable_blocks(prompt_tokens=96, num_tokens=101, block_size=B) == 3


@given(
    prompt=st.integers(0, 2000),
    extra=st.integers(0, 100),
    block=st.sampled_from([1, 16, 32, 128]),
    hit=st.integers(0, 100),
    local_blocks=st.integers(0, 100),
)
def test_external_tokens_are_aligned_and_leave_work(
    prompt: int, extra: int, block: int, hit: int, local_blocks: int
) -> None:
    num_tokens = prompt + extra
    loadable = vm.loadable_blocks(prompt_tokens=prompt, num_tokens=num_tokens, block_size=block)
    local = min(local_blocks, loadable) * block
    ext = vm.external_tokens(
        hit_blocks=hit, local_tokens=local, loadable=loadable, block_size=block
    )
    assert ext >= 0 and ext % block == 0
    assert local + ext <= min(hit * block, loadable * block) or ext == 0
    if ext:
        assert local + ext < num_tokens  # vLLM still computes a token
        assert local + ext <= prompt  # only prompt blocks are stored


# ---------------------------------------------------------------------- scheduler book


def test_book_plans_a_load_then_saves_the_rest_of_the_prompt() -> None:
    prompt = list(range(3, 3 + 160))  # 5 full blocks
    book = vm.SchedulerBook(block_size=B)
    book.on_alloc("r", prompt, local_tokens=0, external=4 * B)
    ids = [10, 11, 12, 13, 14, 15]
    plan = book.plan_step([vm.NewReq("r", prompt, ids, 4 * B)], [], {"r": 160 - 4 * B})
    (load,) = plan.loads
    assert (load.first_block, load.end_block, load.block_ids) == (0, 4, (10, 11, 12, 13))
    assert load.tokens.tolist() == prompt[: 4 * B]
    (save,) = plan.saves
    assert (save.first_block, save.block_ids) == (4, (14,))
    assert save.tokens.tolist() == prompt[: 5 * B]
    # The load is planned once.
    later = book.plan_step([], [vm.CachedReq("r", False, None, 160)], {"r": 1})
    assert later == vm.StepPlan(step_tokens=1)


def test_book_load_after_a_local_prefix_hit_starts_after_it() -> None:
    prompt = list(range(200))
    book = vm.SchedulerBook(block_size=B)
    book.on_alloc("r", prompt, local_tokens=2 * B, external=3 * B)
    plan = book.plan_step([vm.NewReq("r", prompt, list(range(7)), 5 * B)], [], {"r": 200 - 5 * B})
    (load,) = plan.loads
    assert (load.first_block, load.block_ids) == (2, (2, 3, 4))
    assert len(load.tokens) == 5 * B
    (save,) = plan.saves
    assert (save.first_block, save.block_ids) == (5, (5,))


def test_book_saves_each_block_once_across_prefill_chunks() -> None:
    prompt = list(range(100))
    book = vm.SchedulerBook(block_size=B)
    p1 = book.plan_step([vm.NewReq("r", prompt, [7, 8], 0)], [], {"r": 40})
    assert [(s.first_block, s.block_ids) for s in p1.saves] == [(0, (7,))]
    p2 = book.plan_step([], [vm.CachedReq("r", False, [9, 20], 40)], {"r": 60})
    assert [(s.first_block, s.block_ids) for s in p2.saves] == [(1, (8, 9))]
    assert len(p2.saves[0].tokens) == 3 * B
    # Decode steps: the prompt's last partial block and generated tokens are not stored.
    p3 = book.plan_step([], [vm.CachedReq("r", False, None, 100)], {"r": 1})
    assert p3.saves == ()


def test_book_resumed_request_replaces_its_blocks() -> None:
    prompt = list(range(64 + 5))
    book = vm.SchedulerBook(block_size=B)
    book.plan_step([vm.NewReq("r", prompt, [1, 2, 3], 0)], [], {"r": 69})
    book.on_alloc("r", prompt, local_tokens=0, external=2 * B)
    plan = book.plan_step([], [vm.CachedReq("r", True, [40, 41, 42], 2 * B)], {"r": 5})
    (load,) = plan.loads
    assert load.block_ids == (40, 41)
    assert plan.saves == ()


def test_book_never_saves_speculative_tokens() -> None:
    prompt = list(range(64))
    book = vm.SchedulerBook(block_size=B)
    book.plan_step([vm.NewReq("r", prompt, [1, 2], 0)], [], {"r": 40})
    # 24 real tokens would complete block 1, but 4 of the 28 scheduled are speculative.
    plan = book.plan_step([], [vm.CachedReq("r", False, None, 40)], {"r": 28}, {"r": 4})
    assert [(s.first_block, s.block_ids) for s in plan.saves] == [(1, (2,))]
    plan = book.plan_step([], [vm.CachedReq("r", False, None, 40)], {"r": 27}, {"r": 4})
    assert plan.saves == ()


def test_book_roles_and_unscheduled_loads() -> None:
    prompt = list(range(100))
    consumer = vm.SchedulerBook(block_size=B, save=False)
    assert consumer.plan_step([vm.NewReq("r", prompt, [1, 2, 3, 4], 0)], [], {"r": 100}).saves == ()
    producer = vm.SchedulerBook(block_size=B, load=False)
    producer.on_alloc("r", prompt, local_tokens=0, external=B)
    assert producer.plan_step([vm.NewReq("r", prompt, [1, 2, 3, 4], B)], [], {"r": 68}).loads == ()
    book = vm.SchedulerBook(block_size=B)
    book.on_alloc("r", prompt, local_tokens=0, external=B)
    assert book.plan_step([], [], {}).loads == ()  # not scheduled: kept
    assert len(book.plan_step([vm.NewReq("r", prompt, [5, 6, 7, 8], B)], [], {"r": 68}).loads) == 1
    book.on_finished("r")
    assert len(book) == 0


def test_book_plans_an_async_load_before_the_request_is_scheduled() -> None:
    prompt = list(range(5 * B + 3))
    book = vm.SchedulerBook(block_size=B)
    book.on_alloc("r", prompt, local_tokens=B, external=3 * B, block_ids=[9, 8, 7, 6, 5])
    # The request waits for its load, so it is in no scheduled list; the load goes out anyway.
    plan = book.plan_step([], [], {"other": 300})
    (load,) = plan.loads
    assert load.asynchronous
    assert (load.first_block, load.block_ids) == (1, (8, 7, 6))
    assert load.tokens.tolist() == prompt[: 4 * B]
    assert plan.saves == () and plan.step_tokens == 300
    # Planned once; when the load is done vLLM schedules the request from the hit onward,
    # and only the blocks computed then are saved.
    assert book.plan_step([], [], {}).loads == ()
    plan = book.plan_step([vm.NewReq("r", prompt, [9, 8, 7, 6, 5, 4], 4 * B)], [], {"r": B + 3})
    assert plan.loads == ()
    assert [(s.first_block, s.block_ids) for s in plan.saves] == [(4, (5,))]


def test_book_refuses_an_async_load_into_too_few_blocks() -> None:
    book = vm.SchedulerBook(block_size=B)
    with pytest.raises(ConfigError, match="only 2 blocks"):
        book.on_alloc("r", list(range(100)), local_tokens=0, external=3 * B, block_ids=[1, 2])


def test_book_rejects_unaligned_loads_and_missing_blocks() -> None:
    book = vm.SchedulerBook(block_size=B)
    with pytest.raises(ConfigError):
        book.on_alloc("r", list(range(100)), local_tokens=5, external=B)
    book.on_alloc("r", list(range(100)), local_tokens=0, external=3 * B)
    with pytest.raises(ConfigError, match="only 2 blocks"):
        book.plan_step([vm.NewReq("r", list(range(100)), [1, 2], 3 * B)], [], {"r": 4})


def test_book_ignores_prompt_embeddings() -> None:
    book = vm.SchedulerBook(block_size=B)
    plan = book.plan_step([vm.NewReq("r", None, [1, 2, 3], 0)], [], {"r": 90})
    assert plan == vm.StepPlan(step_tokens=90) and len(book) == 0


@settings(max_examples=200, deadline=None)
@given(
    prompt_len=st.integers(1, 400),
    hit=st.integers(0, 12),
    chunks=st.lists(st.integers(1, 90), min_size=1, max_size=30),
)
def test_book_saves_exactly_the_blocks_computed_here(
    prompt_len: int, hit: int, chunks: list[int]
) -> None:
    """Over any chunking, every full prompt block past the loaded ones is saved exactly once,
    with the right vLLM block and the right tokens, and no loaded block is saved."""
    prompt = list(range(1000, 1000 + prompt_len))
    loadable = vm.loadable_blocks(prompt_tokens=prompt_len, num_tokens=prompt_len, block_size=B)
    ext = vm.external_tokens(hit_blocks=hit, local_tokens=0, loadable=loadable, block_size=B)
    book = vm.SchedulerBook(block_size=B)
    book.on_alloc("r", prompt, local_tokens=0, external=ext)
    computed = ext
    block_of = {}  # prompt block index -> vLLM block id
    next_id = 500
    saved: list[int] = []
    loaded: list[int] = []
    first = True
    for chunk in chunks:
        if computed >= prompt_len:
            break
        n = min(chunk, prompt_len - computed)
        have = len(block_of)
        need = -(-(computed + n) // B)
        new_ids = list(range(next_id, next_id + need - have))
        next_id += len(new_ids)
        block_of.update({have + i: b for i, b in enumerate(new_ids)})
        if first:
            plan = book.plan_step([vm.NewReq("r", prompt, new_ids, computed)], [], {"r": n})
            first = False
        else:
            plan = book.plan_step([], [vm.CachedReq("r", False, new_ids, computed)], {"r": n})
        for load in plan.loads:
            loaded.extend(range(load.first_block, load.end_block))
            assert load.block_ids == tuple(
                block_of[i] for i in range(load.first_block, load.end_block)
            )
        for save in plan.saves:
            assert save.tokens.tolist() == prompt[: save.end_block * B]
            assert save.block_ids == tuple(
                block_of[i] for i in range(save.first_block, save.end_block)
            )
            saved.extend(range(save.first_block, save.end_block))
        computed += n
    assert loaded == list(range(ext // B))
    full = prompt_len // B
    expected = list(range(ext // B, full)) if computed >= prompt_len else None
    if expected is not None:
        assert saved == expected
    assert len(saved) == len(set(saved)) and not set(saved) & set(loaded)


# ---------------------------------------------------------------------- ask again


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def done(value: int) -> Future[int]:
    f: Future[int] = Future()
    f.set_result(value)
    return f


def test_pending_match_answers_at_once_when_the_lookup_is_back() -> None:
    pm = vm.PendingMatches(wait_s=0.0, deadline_s=1.0, clock=Clock())
    starts: list[int] = []

    def start() -> Future[int]:
        starts.append(1)
        return done(4)

    assert pm.poll("r", start) == 4
    assert pm.poll("r", start) == 4  # asked again: same answer, no second lookup
    assert starts == [1]
    pm.forget("r")
    assert len(pm) == 0


def test_pending_match_says_ask_again_then_gives_up_at_the_deadline() -> None:
    clock = Clock()
    pm = vm.PendingMatches(wait_s=0.0, deadline_s=2.0, clock=clock)
    slow: Future[int] = Future()
    assert pm.poll("r", lambda: slow) is None
    clock.now = 1.0
    assert pm.poll("r", lambda: slow) is None
    slow_done = pm.deferred
    clock.now = 2.5
    assert pm.poll("r", lambda: slow) == 0
    assert slow.cancelled() and pm.timeouts == 1 and slow_done == 2
    assert pm.poll("r", lambda: slow) == 0  # the miss sticks until forgotten


def test_pending_match_returns_a_late_answer_before_the_deadline() -> None:
    clock = Clock()
    pm = vm.PendingMatches(wait_s=0.0, deadline_s=2.0, clock=clock)
    fut: Future[int] = Future()
    assert pm.poll("r", lambda: fut) is None
    fut.set_result(3)
    assert pm.poll("r", lambda: fut) == 3


def test_pending_match_waits_briefly_for_a_fresh_lookup_only() -> None:
    waits: list[float] = []
    fut: Future[int] = Future()

    def wait(future: Future[int], seconds: float) -> None:
        waits.append(seconds)
        future.set_result(5)  # the lookup comes back while the scheduler waits

    pm = vm.PendingMatches(wait_s=0.05, deadline_s=1.0, clock=Clock(), wait=wait)
    assert pm.poll("r", lambda: fut) == 5
    assert pm.poll("r", lambda: fut) == 5  # asked again: no second wait
    assert waits == [0.05]


def test_pending_match_treats_a_failed_lookup_as_a_miss() -> None:
    pm = vm.PendingMatches(wait_s=0.0, deadline_s=1.0, clock=Clock())
    bad: Future[int] = Future()
    bad.set_exception(OSError("node down"))
    assert pm.poll("r", lambda: bad) == 0
    assert pm.errors == 1


# ---------------------------------------------------------------------- fetch or recompute

KV_PER_TOKEN = 128 << 10  # Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 x bf16


def test_fetch_planner_offers_every_hit_until_it_knows_both_rates() -> None:
    planner = vm.FetchPlanner(margin=1.0)
    assert planner.predicted(1000, KV_PER_TOKEN) is None
    assert planner.fetch(32768, KV_PER_TOKEN)
    planner.record_load(10 << 30, 1.0)
    assert planner.predicted(1000, KV_PER_TOKEN) is None  # prefill rate still unknown
    assert planner.fetch(32768, KV_PER_TOKEN)
    assert (planner.fetched, planner.recomputed) == (2, 0)


def test_fetch_planner_recomputes_when_the_store_is_slower_than_the_engine() -> None:
    # Break-even at 25K tok/s x 128 KiB = 3.3 GB/s.
    fast = vm.FetchPlanner(margin=1.0, load_gbps=10.0, prefill_tokens_per_s=25_000)
    assert fast.fetch(32768, KV_PER_TOKEN)
    slow = vm.FetchPlanner(margin=1.0, load_gbps=1.0, prefill_tokens_per_s=25_000)
    assert not slow.fetch(32768, KV_PER_TOKEN)
    assert (slow.fetched, slow.recomputed) == (0, 1)
    load_s, recompute_s = fast.predicted(32768, KV_PER_TOKEN) or (0.0, 0.0)
    assert load_s == pytest.approx(0.002 + 32768 * KV_PER_TOKEN / 10e9)
    assert recompute_s == pytest.approx(32768 / 25_000)


def test_fetch_planner_margin_and_fixed_overhead() -> None:
    # 4 GB/s against 25K tok/s: loading takes 0.82 of recomputing a long hit.
    planner = vm.FetchPlanner(margin=1.0, load_gbps=4.0, prefill_tokens_per_s=25_000)
    assert planner.fetch(32768, KV_PER_TOKEN)
    planner.margin = 1.5  # demand a 1.5x advantage: not met
    assert not planner.fetch(32768, KV_PER_TOKEN)
    planner.margin = 0  # every hit
    assert planner.fetch(32768, KV_PER_TOKEN)
    planner.margin = 1.0
    assert not planner.fetch(16, KV_PER_TOKEN)  # one block: the fixed overhead dominates


def test_fetch_planner_learns_rates_from_samples() -> None:
    planner = vm.FetchPlanner(margin=1.0, load_gbps=10.0, prefill_tokens_per_s=25_000)
    assert planner.fetch(32768, KV_PER_TOKEN)
    for _ in range(40):  # the store degrades to 1 GB/s
        planner.record_load(1 << 30, (1 << 30) / 1e9)
    assert planner.load_gbps == pytest.approx(1.0, rel=0.01)
    assert not planner.fetch(32768, KV_PER_TOKEN)
    # Decode-sized steps and empty samples teach nothing.
    planner.record_step(vm.MIN_PREFILL_STEP_TOKENS - 1, 1e-6)
    planner.record_load(0, 1.0)
    planner.record_step(4096, 0.0)
    assert planner.prefill_tokens_per_s == 25_000 and planner.load_gbps == pytest.approx(1.0, 0.01)
    for _ in range(30):  # the engine slows to 5K tok/s (long contexts)
        planner.record_step(4096, 4096 / 5_000)
    assert planner.prefill_tokens_per_s == pytest.approx(5_000, rel=0.01)
    assert planner.fetch(32768, KV_PER_TOKEN)  # 1 GB/s beats 0.66 GB/s of recompute


@given(
    gbps=st.floats(0.05, 100),
    rate=st.floats(100, 200_000),
    tokens=st.integers(1, 200_000),
    margin=st.floats(0, 4),
)
def test_fetch_planner_offers_exactly_when_predicted_faster(
    gbps: float, rate: float, tokens: int, margin: float
) -> None:
    planner = vm.FetchPlanner(margin=margin, load_gbps=gbps, prefill_tokens_per_s=rate)
    load_s, recompute_s = planner.predicted(tokens, KV_PER_TOKEN) or (0.0, 0.0)
    assert planner.fetch(tokens, KV_PER_TOKEN) == (margin == 0 or load_s * margin <= recompute_s)


# ---------------------------------------------------------------------- worker side


def test_page_ids_map_blocks_to_kernel_pages() -> None:
    assert vm.page_ids([3, 7], 1).tolist() == [[3], [7]]
    assert vm.page_ids([3, 7], 2).tolist() == [[6, 7], [14, 15]]
    assert vm.page_ids([], 2).shape == (0, 2)


def test_failed_blocks_are_everything_from_the_first_missing_one() -> None:
    spec = vm.LoadSpec("r", np.zeros(4 * B, np.uint32), 1, (11, 12, 13))
    assert vm.failed_block_ids(spec, 3) == ()
    assert vm.failed_block_ids(spec, 1) == (12, 13)
    assert vm.failed_block_ids(spec, 0) == (11, 12, 13)
    with pytest.raises(ValueError):
        vm.failed_block_ids(spec, 4)


def test_stats_are_json() -> None:
    stats = vm.ConnectorStats(role="worker", pid=1)
    stats.blocks_loaded += 2
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["blocks_loaded"] == 2 and data["role"] == "worker"
