"""kvcache as a vLLM v1 KV connector: prompt blocks are stored once and loaded by any engine.

Configure it in vLLM (no code change in vLLM)::

    LLM(model=...,
        kv_transfer_config={
            "kv_connector": "KVCacheConnector",
            "kv_connector_module_path": "kvcache.engine.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cluster_file": "/etc/kvcache/cluster.toml",
                                          "traffic_class": "chat"},
        })

vLLM runs the connector twice: a scheduler half in the engine-core process
(prefix lookups, planning) and a worker half in each worker process (moving
bytes). They share only the per-step :class:`KVCacheConnectorMetadata`. The
planning lives in :mod:`kvcache.engine.vllm_meta` (pure, tested without
vLLM); this module translates vLLM's objects and does the I/O.

- Scheduler: ``get_num_new_matched_tokens`` looks the prompt's full blocks up
  (``match_prefix``) on a helper thread; a lookup that is not back within
  ``match_wait_ms`` answers ``None``, vLLM's "ask again next step", so a slow
  store never stalls scheduling. A hit is offered only when loading it is
  predicted to beat recomputing it (fetch or recompute, from the load
  bandwidth and prefill rate the workers measure and send back through
  ``build_connector_worker_meta``). By default the load is asynchronous: the
  request waits in WAITING_FOR_REMOTE_KVS while others compute.
  ``update_state_after_alloc`` plans the load, ``build_connector_meta`` plans
  loads and saves, ``request_finished`` forgets.
- Worker: ``register_kv_caches`` wraps the per-layer caches in a
  :class:`~kvcache.engine.PagedKVAdapter` indexed by the scheduler's block
  ids. ``start_load_kv`` hands asynchronous loads to a loader thread (which
  loads verified bytes, scatters them and reports the request through
  ``get_finished``) and runs synchronous ones before the forward. Blocks that
  did not arrive are returned by ``get_block_ids_with_load_errors`` and vLLM
  recomputes them. ``wait_for_save`` starts gathering the step's completed
  prompt blocks from the registered caches (the ``kv_layer`` given to
  ``save_kv_layer`` may number blocks differently, so it is not used) into
  host memory and hands them to a writer thread; it never waits for the copy.

This is the only module of kvcache that imports vLLM; ``kvcache.engine`` does
not import it, so the package works without vLLM.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvcache.client import Client, ClientConfig
from kvcache.engine.paged import PagedKVAdapter, TransferHandle, kv_dtype
from kvcache.engine.vllm_meta import (
    MIN_PREFILL_STEP_TOKENS,
    CachedReq,
    ConnectorStats,
    FetchPlanner,
    KVGeometry,
    LoadMode,
    LoadSpec,
    NewReq,
    PendingMatches,
    SchedulerBook,
    StepPlan,
    external_tokens,
    failed_block_ids,
    loadable_blocks,
    make_namespace,
    namespace_dict,
    page_ids,
    parallel_name,
    split_extra_config,
)
from kvcache.errors import ConfigError
from kvcache.keys import Namespace, TokenArray, block_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVCacheConnector", "KVCacheConnectorMetadata", "KVCacheWorkerMetadata"]

log = logging.getLogger(__name__)

#: How long shutdown waits for queued saves to reach the store.
SHUTDOWN_DRAIN_S = 30.0


class KVCacheConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM: untyped here
    """One step's plan, sent by vLLM from the scheduler half to every worker half."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVCacheWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]  # vLLM: untyped
    """Measurements sent back from the worker halves: what the scheduler's
    :class:`~kvcache.engine.vllm_meta.FetchPlanner` learns its rates from.

    ``loads`` holds (bytes, seconds) of finished loads, ``steps`` (tokens,
    seconds) of timed prefill-sized forward passes.
    """

    def __init__(self, loads: list[tuple[int, float]], steps: list[tuple[int, float]]) -> None:
        self.loads = loads
        self.steps = steps

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Every worker's samples together (each TP rank measures its own share)."""
        if not isinstance(other, KVCacheWorkerMetadata):
            return self
        return KVCacheWorkerMetadata(self.loads + other.loads, self.steps + other.steps)


def kv_geometry(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KVGeometry:
    """The byte geometry and packing of one vLLM block, from the KV cache spec.

    Both halves compute it from the same ``KVCacheConfig``, so they agree on
    the key namespace without talking; the worker half then checks it against
    the tensors it is given.
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"the kvcache connector supports one KV cache group (uniform attention), this "
            f"model has {len(groups)}: {[type(g.kv_cache_spec).__name__ for g in groups]}"
        )
    group = groups[0]
    spec = group.kv_cache_spec
    layout = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout
    quant = getattr(spec, "kv_quant_mode", None)
    head_size = getattr(spec, "head_size", "?")
    packing = ",".join(
        [
            type(spec).__name__,
            f"layout={layout or 'default'}",
            f"heads={getattr(spec, 'num_heads', getattr(spec, 'num_kv_heads', '?'))}",
            f"k={head_size}",
            f"v={getattr(spec, 'head_size_v', head_size)}",
            f"quant={getattr(quant, 'name', quant)}",
        ]
    )
    return KVGeometry(
        block_size=int(spec.block_size),
        num_layers=len(group.layer_names),
        page_bytes=int(spec.page_size_bytes),
        dtype=kv_dtype(spec.dtype),
        packing=packing,
    )


class KVCacheConnector(KVConnectorBase_V1):  # type: ignore[misc]  # vLLM: untyped here
    """The vLLM v1 KV connector backed by a kvcache cluster (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ConfigError("the kvcache connector needs vLLM's KVCacheConfig (vLLM >= 0.32)")
        xfer = self._kv_transfer_config
        settings, overrides = split_extra_config(xfer.kv_connector_extra_config)
        self._settings = settings
        self._async_loads = settings.load_mode is LoadMode.ASYNC
        self._geometry = kv_geometry(vllm_config, kv_cache_config)
        self._block_size = self._geometry.block_size
        self._load = bool(xfer.is_kv_consumer)
        self._save = bool(xfer.is_kv_producer)
        self._group_layers = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self._num_blocks = int(kv_cache_config.num_blocks)
        model = vllm_config.model_config
        self._model = settings.model_name or str(model.model)
        self._revision = settings.model_revision or model.revision
        parallel = vllm_config.parallel_config
        is_scheduler = role == KVConnectorRole.SCHEDULER
        if is_scheduler:
            # The scheduler has no rank; it looks up with rank 0's namespace. Other TP ranks
            # check their own namespace when they load and report what they could not get.
            ranks = {"tp_rank": 0, "tp_size": parallel.tensor_parallel_size}
            ranks |= {"pp_rank": 0, "pp_size": parallel.pipeline_parallel_size}
        else:
            ranks = _worker_ranks()
        self.namespace: Namespace = make_namespace(
            model=self._model,
            revision=self._revision,
            geometry=self._geometry,
            parallel=parallel_name(**ranks),
            tenant=settings.tenant,
        )
        self.stats = ConnectorStats(
            role="scheduler" if is_scheduler else "worker",
            pid=os.getpid(),
            namespace=namespace_dict(self.namespace),
        )
        self.stats.load_gbps_estimate = settings.load_gbps
        self.stats.prefill_tokens_per_s_estimate = settings.prefill_tokens_per_s
        self._lock = threading.Lock()
        self._stats_file = _StatsFile(settings.stats_dir, self.stats.role, self.stats.pid)
        self._client = Client(ClientConfig.load(settings.client_config, overrides=overrides))
        if is_scheduler:
            self._book = SchedulerBook(
                block_size=self._block_size, load=self._load, save=self._save
            )
            self._matches = PendingMatches(
                wait_s=settings.match_wait_ms / 1000,
                deadline_s=settings.match_deadline_ms / 1000,
                clock=time.monotonic,
            )
            self._lookup_pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kvcache-match"
            )
            self._local_tokens: dict[str, int] = {}
            self._offers: dict[str, int] = {}
            self._planner = FetchPlanner(
                margin=settings.recompute_margin,
                load_gbps=settings.load_gbps,
                prefill_tokens_per_s=settings.prefill_tokens_per_s,
            )
            if self._load and xfer.kv_load_failure_policy != "recompute":
                log.warning(
                    "kv_load_failure_policy is %r: a kvcache block that cannot be loaded will fail "
                    "its request; set kv_load_failure_policy='recompute' to recompute it instead",
                    xfer.kv_load_failure_policy,
                )
        else:
            self._adapter: PagedKVAdapter | None = None
            self._layer_index: dict[str, int] = {}
            self._load_handles: list[TransferHandle] = []
            self._invalid: set[int] = set()
            self._failed_reqs: set[str] = set()
            self._saver = _Saver(self, settings.max_pending_save_mb << 20)
            self._loader = _Loader(self)
            self._load_samples: list[tuple[int, float]] = []
            self._step_samples: list[tuple[int, float]] = []
            self._timed_steps: list[_TimedStep] = []
            self._step_start: _TimedStep | None = None
        log.info(
            "kvcache connector (%s) on %s: namespace %s",
            self.stats.role,
            self._client.config.cluster_file,
            self.stats.namespace,
        )
        self._write_stats()

    # ================================================================ scheduler half

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that the store can supply, or None: ask again."""
        prompt = request.prompt_token_ids
        if not self._load or prompt is None:
            return 0, False
        loadable = loadable_blocks(
            prompt_tokens=len(prompt), num_tokens=request.num_tokens, block_size=self._block_size
        )
        if loadable <= num_computed_tokens // self._block_size:
            return 0, False
        req_id = request.request_id
        tokens = prompt[: loadable * self._block_size]
        hit = self._matches.poll(req_id, lambda: self._lookup_pool.submit(self._lookup, tokens))
        self._sync_lookup_stats()
        if hit is None:
            return None, False
        ext = self._offers.get(req_id)
        if ext is None:  # decided once per request: a request asked again gets the same answer
            ext = external_tokens(
                hit_blocks=hit,
                local_tokens=num_computed_tokens,
                loadable=loadable,
                block_size=self._block_size,
            )
            if ext:
                ext = self._fetch_or_recompute(ext)
            self._offers[req_id] = ext
        if ext:
            self._local_tokens[req_id] = num_computed_tokens
        return ext, bool(ext) and self._async_loads

    def _fetch_or_recompute(self, tokens: int) -> int:
        """``tokens`` when loading them is predicted to beat recomputing them, else 0."""
        fetch = self._planner.fetch(tokens, self._geometry.bytes_per_token)
        with self._lock:
            self.stats.fetch_decisions = self._planner.fetched
            self.stats.recompute_decisions = self._planner.recomputed
            if not fetch:
                self.stats.tokens_recompute_chosen += tokens
        return tokens if fetch else 0

    def _lookup(self, tokens: list[int]) -> int:
        """Hit blocks of ``tokens`` (runs on the lookup thread)."""
        hit = self._client.match_prefix(self.namespace, tokens).hit_blocks
        with self._lock:
            self.stats.lookups += 1
        return hit

    def _sync_lookup_stats(self) -> None:
        with self._lock:
            self.stats.lookup_deferred = self._matches.deferred
            self.stats.lookup_errors = self._matches.errors
            self.stats.lookup_timeouts = self._matches.timeouts

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """vLLM gave the request its blocks; plan the load of ``num_external_tokens`` tokens."""
        req_id = request.request_id
        self._matches.forget(req_id)
        self._offers.pop(req_id, None)
        local = self._local_tokens.pop(req_id, None)
        if num_external_tokens <= 0:
            return
        if local is None:  # vLLM asks before it allocates; anything else is a bug to surface
            raise RuntimeError(f"request {req_id}: a load was allocated that was never offered")
        # An asynchronous load is planned now, with the request's blocks: vLLM schedules
        # the request only after the load has finished.
        block_ids = _group0(blocks.get_block_ids()) if self._async_loads else None
        self._book.on_alloc(
            req_id,
            request.prompt_token_ids,
            local_tokens=local,
            external=num_external_tokens,
            block_ids=block_ids,
        )
        with self._lock:
            self.stats.requests_matched += 1
            self.stats.tokens_matched += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and saves, for the worker halves."""
        so = scheduler_output
        new = [
            NewReq(r.req_id, r.prompt_token_ids, _group0(r.block_ids), r.num_computed_tokens)
            for r in so.scheduled_new_reqs
        ]
        c = so.scheduled_cached_reqs
        cached = [
            CachedReq(
                req_id,
                req_id in c.resumed_req_ids,
                None if c.new_block_ids[i] is None else _group0(c.new_block_ids[i]),
                c.num_computed_tokens[i],
            )
            for i, req_id in enumerate(c.req_ids)
        ]
        spec = {rid: len(toks) for rid, toks in so.scheduled_spec_decode_tokens.items()}
        plan = self._book.plan_step(new, cached, so.num_scheduled_tokens, spec)
        self._write_stats()
        return KVCacheConnectorMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learn load bandwidth and prefill rate from the worker halves' measurements."""
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KVCacheWorkerMetadata):
            return
        for nbytes, seconds in meta.loads:
            self._planner.record_load(nbytes, seconds)
        for tokens, seconds in meta.steps:
            self._planner.record_step(tokens, seconds)
        with self._lock:
            self.stats.load_gbps_estimate = self._planner.load_gbps
            self.stats.prefill_tokens_per_s_estimate = self._planner.prefill_tokens_per_s

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; blocks may be freed at once: a save's gather is ordered
        before any later write to them on the device, and an asynchronous load holds its
        blocks through vLLM until the worker reports it finished."""
        req_id = request.request_id
        self._book.on_finished(req_id)
        self._matches.forget(req_id)
        self._local_tokens.pop(req_id, None)
        self._offers.pop(req_id, None)
        return False, None

    # ================================================================ worker half

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Index the engine's per-layer caches by the scheduler's block ids."""
        missing = [name for name in self._group_layers if name not in kv_caches]
        if missing:
            raise ConfigError(
                f"KV caches of layers {missing} were not registered with the connector"
            )
        caches = [kv_caches[name] for name in self._group_layers]
        first = caches[0]
        block_dim = next(
            (d for d in (0, 1) if first.dim() > d and first.shape[d] % self._num_blocks == 0),
            None,
        )
        if block_dim is None:
            raise ConfigError(
                f"no block dimension of {self._num_blocks} blocks in a KV cache of shape "
                f"{tuple(first.shape)}"
            )
        per_block = first.shape[block_dim] // self._num_blocks
        if self._block_size % per_block:
            raise ConfigError(
                f"{per_block} pages per block do not divide {self._block_size} tokens"
            )
        adapter = PagedKVAdapter(
            caches,
            page_tokens=self._block_size // per_block,
            pages_per_block=per_block,
            block_dim=block_dim,
        )
        if adapter.payload_bytes != self._geometry.payload_bytes:
            raise ConfigError(
                f"the registered KV caches hold {adapter.payload_bytes} bytes per block, the KV "
                f"cache spec says {self._geometry.payload_bytes} ({self._geometry}); refusing to "
                "store blocks whose layout is not what their keys claim"
            )
        self._adapter = adapter
        self._layer_index = {name: i for i, name in enumerate(self._group_layers)}
        log.info(
            "kvcache connector: %d layers, %d blocks of %d bytes, block dim %d, %d page(s) per block",
            len(caches),
            self._num_blocks,
            adapter.payload_bytes,
            block_dim,
            per_block,
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take this step's plan; a prefill-sized step is timed from here to ``wait_for_save``."""
        super().bind_connector_metadata(connector_metadata)
        plan = self._plan()
        if (
            self.role == KVConnectorRole.WORKER
            and self._adapter is not None
            and plan is not None
            and plan.step_tokens >= MIN_PREFILL_STEP_TOKENS
        ):
            self._step_start = _TimedStep.start(plan.step_tokens, self._adapter.device)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's planned loads: synchronous ones are in the engine's cache (or
        reported failed) before the forward pass, asynchronous ones go to the loader thread."""
        plan = self._plan()
        if plan is None or not plan.loads:
            return
        for spec in plan.loads:
            if spec.asynchronous:
                with self._lock:
                    self.stats.async_loads += 1
                self._loader.submit(spec)
                continue
            loaded, handle = self._load_one(spec)
            if handle is not None:
                self._load_handles.append(handle)
            self._finish_load(spec, loaded)
        self._write_stats()

    def _load_one(self, spec: LoadSpec) -> tuple[int, TransferHandle | None]:
        """Load ``spec``'s blocks and start scattering them: (blocks loaded, the scatter)."""
        adapter = self._require_adapter()
        started = time.perf_counter()
        try:
            # Only the planned blocks are asked for: their keys name their whole prefix.
            keys = block_keys(self.namespace, spec.tokens)[spec.first_block : spec.end_block]
            match = self._client.match_keys(keys, tokens_per_block=self._block_size)
            if not match.hit_blocks:
                return 0, None
            host = adapter.alloc_host(match.hit_blocks)
            result = self._client.load(self.namespace, match, out=host.numpy())
            if not result.blocks:
                return 0, None
            with self._lock:
                self._load_samples.append(
                    (result.blocks * adapter.payload_bytes, time.perf_counter() - started)
                )
            ids = page_ids(spec.block_ids[: result.blocks], adapter.pages_per_block)
            return result.blocks, adapter.scatter(host[: result.blocks], ids)
        except Exception:  # a failed load means recompute, never a crashed engine
            log.warning("kvcache load for request %s failed", spec.req_id, exc_info=True)
            return 0, None

    def _finish_load(self, spec: LoadSpec, loaded: int) -> None:
        """Count a load and report the blocks that did not arrive, for vLLM to recompute."""
        failed = failed_block_ids(spec, loaded)
        with self._lock:
            self.stats.load_requests += 1
            self.stats.blocks_loaded += loaded
            self.stats.tokens_loaded += loaded * self._block_size
            if failed:
                self.stats.load_error_blocks += len(failed)
                self.stats.load_failed_requests += 1
                self._invalid.update(failed)
                if not spec.asynchronous:
                    self._failed_reqs.add(spec.req_id)
        if failed:
            log.warning(
                "kvcache: request %s loaded %d of %d planned blocks; vLLM recomputes the rest",
                spec.req_id,
                loaded,
                len(spec.block_ids),
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Make the engine wait (on the device) until ``layer_name``'s loaded pages are in place."""
        index = self._layer_index.get(layer_name)
        if index is None:
            return
        for handle in self._load_handles:
            handle.wait_layer(index)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: ``wait_for_save`` gathers every layer of the completed blocks."""

    def wait_for_save(self) -> None:
        """Start copying the step's completed prompt blocks to host memory and queue them.

        Never waits for the copy: the engine's stream is made to wait (on the device)
        until the pages have been read, so the blocks may be reused next step, and the
        writer thread waits for the host copy before it stores.
        """
        plan = self._plan()
        self._load_handles.clear()
        if self._step_start is not None:
            self._timed_steps.append(self._step_start.stop())
            self._step_start = None
        with self._lock:
            failed_reqs, self._failed_reqs = self._failed_reqs, set()
        if plan is None or not plan.saves:
            return
        adapter = self._require_adapter()
        for spec in plan.saves:
            if spec.req_id in failed_reqs:
                # This step's KV of the request was computed over blocks that never arrived.
                with self._lock:
                    self.stats.saves_skipped += 1
                continue
            nbytes = len(spec.block_ids) * adapter.payload_bytes
            if not self._saver.reserve(nbytes):
                with self._lock:
                    self.stats.blocks_save_dropped += len(spec.block_ids)
                continue
            handle = adapter.gather(page_ids(spec.block_ids, adapter.pages_per_block))
            handle.release_sources()
            self._saver.submit(_SaveJob(spec.req_id, spec.tokens, spec.first_block, handle))
        self._write_stats()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous load has finished (failed blocks are reported by
        ``get_block_ids_with_load_errors`` in the same step); saves never hold blocks."""
        done = self._loader.take_finished() if self.role == KVConnectorRole.WORKER else set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call; vLLM recomputes them."""
        with self._lock:
            out, self._invalid = self._invalid, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's measurements for the scheduler's fetch-or-recompute decisions."""
        if self.role != KVConnectorRole.WORKER:
            return None
        pending = []
        for step in self._timed_steps:
            seconds = step.elapsed()
            if seconds is None:
                pending.append(step)
            else:
                self._step_samples.append((step.tokens, seconds))
        self._timed_steps = pending
        with self._lock:
            loads, self._load_samples = self._load_samples, []
        steps, self._step_samples = self._step_samples, []
        if not loads and not steps:
            return None
        return KVCacheWorkerMetadata(loads, steps)

    def shutdown(self) -> None:
        """Drain queued saves (bounded), write the final stats and close the client."""
        if self.role == KVConnectorRole.SCHEDULER:
            self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        else:
            self._loader.close(SHUTDOWN_DRAIN_S)
            self._saver.close(SHUTDOWN_DRAIN_S)
        self._write_stats(force=True)
        self._client.close()
        log.info("kvcache connector (%s) stopped: %s", self.stats.role, self.stats.to_dict())

    # ================================================================ helpers

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVCacheConnectorMetadata):
            raise ConfigError(f"unexpected connector metadata {type(meta).__name__}")
        return meta.plan

    def _require_adapter(self) -> PagedKVAdapter:
        if self._adapter is None:
            raise ConfigError("vLLM did not register its KV caches with the connector")
        return self._adapter

    def _write_stats(self, *, force: bool = False) -> None:
        with self._lock:
            snapshot = self.stats.to_dict()
        self._stats_file.write(snapshot, force=force)


def _group0(block_ids: Any) -> list[int]:
    """The block ids of the single KV cache group."""
    return list(block_ids[0]) if block_ids else []


def _worker_ranks() -> dict[str, int]:
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    pp = get_pp_group()
    return {
        "tp_rank": get_tensor_model_parallel_rank(),
        "tp_size": get_tensor_model_parallel_world_size(),
        "pp_rank": pp.rank_in_group,
        "pp_size": pp.world_size,
    }


@dataclass(frozen=True, slots=True)
class _SaveJob:
    req_id: str
    tokens: TokenArray
    first_block: int
    gather: TransferHandle

    @property
    def nbytes(self) -> int:
        return int(self.gather.host.numel())


@dataclass(slots=True)
class _TimedStep:
    """One forward pass being timed: on the device with events, else by the wall clock."""

    tokens: int
    began: Any
    ended: Any = None
    _wall: float = 0.0

    @classmethod
    def start(cls, tokens: int, device: torch.device) -> _TimedStep:
        if device.type == "cpu":
            return cls(tokens, None, _wall=time.perf_counter())
        module: Any = torch.get_device_module(device)
        began = module.Event(enable_timing=True)
        began.record(module.current_stream(device))
        return cls(tokens, began)

    def stop(self) -> _TimedStep:
        if self.began is None:
            self._wall = time.perf_counter() - self._wall
        else:
            self.ended = type(self.began)(enable_timing=True)
            self.ended.record()
        return self

    def elapsed(self) -> float | None:
        """Seconds the pass took, or None while it is still running on the device."""
        if self.began is None:
            return self._wall
        if not self.ended.query():
            return None
        return float(self.began.elapsed_time(self.ended)) / 1000


class _Loader:
    """One thread running asynchronous loads in order, each to the end of its scatter."""

    def __init__(self, owner: KVCacheConnector) -> None:
        self._owner = owner
        self._queue: queue.SimpleQueue[LoadSpec | None] = queue.SimpleQueue()
        self._finished: set[str] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvcache-load", daemon=True)
        self._thread.start()

    def submit(self, spec: LoadSpec) -> None:
        self._queue.put(spec)

    def take_finished(self) -> set[str]:
        """Requests whose load finished (loaded or failed) since the last call."""
        with self._lock:
            out, self._finished = self._finished, set()
        return out

    def _run(self) -> None:
        owner = self._owner
        while True:
            spec = self._queue.get()
            if spec is None:
                return
            loaded, handle = owner._load_one(spec)
            if handle is not None:
                try:
                    handle.synchronize()
                except Exception:  # the device copy failed: the blocks are not there
                    log.warning("kvcache scatter for %s failed", spec.req_id, exc_info=True)
                    loaded = 0
            owner._finish_load(spec, loaded)
            owner._write_stats()
            with self._lock:
                self._finished.add(spec.req_id)

    def close(self, timeout_s: float) -> None:
        """Let queued loads finish (up to ``timeout_s``), then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)


class _Saver:
    """One writer thread storing gathered blocks, behind a queue bounded in bytes."""

    def __init__(self, owner: KVCacheConnector, max_bytes: int) -> None:
        self._owner = owner
        self._max_bytes = max_bytes
        self._bytes = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_SaveJob | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvcache-save", daemon=True)
        self._thread.start()

    def reserve(self, nbytes: int) -> bool:
        """Account ``nbytes`` of queued saves, or refuse when the bound would be passed."""
        with self._lock:
            if self._closed or self._bytes + nbytes > self._max_bytes:
                return False
            self._bytes += nbytes
            peak = self._bytes
        stats = self._owner.stats
        with self._owner._lock:
            stats.save_queue_peak_bytes = max(stats.save_queue_peak_bytes, peak)
        return True

    def submit(self, job: _SaveJob) -> None:
        """Queue a job whose bytes were reserved."""
        self._queue.put(job)

    def _run(self) -> None:
        owner = self._owner
        while True:
            job = self._queue.get()
            if job is None:
                return
            blocks = int(job.gather.host.shape[0])
            try:
                job.gather.synchronize()
                result = owner._client.store(
                    owner.namespace,
                    job.tokens,
                    job.gather.host.numpy(),
                    first_block=job.first_block,
                )
                written, touched, failed = result.written, result.touched, result.failed
            except Exception:  # a failed save is a future miss, never a crashed engine
                log.warning("kvcache save for request %s failed", job.req_id, exc_info=True)
                written, touched, failed = 0, 0, blocks
            with self._lock:
                self._bytes -= job.nbytes
            with owner._lock:
                owner.stats.blocks_saved += written
                owner.stats.blocks_save_touched += touched
                owner.stats.blocks_save_failed += failed
            owner._write_stats()

    def close(self, timeout_s: float) -> None:
        """Let queued saves finish (up to ``timeout_s``), then stop the thread."""
        with self._lock:
            self._closed = True
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "kvcache: queued saves still running after %.0f s; abandoning them", timeout_s
            )


class _StatsFile:
    """Writes the connector's counters to ``{dir}/kvcache-{role}-{pid}.json`` when they change."""

    def __init__(self, directory: Path | None, role: str, pid: int) -> None:
        self.path = None if directory is None else Path(directory) / f"kvcache-{role}-{pid}.json"
        self._last: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def write(self, snapshot: dict[str, Any], *, force: bool = False) -> None:
        if self.path is None:
            return
        with self._lock:
            if snapshot == self._last and not force:
                return
            self._last = snapshot
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(snapshot, sort_keys=True))
                os.replace(tmp, self.path)
            except OSError as exc:
                log.warning("kvcache: cannot write stats to %s: %s", self.path, exc)
