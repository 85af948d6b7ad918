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
  store never stalls scheduling. ``update_state_after_alloc`` notes the load,
  ``build_connector_meta`` plans loads and saves, ``request_finished`` forgets.
- Worker: ``register_kv_caches`` wraps the per-layer caches in a
  :class:`~kvcache.engine.PagedKVAdapter` indexed by the scheduler's block
  ids. ``start_load_kv`` loads (verified bytes only) and scatters before the
  forward; blocks that did not arrive are returned by
  ``get_block_ids_with_load_errors`` and vLLM recomputes them. ``wait_for_save``
  gathers the step's completed prompt blocks from the registered caches (the
  ``kv_layer`` given to ``save_kv_layer`` may number blocks differently, so it
  is not used) into host memory and hands them to a writer thread.

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
)

from kvcache.client import Client, ClientConfig
from kvcache.engine.paged import PagedKVAdapter, TransferHandle, kv_dtype
from kvcache.engine.vllm_meta import (
    CachedReq,
    ConnectorStats,
    KVGeometry,
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
    from vllm.v1.request import Request

__all__ = ["KVCacheConnector", "KVCacheConnectorMetadata"]

log = logging.getLogger(__name__)

#: How long shutdown waits for queued saves to reach the store.
SHUTDOWN_DRAIN_S = 30.0


class KVCacheConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM: untyped here
    """One step's plan, sent by vLLM from the scheduler half to every worker half."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


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
        ext = external_tokens(
            hit_blocks=hit,
            local_tokens=num_computed_tokens,
            loadable=loadable,
            block_size=self._block_size,
        )
        if ext:
            self._local_tokens[req_id] = num_computed_tokens
        return ext, False

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
        local = self._local_tokens.pop(req_id, None)
        if num_external_tokens <= 0:
            return
        if local is None:  # vLLM asks before it allocates; anything else is a bug to surface
            raise RuntimeError(f"request {req_id}: a load was allocated that was never offered")
        self._book.on_alloc(
            req_id, request.prompt_token_ids, local_tokens=local, external=num_external_tokens
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

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its saves were copied out already, so blocks may be freed now."""
        req_id = request.request_id
        self._book.on_finished(req_id)
        self._matches.forget(req_id)
        self._local_tokens.pop(req_id, None)
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

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load this step's planned blocks into the engine's cache (before the forward)."""
        plan = self._plan()
        if plan is None or not plan.loads:
            return
        for spec in plan.loads:
            self._load_one(spec)
        self._write_stats()

    def _load_one(self, spec: LoadSpec) -> None:
        adapter = self._require_adapter()
        loaded = 0
        try:
            # Only the planned blocks are asked for: their keys name their whole prefix.
            keys = block_keys(self.namespace, spec.tokens)[spec.first_block : spec.end_block]
            match = self._client.match_keys(keys, tokens_per_block=self._block_size)
            if match.hit_blocks:
                host = adapter.alloc_host(match.hit_blocks)
                result = self._client.load(self.namespace, match, out=host.numpy())
                if result.blocks:
                    ids = page_ids(spec.block_ids[: result.blocks], adapter.pages_per_block)
                    self._load_handles.append(adapter.scatter(host[: result.blocks], ids))
                loaded = result.blocks
        except Exception:  # a failed load means recompute, never a crashed engine
            log.warning("kvcache load for request %s failed", spec.req_id, exc_info=True)
            loaded = 0
        failed = failed_block_ids(spec, loaded)
        with self._lock:
            self.stats.load_requests += 1
            self.stats.blocks_loaded += loaded
            self.stats.tokens_loaded += loaded * self._block_size
            if failed:
                self.stats.load_error_blocks += len(failed)
                self.stats.load_failed_requests += 1
        if failed:
            self._invalid.update(failed)
            self._failed_reqs.add(spec.req_id)
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
        """Copy the step's completed prompt blocks to host memory and queue them for the store."""
        plan = self._plan()
        self._load_handles.clear()
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
            # Wait for the copy: the blocks may be reused by the next step once we return.
            handle.synchronize()
            self._saver.submit(_SaveJob(spec.req_id, spec.tokens, spec.first_block, handle.host))
        self._write_stats()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call; vLLM recomputes them."""
        out, self._invalid = self._invalid, set()
        return out

    def shutdown(self) -> None:
        """Drain queued saves (bounded), write the final stats and close the client."""
        if self.role == KVConnectorRole.SCHEDULER:
            self._lookup_pool.shutdown(wait=False, cancel_futures=True)
        else:
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
    host: torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.host.numel())


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
            blocks = int(job.host.shape[0])
            try:
                result = owner._client.store(
                    owner.namespace,
                    job.tokens,
                    job.host.numpy(),
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
