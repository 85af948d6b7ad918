"""DeepSeek V4.1 Flash's KV cache under vLLM 0.32's real scheduler, on the CPU, no weights.

Run with the vLLM venv's python: ``python dsv41.py CLUSTER.json OUT.json``. CLUSTER
holds ``cluster_file``, ``credentials_file`` and ``format`` (``sm100`` or ``sm90``).

What is vLLM's own here: ``VllmConfig`` (block size 128, or 64 for SM90, prefix caching
and chunked prefill on, the hybrid manager kept on because the connector is
``SupportsHMA``), the spec classes (``MLAAttentionSpec``, ``SlidingWindowMLASpec`` with
``bounded_replay``, ``CircularBufferSpec``), ``get_kv_cache_configs`` (which groups V4.1's
40 SWA layers into 7 groups, the 8 MLA/indexer layers into one mixed-page group and the 3
ring layers into one, in a block-outermost layout), ``generate_scheduler_kv_cache_config``
(the scheduler's flattened view), ``allocate_kv_cache`` (the shared backing allocation and
each layer's view of it), the ``Scheduler`` and ``Request``. The scheduler half of the
connector is built by vLLM's scheduler from the config; the worker half is kvcache's
``WorkerSide`` over the tensors ``allocate_kv_cache`` returned.

What is not: V4.1's model. Its per-layer cache modules need its HF config and its
``nvidia``/``amd`` paths (``torch.cuda.Stream``), so the per-layer specs are built here
with V4.1's parameters (records of 288 B nvfp4 MLA + 68 B MXFP4 indexer and 528 B SWA on
SM100; 584-byte records in 64-token blocks, fp8 indexer, on SM90), and the engine config
comes from a config-only Llama directory. The forward pass is replaced by nothing:
engine A's cache is filled with random bytes once, and every step's "model output" is
one sampled token per finished prefill, which is all the scheduler reads.

Cases (OUT records what each observed; ``tests/test_engine_vllm_dsv41.py`` asserts):
``held`` (a cached prefix whose state A holds), ``lost`` (the state withdrawn: bounded
replay), ``short`` (a hit of 128 tokens without a state), ``failed`` (the directory
names a holder that is gone: the claimed load fails), plus byte comparisons of ``held``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

REQUIRED_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
PROMPT = 1000  # 7 full blocks of 128 (15 of 64): the state is taken at 896 (960)


def llama_dir(path: Path) -> Path:
    from transformers import LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
    ).save_pretrained(path)
    return path


def v41_specs(fmt: str) -> tuple[int, dict[str, Any]]:
    """V4.1 Flash's per-layer KV specs: 40 layers, compress ratios [0,0]+[2]*18+[1]*20,
    KV sources [2, 8, 14, 20], window 128 with bounded replay, a 3-layer compressor ring."""
    import torch
    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SparseCacheRole,
    )

    block, mla_rec, mla_dtype, idx_rec, swa_rec, align = {
        "sm100": (128, 288, "nvfp4_ds_mla", 68, 528, 576),
        "sm90": (64, 584, "fp8_ds_mla", 132, 584, None),
    }[fmt]
    ratios = [0, 0] + [2] * 18 + [1] * 20
    specs: dict[str, Any] = {}
    for i in range(40):
        specs[f"model.layers.{i}.self_attn.swa_cache"] = SlidingWindowMLASpec(
            block_size=32,
            num_kv_heads=1,
            head_size=512,
            dtype=torch.uint8,
            sliding_window=128,
            bounded_replay=True,
            state_content_bytes=swa_rec,
            cache_dtype_str=mla_dtype,
            model_version="deepseek_v4",
        )
    for i in (2, 8, 14, 20):
        specs[f"model.layers.{i}.self_attn.mla_attn"] = MLAAttentionSpec(
            block_size=block,
            num_kv_heads=1,
            head_size=512,
            dtype=torch.uint8,
            tokens_per_state=ratios[i],
            cache_dtype_str=mla_dtype,
            state_content_bytes=mla_rec,
            model_version="deepseek_v4",
            alignment=align,
        )
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=block,
            num_kv_heads=1,
            head_size=128,
            dtype=torch.uint8,
            tokens_per_state=ratios[i],
            state_content_bytes=idx_rec,
            alignment=512,
            model_version="deepseek_v4",
            cache_role=SparseCacheRole.INDEXER,
        )
    for i in range(3):
        specs[f"model.layers.{i}.compressor.ring"] = CircularBufferSpec(
            block_size=8, num_kv_heads=1, head_size=1024, head_size_v=0, dtype=torch.float32
        )
    return block, specs


class Engine:
    """vLLM's scheduler (with kvcache's scheduler half inside) and kvcache's worker half
    over tensors vLLM allocated."""

    def __init__(self, name: str, fmt: str, model: Path, settings: dict[str, Any]) -> None:
        import torch
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_kv_cache_configs,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        from kvcache.engine.vllm_context import ConnectorContext
        from kvcache.engine.vllm_worker import WorkerSide

        self.name = name
        block, specs = v41_specs(fmt)
        self.block = block
        args = EngineArgs(
            model=str(model),
            skip_tokenizer_init=True,
            block_size=block,
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            max_model_len=4096,
            max_num_batched_tokens=4096,
            kv_transfer_config={
                "kv_connector": "KVCacheConnector",
                "kv_connector_module_path": "kvcache.engine.vllm_connector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": settings,
            },
        )
        config = args.create_engine_config()
        # The CPU platform's choices, undone where they matter to the cache: the block size
        # and prefix caching are what the probe of EngineArgs gives; the layout is V4.1's.
        assert config.cache_config.block_size == block
        assert config.cache_config.enable_prefix_caching
        assert not config.scheduler_config.disable_hybrid_kv_cache_manager
        # The engine core resolves the layout from the backends' supported sets; V4.1's
        # indexer backend allows only block-outermost ones, which resolves to BLHNC
        # (v1/attention/backends/mla/indexer.py).
        config.cache_config.kv_cache_layout = "BLHNC"
        (worker_cfg,) = get_kv_cache_configs(config, [specs], [256 << 20])
        self.worker_cfg = worker_cfg
        sched_cfg = generate_scheduler_kv_cache_config([worker_cfg])
        config.cache_config.num_gpu_blocks = int(worker_cfg.num_blocks)  # as the engine core does
        self.sched = Scheduler(
            vllm_config=config,
            kv_cache_config=sched_cfg,
            structured_output_manager=StructuredOutputManager(config),
            block_size=block,
            hash_block_size=block,
            log_stats=True,
        )
        self.connector = self.sched.connector
        # vLLM's own Prometheus path for connector stats (what its frontend's
        # PrometheusStatLogger does with each step's SchedulerStats.kv_connector_stats):
        # one KVConnectorProm per process, as in vLLM, with an engine label per Engine.
        self.prom, self.engine_idx = _prom(config, name)
        self.prom_name = name
        ctx = ConnectorContext.build(
            config,
            worker_cfg,
            role="worker",
            ranks={"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1},
        )
        self.worker = WorkerSide(
            ctx,
            num_blocks=int(worker_cfg.num_blocks),
            layers=[list(g.layer_names) for g in worker_cfg.kv_cache_groups],
            tensors=list(worker_cfg.kv_cache_tensors),
        )
        layout = config.cache_config.get_resolved_kv_cache_layout()
        self.kv = allocate_kv_cache(worker_cfg, torch.device("cpu"), layout)
        self.worker.register_kv_caches(self.kv)
        first = next(iter(self.kv.values()))
        self.backing = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
        self.spans = ctx.spans
        self.ctx = ctx

    def fill_random(self, seed: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.backing.copy_(
            torch.randint(0, 256, self.backing.shape, dtype=torch.uint8, generator=gen)
        )

    def block_bytes(self, group: int, block_id: int) -> bytes:
        span = self.spans[group]
        at = span.start + block_id * span.block_stride
        return bytes(self.backing[at : at + span.nbytes].numpy())

    def add(self, req_id: str, prompt: list[int]) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        request = Request(
            req_id,
            prompt,
            SamplingParams(max_tokens=2),
            None,
            block_hasher=get_request_block_hasher(self.block, sha256),
        )
        self.sched.add_request(request)

    def step(self) -> Any:
        """One engine step; returns vLLM's SchedulerOutput."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.sched.schedule()
        meta = out.kv_connector_metadata
        plan = getattr(meta, "plan", None)
        self.worker.bind(plan)
        self.worker.start_load(plan)
        self.worker.wait_for_save(plan)
        done, failed = self.worker.take_finished()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.sched.requests[rid]
            after = req.num_computed_tokens + out.num_scheduled_tokens[rid]
            sampled.append([7] if after >= req.num_prompt_tokens else [])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(finished_recving=done, failed_recving=failed),
        )
        outputs = self.sched.update_from_output(out, mro)
        for eco in outputs.values():
            stats = eco.scheduler_stats
            if stats is not None and stats.kv_connector_stats is not None:
                self.prom.observe(stats.kv_connector_stats, self.engine_idx)
        return out

    def metrics(self) -> dict[str, float]:
        """This engine's ``vllm:kvcache_*_total`` counters, read back from Prometheus."""
        from prometheus_client import REGISTRY

        out = {}
        for name in ("swa_state_restores", "swa_bounded_replays", "swa_full_recomputes",
                     "lookups", "requests_matched"):  # fmt: skip
            value = REGISTRY.get_sample_value(
                f"vllm:kvcache_{name}_total", {"engine": self.prom_name}
            )
            out[name] = float(value or 0.0)
        return out

    def wait_loads(self, timeout_s: float = 60.0) -> None:
        """Until the worker's loader has nothing queued (asynchronous loads)."""
        deadline = time.monotonic() + timeout_s
        while self.worker._loader._queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)

    def run_until_first_compute(self, req_id: str, limit: int = 400) -> dict[str, Any]:
        """Step until ``req_id`` is scheduled to compute; what vLLM decided for it."""
        for _ in range(limit):
            out = self.step()
            for r in out.scheduled_new_reqs:
                if r.req_id == req_id:
                    req = self.sched.requests[req_id]
                    return {
                        "num_computed_tokens": r.num_computed_tokens,
                        "replay_start": int(getattr(req, "replay_start", 0) or 0),
                        "block_ids": [list(g) for g in r.block_ids],
                        "claimed": self.connector._scheduler.claims(req_id),
                    }
            self.wait_loads()
            time.sleep(0.005)
        raise RuntimeError(f"{self.name}: {req_id} was never scheduled")

    def run_to_end(self, limit: int = 400) -> None:
        for _ in range(limit):
            if not self.sched.has_requests():
                break
            self.step()
            self.wait_loads()
        self.settle()

    def settle(self, timeout_s: float = 60.0) -> None:
        """Until every queued save and state is stored."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.ctx.lock:
                if self.ctx.stats.save_jobs_done == self.ctx.stats.save_jobs_queued:
                    break
            time.sleep(0.01)
        time.sleep(0.2)  # the tier registers states on its own thread

    def stats(self) -> dict[str, Any]:
        sched = self.connector._scheduler.ctx.stats.to_dict()
        return {"scheduler": sched, "worker": self.ctx.stats.to_dict()}

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()


ENGINE_NAMES = ("a", "a2", "a3", "b")
_PROM: list[Any] = []


def _prom(config: Any, name: str) -> tuple[Any, int]:
    """The process's one ``KVConnectorProm`` (Prometheus metrics register once) and the
    engine index of ``name``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    if not _PROM:
        labels = {i: [n] for i, n in enumerate(ENGINE_NAMES)}
        _PROM.append(KVConnectorProm(config, labelnames=["engine"], per_engine_labelvalues=labels))
    return _PROM[0], ENGINE_NAMES.index(name)


def main() -> None:
    for key, value in REQUIRED_ENV.items():
        if os.environ.get(key) != value:
            sys.exit(f"refusing to run vLLM without {key}={value}")
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    work = out_path.parent
    fmt = spec["format"]
    base = {
        "cluster_file": spec["cluster_file"],
        "credentials_file": spec["credentials_file"],
        "traffic_class": "chat",
        "timeout_s": 5.0,
        "model_name": f"dsv41-test-{fmt}",
        "match_wait_ms": 50,
    }
    model = llama_dir(work / "config-only")
    rng = random.Random(41)

    def prompt(n: int = PROMPT) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    held_p, lost_p, short_p, failed_p = prompt(), prompt(), prompt(150), prompt()
    result: dict[str, Any] = {"format": fmt}

    # A holds the state of `held`; A2 stores `lost` and `short` and withdraws its states;
    # A3 stores `failed` and goes away leaving its records (a dead holder).
    a = Engine("a", fmt, model, base | {"swa_ttl_s": 3600})
    a.fill_random(1)
    a.add("held", held_p)
    first = a.run_until_first_compute("held")
    a.run_to_end()
    result["a"] = {"first": first, "stats": a.stats()}
    result["geometry"] = {
        "bytes_per_token": a.ctx.geometry.bytes_per_token,
        "payload_bytes": a.ctx.geometry.payload_bytes,
        "namespace": a.ctx.stats.namespace,
        "state_bytes": a.ctx.hybrid.state_bytes(PROMPT // a.block * a.block),  # type: ignore[union-attr]
        "groups": [type(g.kv_cache_spec).__name__ for g in a.worker_cfg.kv_cache_groups],
        "group_block_sizes": [
            int(g.kv_cache_spec.block_size) for g in a.worker_cfg.kv_cache_groups
        ],
    }

    a2 = Engine("a2", fmt, model, base)
    a2.fill_random(2)
    a2.add("lost", lost_p)
    a2.add("short", short_p)
    a2.run_to_end()
    a2.close()  # withdraws its records: the states are gone

    a3 = Engine("a3", fmt, model, base | {"swa_withdraw_on_close": False, "swa_ttl_s": 3600})
    a3.fill_random(3)
    a3.add("failed", failed_p)
    a3.run_to_end()
    a3.close()  # its records stay, its endpoint is gone

    b = Engine("b", fmt, model, base)
    b.add("pad", prompt(300))  # other blocks first: B's block ids differ from A's
    b.run_to_end()
    for case, p in (("held", held_p), ("lost", lost_p), ("short", short_p), ("failed", failed_p)):
        b.add(case, p)
        result[case] = b.run_until_first_compute(case)
        if case == "held":
            result["bytes"] = compare(a, first["block_ids"], b, result[case]["block_ids"], PROMPT)
        b.run_to_end()
    result["b"] = {"stats": b.stats(), "metrics": b.metrics()}
    a.close()
    b.close()
    out_path.write_text(json.dumps(result))


def compare(
    a: Engine, a_ids: list[list[int]], b: Engine, b_ids: list[list[int]], prompt: int
) -> dict[str, Any]:
    """Byte differences between A's blocks and B's after B's load: every MLA block of the
    hit, the 4 window blocks of every SWA group, the ring block."""
    hybrid = a.ctx.hybrid
    assert hybrid is not None
    position = prompt // a.block * a.block
    first, end = hybrid.window_blocks(position)
    diffs: dict[str, int] = {}
    checked: dict[str, int] = {}

    def count(kind: str, group: int, x: int, y: int) -> None:
        da, db = a.block_bytes(group, x), b.block_bytes(group, y)
        diffs[kind] = diffs.get(kind, 0) + sum(1 for p, q in zip(da, db, strict=True) if p != q)
        checked[kind] = checked.get(kind, 0) + len(da)

    main = a.ctx.roles.main
    for i in range(position // a.block):
        count("mla", main, a_ids[main][i], b_ids[main][i])
    for g in hybrid.swa_groups:
        for i in range(first, end):
            count("swa", g, a_ids[g][i], b_ids[g][i])
    for g in hybrid.ring_groups:
        count("ring", g, a_ids[g][0], b_ids[g][0])
    moved = sum(a_ids[main][i] != b_ids[main][i] for i in range(position // a.block))
    return {"diff_bytes": diffs, "checked_bytes": checked, "mla_blocks_moved": moved}


if __name__ == "__main__":
    main()
