"""The worker half of the vLLM connector: moves bytes between vLLM's KV cache and kvcache.

- ``register_kv_caches`` wraps the full-attention group's per-layer caches in
  a :class:`~kvcache.engine.PagedKVAdapter` indexed by the scheduler's block
  ids (and, for a hybrid model, each sliding-window group's in one more, and
  starts this worker's SWA tier: its states in RAM, served to peers).
- ``start_load`` hands asynchronous loads to a loader thread (which loads
  verified bytes, scatters them and reports the request finished) and runs
  synchronous ones before the forward pass. Blocks that did not arrive are
  reported for vLLM to recompute: by block id for a single-group model, by
  request (``failed_recving``) for a hybrid one, whose block ids are only
  unique per group. A hybrid load fetches the state first (this worker's
  RAM, else the holder the directory named), then the full group's blocks;
  it succeeds only whole.
- ``wait_for_save`` starts gathering the step's completed prompt blocks (and
  planned states) from the registered caches into host memory and hands them
  to a writer thread; it never waits for the copy. The ``kv_layer`` given to
  ``save_kv_layer`` may number blocks differently, so it is not used.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvcache.engine.block_span import GroupSpan, layer_places
from kvcache.engine.hybrid import SwaLoadSpec, SwaSaveSpec
from kvcache.engine.paged import PagedKVAdapter, TransferHandle
from kvcache.engine.vllm_context import ConnectorContext
from kvcache.engine.vllm_events import EngineEvents, GroupSpec
from kvcache.engine.vllm_meta import (
    MIN_PREFILL_STEP_TOKENS,
    LoadSpec,
    StepPlan,
    failed_block_ids,
    page_ids,
)
from kvcache.errors import ConfigError
from kvcache.keys import TokenArray, block_keys
from kvcache.retention.decide import Hint
from kvcache.swa_local.state import StateKey
from kvcache.swa_local.tier import SwaTier

__all__ = ["SHUTDOWN_DRAIN_S", "WorkerSide"]

log = logging.getLogger(__name__)

#: How long shutdown waits for queued saves to reach the store.
SHUTDOWN_DRAIN_S = 30.0


class WorkerSide:
    """Everything the worker half does (see the module docstring)."""

    def __init__(
        self,
        ctx: ConnectorContext,
        *,
        num_blocks: int,
        layers: list[list[str]],
        tensors: list[Any] | None = None,
    ) -> None:
        self.ctx = ctx
        #: vLLM's KVCacheTensor records (where each layer's pages lie in the allocation).
        self._tensors = list(tensors or ())
        self.client = ctx.make_client()
        self._num_blocks = num_blocks
        #: Layer names per KV cache group, in vLLM's group order.
        self._layers = layers
        self.adapter: PagedKVAdapter | None = None
        self.swa_adapters: list[PagedKVAdapter] = []
        self.tier: SwaTier | None = None
        self._layer_index: dict[str, int] = {}
        self._load_handles: list[TransferHandle] = []
        self._invalid: set[int] = set()
        self._failed_loads: set[str] = set()
        self._failed_reqs: set[str] = set()
        self._saver = _Saver(self, ctx.settings.max_pending_save_mb << 20)
        #: Retention hints of the loads planned and not finished yet (request id -> hint).
        self._load_hints: dict[str, Hint] = {}
        self._loader = _Loader(self)
        self._load_samples: list[tuple[int, float]] = []
        self._step_samples: list[tuple[int, float]] = []
        self._timed_steps: list[_TimedStep] = []
        self._step_start: _TimedStep | None = None
        #: What this worker stored, loaded and holds, for vLLM's KV events (vllm_events).
        self.events = EngineEvents()
        #: How events name the groups (the connector sets them from vLLM's specs).
        self.main_group = GroupSpec(ctx.roles.main, "full_attention", None, ctx.block_size)
        self.swa_groups: list[GroupSpec] = []

    # ------------------------------------------------------------------ caches

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Index the engine's per-layer caches by the scheduler's block ids."""
        ctx = self.ctx
        self.adapter = self._adapter(kv_caches, ctx.roles.main, ctx.geometry.payload_bytes)
        self._layer_index = {name: i for i, name in enumerate(self._layers[ctx.roles.main])}
        if ctx.spans:  # one span per block, not per layer: no per-layer waits
            self._layer_index = {}
        if ctx.hybrid is not None:
            sizes = (*ctx.hybrid.swa_block_bytes, *ctx.hybrid.ring_block_bytes)
            self.swa_adapters = [
                self._adapter(kv_caches, g, size)
                for g, size in zip(ctx.hybrid.state_groups, sizes, strict=True)
            ]
            self.tier = SwaTier(ctx.swa_config(), self.client)
            self.tier.start()
        log.info(
            "kvcache connector: %d layers, %d blocks of %d bytes, %d page(s) per block%s",
            self.adapter.num_layers,
            self._num_blocks,
            self.adapter.payload_bytes,
            self.adapter.pages_per_block,
            "" if self.tier is None else f"; SWA tier at {self.tier.endpoint}",
        )

    def _adapter(
        self, kv_caches: dict[str, torch.Tensor], group: int, payload_bytes: int
    ) -> PagedKVAdapter:
        names = self._layers[group]
        missing = [name for name in names if name not in kv_caches]
        if missing:
            raise ConfigError(
                f"KV caches of layers {missing} were not registered with the connector"
            )
        span = self.ctx.spans.get(group)
        if span is not None:
            return self._span_adapter(kv_caches, group, span, payload_bytes)
        caches = [kv_caches[name] for name in names]
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
        if self.ctx.block_size % per_block:
            raise ConfigError(
                f"{per_block} pages per block do not divide {self.ctx.block_size} tokens"
            )
        adapter = PagedKVAdapter(
            caches,
            page_tokens=self.ctx.block_size // per_block,
            pages_per_block=per_block,
            block_dim=block_dim,
        )
        if adapter.payload_bytes != payload_bytes:
            raise ConfigError(
                f"the registered KV caches of group {group} hold {adapter.payload_bytes} bytes "
                f"per block, the KV cache spec says {payload_bytes}; refusing to store blocks "
                "whose layout is not what their keys claim"
            )
        return adapter

    def _span_adapter(
        self, kv_caches: dict[str, torch.Tensor], group: int, span: GroupSpan, payload_bytes: int
    ) -> PagedKVAdapter:
        """An adapter over a block-outermost group: each block is one contiguous span of the
        backing allocation every layer's view shares (``kvcache.engine.block_span``)."""
        if span.nbytes != payload_bytes:
            raise ConfigError(
                f"group {group}: a span of {span.nbytes} bytes per block, the KV cache spec "
                f"says {payload_bytes}"
            )
        names = self._layers[group]
        first = kv_caches[names[0]]
        storage = first.untyped_storage()
        base = storage.data_ptr()
        places = layer_places(self._tensors)
        for name in names:
            view = kv_caches[name]
            if view.untyped_storage().data_ptr() != base:
                raise ConfigError(f"layer {name}'s KV cache is not in the shared allocation")
            if view.data_ptr() - base != places[name].offset:
                raise ConfigError(
                    f"layer {name}'s KV cache starts at byte {view.data_ptr() - base} of the "
                    f"allocation, vLLM's KVCacheTensor says {places[name].offset}; refusing to "
                    "store blocks whose layout is not what their keys claim"
                )
        needed = span.start + (self._num_blocks - 1) * span.block_stride + span.nbytes
        if storage.nbytes() < needed:
            raise ConfigError(
                f"the KV cache allocation holds {storage.nbytes()} bytes, {needed} are addressed"
            )
        backing = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
        pages = backing.as_strided(
            (self._num_blocks, span.nbytes), (span.block_stride, 1), span.start
        )
        return PagedKVAdapter([pages], page_tokens=self.ctx.block_size)

    def require_adapter(self) -> PagedKVAdapter:
        """The full-attention group's adapter."""
        if self.adapter is None:
            raise ConfigError("vLLM did not register its KV caches with the connector")
        return self.adapter

    # ------------------------------------------------------------------ loads

    def bind(self, plan: StepPlan | None) -> None:
        """A new step's plan: a prefill-sized step is timed from here to ``wait_for_save``."""
        if (
            self.adapter is not None
            and plan is not None
            and plan.step_tokens >= MIN_PREFILL_STEP_TOKENS
        ):
            self._step_start = _TimedStep.start(plan.step_tokens, self.adapter.device)

    def start_load(self, plan: StepPlan | None) -> None:
        """Start this step's planned loads: synchronous ones are in the engine's cache (or
        reported failed) before the forward pass, asynchronous ones go to the loader thread."""
        if plan is None or not plan.loads:
            return
        ctx = self.ctx
        for spec in plan.loads:
            if spec.req_id in plan.hints:  # read by load_one, dropped by finish_load
                self._load_hints[spec.req_id] = plan.hints[spec.req_id]
            if spec.asynchronous:
                with ctx.lock:
                    ctx.stats.async_loads += 1
                self._loader.submit(spec)
                continue
            loaded, handles = self.load_one(spec)
            self._load_handles.extend(handles)
            self.finish_load(spec, loaded)
        ctx.write_stats()

    def load_one(self, spec: LoadSpec) -> tuple[int, list[TransferHandle]]:
        """Load ``spec``'s blocks (and state) and start scattering them: (blocks loaded,
        the scatters). A hybrid load is all or nothing: 0 blocks unless every one and the
        state arrived."""
        adapter = self.require_adapter()
        ctx = self.ctx
        started = time.perf_counter()
        handles: list[TransferHandle] = []
        try:
            state = None
            if spec.swa is not None:
                state = self._fetch_state(spec.swa)
                if state is None:
                    return 0, []
            # Only the planned blocks are asked for: their keys name their whole prefix.
            all_keys = block_keys(ctx.namespace, spec.tokens)
            keys = all_keys[spec.first_block : spec.end_block]
            match = self.client.match_keys(keys, tokens_per_block=ctx.block_size)
            if not match.hit_blocks or (state is not None and match.hit_blocks < len(keys)):
                return 0, []
            host = adapter.alloc_host(match.hit_blocks)
            result = self.client.load(
                ctx.namespace, match, out=host.numpy(), hint=self._load_hints.get(spec.req_id)
            )
            if not result.blocks or (state is not None and result.blocks < len(keys)):
                return 0, []
            nbytes = result.blocks * adapter.payload_bytes + (0 if state is None else state.numel())
            with ctx.lock:
                self._load_samples.append((nbytes, time.perf_counter() - started))
            ids = page_ids(spec.block_ids[: result.blocks], adapter.pages_per_block)
            handles.append(adapter.scatter(host[: result.blocks], ids))
            if state is not None and spec.swa is not None:
                handles += self._scatter_state(spec.swa, state)
            self.events.blocks(all_keys, spec.tokens, first_block=spec.first_block,
                               count=result.blocks, block_size=ctx.block_size,
                               group=self.main_group, session_id=spec.req_id)  # fmt: skip
            return result.blocks, handles
        except Exception:  # a failed load means recompute, never a crashed engine
            log.warning("kvcache load for request %s failed", spec.req_id, exc_info=True)
            return 0, []

    def _fetch_state(self, swa: SwaLoadSpec) -> torch.Tensor | None:
        """The state of a hybrid load, as a host tensor, or None (counted)."""
        ctx = self.ctx
        tier, hybrid = self.tier, ctx.hybrid
        if tier is None or hybrid is None or swa.key is None or not swa.block_ids:
            self._count_swa("swa_misses")
            return None
        local = tier.store.get(swa.key) is not None
        expected = hybrid.state_bytes(swa.key.position)
        # A private buffer (the tier's bytes are shared and read-only) that a holder's
        # reply is received into; a state of another size is a miss.
        state = torch.empty(expected, dtype=torch.uint8)
        if tier.fetch(swa.key, swa.holders, out=state.numpy().data) is None:
            if local:
                log.warning("kvcache: the state held is not %d bytes: not used", expected)
            self._count_swa("swa_misses")
            return None
        self._count_swa("swa_local_hits" if local else "swa_remote_hits")
        return state

    def _scatter_state(self, swa: SwaLoadSpec, state: torch.Tensor) -> list[TransferHandle]:
        """Write the state's rows into the sliding-window groups' blocks (not those before
        ``write_from``: vLLM's own)."""
        hybrid = self.ctx.hybrid
        assert hybrid is not None
        n_swa = len(hybrid.swa_groups)
        skip = swa.write_from - swa.first_block
        sizes = (*hybrid.swa_block_bytes, *hybrid.ring_block_bytes)
        handles = []
        offset = 0
        for g, (adapter, ids, size) in enumerate(
            zip(self.swa_adapters, swa.block_ids, sizes, strict=True)
        ):
            rows = len(ids)
            part = state[offset : offset + rows * size].view(rows, size)
            offset += rows * size
            start = skip if g < n_swa else 0  # a ring block is always written
            if start < rows:
                pages = page_ids(ids[start:], adapter.pages_per_block)
                handles.append(adapter.scatter(part[start:].contiguous(), pages))
        return handles

    def finish_load(self, spec: LoadSpec, loaded: int) -> None:
        """Count a load and report what did not arrive, for vLLM to recompute."""
        ctx = self.ctx
        self._load_hints.pop(spec.req_id, None)
        failed = failed_block_ids(spec, loaded)
        # Several groups: block ids are unique per group only, so failures are per request.
        hybrid = ctx.hybrid is not None
        with ctx.lock:
            ctx.stats.load_requests += 1
            ctx.stats.blocks_loaded += loaded
            ctx.stats.tokens_loaded += loaded * ctx.block_size
            if failed:
                ctx.stats.load_error_blocks += len(failed)
                ctx.stats.load_failed_requests += 1
                if hybrid:
                    self._failed_loads.add(spec.req_id)
                else:
                    self._invalid.update(failed)
                if not spec.asynchronous:
                    self._failed_reqs.add(spec.req_id)
        if failed:
            log.warning(
                "kvcache: request %s loaded %d of %d planned blocks; vLLM recomputes %s",
                spec.req_id,
                loaded,
                len(spec.block_ids),
                "the request" if hybrid else "the rest",
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Make the engine wait (on the device) until ``layer_name``'s loaded pages are in place."""
        index = self._layer_index.get(layer_name)
        if index is None:
            return
        for handle in self._load_handles:  # synchronous loads: single-group models only
            handle.wait_layer(index)

    # ------------------------------------------------------------------ saves

    def wait_for_save(self, plan: StepPlan | None) -> None:
        """Start copying the step's completed prompt blocks (and states) to host memory and
        queue them.

        Never waits for the copy: the engine's stream is made to wait (on the device)
        until the pages have been read, so the blocks may be reused next step, and the
        writer thread waits for the host copy before it stores.
        """
        ctx = self.ctx
        self._load_handles.clear()
        if self._step_start is not None:
            self._timed_steps.append(self._step_start.stop())
            self._step_start = None
        with ctx.lock:
            failed_reqs, self._failed_reqs = self._failed_reqs, set()
        if plan is None or not (plan.saves or plan.swa_saves):
            return
        adapter = self.require_adapter()
        for spec in plan.saves if ctx.writes_blocks else ():
            if spec.req_id in failed_reqs:
                # This step's KV of the request was computed over blocks that never arrived.
                with ctx.lock:
                    ctx.stats.saves_skipped += 1
                continue
            nbytes = len(spec.block_ids) * adapter.payload_bytes
            if not self._saver.reserve(nbytes):
                with ctx.lock:
                    ctx.stats.blocks_save_dropped += len(spec.block_ids)
                continue
            handle = adapter.gather(page_ids(spec.block_ids, adapter.pages_per_block))
            handle.release_sources()
            self._saver.submit(
                _SaveJob(
                    spec.req_id,
                    spec.tokens,
                    spec.first_block,
                    [handle],
                    hint=plan.hints.get(spec.req_id),
                )
            )
        for state in plan.swa_saves:
            self._take_state(state, failed_reqs)
        ctx.write_stats()

    def _take_state(self, spec: SwaSaveSpec, failed_reqs: set[str]) -> None:
        hybrid = self.ctx.hybrid
        if self.tier is None or hybrid is None or spec.req_id in failed_reqs:
            self._count_swa("swa_state_dropped")
            return
        if not self._saver.reserve(hybrid.state_bytes(spec.position)):
            self._count_swa("swa_state_dropped")
            return
        handles = []
        for adapter, ids in zip(self.swa_adapters, spec.block_ids, strict=True):
            handle = adapter.gather(page_ids(ids, adapter.pages_per_block))
            handle.release_sources()
            handles.append(handle)
        self._saver.submit(_SaveJob(spec.req_id, spec.tokens, -1, handles, spec.position))

    # ------------------------------------------------------------------ reports

    def take_finished(self) -> tuple[set[str], set[str]]:
        """(asynchronous loads finished, those of them that failed as a whole request)."""
        done = self._loader.take_finished()
        with self.ctx.lock:
            failed = self._failed_loads & done
            self._failed_loads -= failed
        return done, failed

    def take_invalid_blocks(self) -> set[int]:
        """vLLM blocks whose load failed since the last call; vLLM recomputes them."""
        with self.ctx.lock:
            out, self._invalid = self._invalid, set()
        return out

    def measurements(self) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        """(load samples, prefill step samples) since the last call."""
        pending = []
        for step in self._timed_steps:
            seconds = step.elapsed()
            if seconds is None:
                pending.append(step)
            else:
                self._step_samples.append((step.tokens, seconds))
        self._timed_steps = pending
        with self.ctx.lock:
            loads, self._load_samples = self._load_samples, []
        steps, self._step_samples = self._step_samples, []
        return loads, steps

    def shutdown(self) -> None:
        """Drain queued loads and saves (bounded), stop the SWA tier, close the client."""
        self._loader.close(SHUTDOWN_DRAIN_S)
        self._saver.close(SHUTDOWN_DRAIN_S)
        if self.tier is not None:
            self.tier.close()
        self.ctx.write_stats(force=True)
        self.client.close()

    def _count_swa(self, name: str, n: int = 1) -> None:
        with self.ctx.lock:
            setattr(self.ctx.stats, name, getattr(self.ctx.stats, name) + n)

    def store_state(self, job: _SaveJob) -> None:
        """Hold a gathered state in the tier (on the writer thread)."""
        if self.tier is None:
            return
        keys = block_keys(self.ctx.namespace, job.tokens)
        key = StateKey(namespace=self.ctx.state_ns_id, block=keys[-1], position=job.position)
        data = b"".join(h.host.numpy().tobytes() for h in job.gathers)
        if self.tier.put(key, data) is None:
            self._count_swa("swa_state_dropped")
            return
        self.events.state(keys[-1], keys[-2] if len(keys) > 1 else None, self.swa_groups,
                          session_id=job.req_id)  # fmt: skip
        with self.ctx.lock:
            self.ctx.stats.swa_states_saved += 1
            self.ctx.stats.swa_state_bytes_saved += len(data)


@dataclass(frozen=True, slots=True)
class _SaveJob:
    """Gathered blocks to store (``first_block`` >= 0) or a state to hold (``position``)."""

    req_id: str
    tokens: TokenArray
    first_block: int
    gathers: list[TransferHandle]
    position: int = 0
    #: The request's retention hint (class, TTL, pin), if it has one.
    hint: Hint | None = None

    @property
    def nbytes(self) -> int:
        return sum(int(g.host.numel()) for g in self.gathers)


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

    def __init__(self, owner: WorkerSide) -> None:
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
            loaded, handles = owner.load_one(spec)
            for handle in handles:
                try:
                    handle.synchronize()
                except Exception:  # the device copy failed: the blocks are not there
                    log.warning("kvcache scatter for %s failed", spec.req_id, exc_info=True)
                    loaded = 0
            owner.finish_load(spec, loaded)
            owner.ctx.write_stats()
            with self._lock:
                self._finished.add(spec.req_id)

    def close(self, timeout_s: float) -> None:
        """Let queued loads finish (up to ``timeout_s``), then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)


class _Saver:
    """One writer thread storing gathered blocks and states, behind a queue bounded in bytes."""

    def __init__(self, owner: WorkerSide, max_bytes: int) -> None:
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
        ctx = self._owner.ctx
        with ctx.lock:
            ctx.stats.save_queue_peak_bytes = max(ctx.stats.save_queue_peak_bytes, peak)
        return True

    def submit(self, job: _SaveJob) -> None:
        """Queue a job whose bytes were reserved."""
        ctx = self._owner.ctx
        with ctx.lock:
            ctx.stats.save_jobs_queued += 1
        self._queue.put(job)

    def _run(self) -> None:
        owner = self._owner
        ctx = owner.ctx
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                for gather in job.gathers:
                    gather.synchronize()
                if job.position:
                    owner.store_state(job)
                else:
                    self._store(job)
            except Exception:  # a failed save is a future miss, never a crashed engine
                log.warning("kvcache save for request %s failed", job.req_id, exc_info=True)
                if not job.position:
                    with ctx.lock:
                        ctx.stats.blocks_save_failed += int(job.gathers[0].host.shape[0])
            with self._lock:
                self._bytes -= job.nbytes
            with ctx.lock:
                ctx.stats.save_jobs_done += 1
            ctx.write_stats()

    def _store(self, job: _SaveJob) -> None:
        owner = self._owner
        ctx = owner.ctx
        result = owner.client.store(
            ctx.namespace,
            job.tokens,
            job.gathers[0].host.numpy(),
            first_block=job.first_block,
            hint=job.hint,
        )
        with ctx.lock:
            ctx.stats.blocks_saved += result.written
            ctx.stats.blocks_save_touched += result.touched
            ctx.stats.blocks_save_failed += result.failed
        count = int(job.gathers[0].host.shape[0])
        owner.events.blocks(block_keys(ctx.namespace, job.tokens), job.tokens,
                            first_block=job.first_block, count=count, block_size=ctx.block_size,
                            group=owner.main_group, skip=result.failed_blocks,
                            session_id=job.req_id)  # fmt: skip

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
