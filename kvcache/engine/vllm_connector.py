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
bytes). They share only the per-step :class:`KVCacheConnectorMetadata`. This
class is the one vLLM instantiates; it builds the shared
:class:`~kvcache.engine.vllm_context.ConnectorContext` and one object for its
role, and forwards each of vLLM's calls to it:

- :class:`~kvcache.engine.vllm_scheduler.SchedulerSide`: lookups, offers, plans;
- :class:`~kvcache.engine.vllm_worker.WorkerSide`: loads, saves, the SWA tier.

The planning itself is pure (:mod:`kvcache.engine.vllm_meta`,
:mod:`kvcache.engine.hybrid`). The connector implements ``SupportsHMA``: with
a hybrid model (sliding-window and full attention layers) vLLM keeps its
hybrid KV-cache manager on, the full-attention group goes to the block store
and the sliding-window groups to the SWA tier (``docs/engine.md``).

This is the only module of kvcache that imports vLLM; ``kvcache.engine`` does
not import it, so the package works without vLLM.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockStored, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvcache.engine.stats import CounterDeltas
from kvcache.engine.vllm_context import ConnectorContext
from kvcache.engine.vllm_events import GroupSpec, Report
from kvcache.engine.vllm_meta import StepPlan
from kvcache.engine.vllm_metrics import KVCacheConnectorStats, KVCachePromMetrics
from kvcache.engine.vllm_scheduler import SchedulerSide
from kvcache.engine.vllm_worker import WorkerSide
from kvcache.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Iterable

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


class KVCacheKVEvents(KVConnectorKVEvents):  # type: ignore[misc]  # vLLM: untyped
    """The connector's KV events on their way from the worker halves to the scheduler half
    (``kvcache.engine.vllm_events``). Every worker's events are kept: under tensor
    parallelism each rank stores its own slice under its own namespace, so no two ranks
    report the same key."""

    def __init__(self, events: list[Any] | None = None, workers: int = 1) -> None:
        self._events = list(events or [])
        self._workers = workers

    def add_events(self, events: list[Any]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KVCacheKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()

    def __repr__(self) -> str:
        return f"<KVCacheKVEvents {len(self._events)} events from {self._workers} worker(s)>"


def vllm_event(report: Report) -> BlockStored:
    """vLLM's BlockStored for one report of the worker half."""
    return BlockStored(
        block_hashes=list(report.block_hashes),
        parent_block_hash=report.parent_block_hash,
        token_ids=list(report.token_ids),
        block_size=report.block_size,
        lora_id=None,
        medium=report.medium,
        lora_name=None,
        group_idx=report.group.group_idx,
        kv_cache_spec_kind=report.group.kind,
        kv_cache_spec_sliding_window=report.group.sliding_window,
        locality=report.locality,
        ownership="kvcache",
        session_id=report.session_id,
    )


def group_spec(kv_cache_config: KVCacheConfig, group: int, block_size: int) -> GroupSpec:
    """How events name group ``group``: vLLM's own spec kind and sliding window."""
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    spec = kv_cache_config.kv_cache_groups[group].kv_cache_spec
    return GroupSpec(
        group_idx=group,
        kind=str(get_kv_cache_spec_kind(spec).value),
        sliding_window=get_kv_cache_spec_sliding_window(spec),
        block_size=int(getattr(spec, "block_size", block_size) or block_size),
    )


class KVCacheConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]  # vLLM: untyped
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
        is_scheduler = role == KVConnectorRole.SCHEDULER
        parallel = vllm_config.parallel_config
        if is_scheduler:
            # The scheduler has no rank; it looks up with rank 0's namespace. Other TP ranks
            # check their own namespace when they load and report what they could not get.
            ranks = {"tp_rank": 0, "tp_size": parallel.tensor_parallel_size}
            ranks |= {"pp_rank": 0, "pp_size": parallel.pipeline_parallel_size}
        else:
            ranks = _worker_ranks()
        ctx = ConnectorContext.build(
            vllm_config,
            kv_cache_config,
            role="scheduler" if is_scheduler else "worker",
            ranks=ranks,
        )
        self.ctx = ctx
        self._deltas = CounterDeltas()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if is_scheduler:
            self._scheduler = SchedulerSide(
                ctx, load_failure_policy=self._kv_transfer_config.kv_load_failure_policy
            )
        else:
            self._worker = WorkerSide(
                ctx,
                num_blocks=int(kv_cache_config.num_blocks),
                layers=[list(g.layer_names) for g in kv_cache_config.kv_cache_groups],
                tensors=list(kv_cache_config.kv_cache_tensors or ()),
            )
            self._worker.main_group = group_spec(kv_cache_config, ctx.roles.main, ctx.block_size)
            if ctx.hybrid is not None:
                self._worker.swa_groups = [
                    group_spec(kv_cache_config, g, ctx.hybrid.swa_block_size or ctx.block_size)
                    for g in ctx.hybrid.swa_groups
                ]
        #: Events from the worker halves, waiting for vLLM's publisher (scheduler half).
        self._kv_events: list[Any] = []
        log.info(
            "kvcache connector (%s) on %s: namespace %s%s",
            ctx.stats.role,
            (self._scheduler or self._worker).client.config.cluster_file,  # type: ignore[union-attr]
            ctx.stats.namespace,
            "" if ctx.hybrid is None else f"; hybrid, window {ctx.hybrid.window}",
        )
        ctx.write_stats()

    @property
    def stats(self) -> Any:
        """This half's counters (:class:`~kvcache.engine.vllm_meta.ConnectorStats`)."""
        return self.ctx.stats

    # ================================================================ metrics (both halves)

    def get_kv_connector_stats(self) -> KVCacheConnectorStats | None:
        """This half's counter increments since vLLM last asked (``kvcache.engine.vllm_metrics``)."""
        with self.ctx.lock:
            grew = self._deltas.take(self.ctx.stats)
        return KVCacheConnectorStats(data=grew) if grew else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVCacheConnectorStats:
        """Rebuild stats sent between vLLM's processes."""
        return KVCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVCachePromMetrics:
        """The ``vllm:kvcache_*_total`` counters on vLLM's ``/metrics``."""
        return KVCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise ConfigError("a scheduler-side call reached the worker half of the connector")
        return self._scheduler

    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise ConfigError("a worker-side call reached the scheduler half of the connector")
        return self._worker

    # ================================================================ scheduler half

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` that the store can supply, or None: ask again."""
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """vLLM gave the request its blocks; plan the load of ``num_external_tokens`` tokens."""
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads, saves and states, for the worker halves."""
        return KVCacheConnectorMetadata(self._sched().build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learn load bandwidth and prefill rate from the worker halves' measurements; keep
        their KV events for :meth:`take_events`."""
        self._sched().update_connector_output(connector_output)
        events = getattr(connector_output, "kv_cache_events", None)
        if isinstance(events, KVCacheKVEvents):
            self._kv_events.extend(events.get_all_events())

    def take_events(self) -> Iterable[Any]:
        """The worker halves' KV events since the last call, for vLLM's publisher: blocks
        stored and loaded (medium STORAGE), SWA states held (medium CPU)."""
        events, self._kv_events = self._kv_events, []
        return events

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request (its blocks may be freed at once)."""
        return self._sched().request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` of a hybrid-manager engine (``block_ids``: one list per group,
        0 for null blocks). Nothing is held past the end: states are taken earlier."""
        return self._sched().request_finished(request)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """The groups a load restores: the full group from the store, the others from the
        SWA tier when the state is in hand (a bounded-replay model without it: the full
        group only, and vLLM replays the window)."""
        return self._sched().loaded_group_ids(request.request_id)

    # ================================================================ worker half

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Index the engine's per-layer caches by the scheduler's block ids."""
        self._work().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take this step's plan."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(self._plan())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's planned loads."""
        self._work().start_load(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Make the engine wait (on the device) until ``layer_name``'s loaded pages are in place."""
        self._work().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: ``wait_for_save`` gathers every layer of the completed blocks."""

    def wait_for_save(self) -> None:
        """Start copying the step's completed prompt blocks and states to host memory."""
        self._work().wait_for_save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous load has finished; saves never hold blocks."""
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished asynchronous loads, and those that failed as a whole request (hybrid)."""
        if self._worker is None:
            return KVConnectorTransferResults()
        done, failed = self._worker.take_finished()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM blocks whose load failed since the last call; vLLM recomputes them."""
        return set() if self._worker is None else self._worker.take_invalid_blocks()

    def get_kv_connector_kv_cache_events(self) -> KVCacheKVEvents | None:
        """This worker's stores, loads and held states since the last step, as vLLM events."""
        if self._worker is None:
            return None
        reports = self._worker.events.take()
        if not reports:
            return None
        return KVCacheKVEvents([vllm_event(r) for r in reports])

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's measurements for the scheduler's fetch-or-recompute decisions."""
        if self._worker is None:
            return None
        loads, steps = self._worker.measurements()
        if not loads and not steps:
            return None
        return KVCacheWorkerMetadata(loads, steps)

    def shutdown(self) -> None:
        """Drain queued work (bounded), write the final stats and close the client."""
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
        self.ctx.write_stats(force=True)
        log.info("kvcache connector (%s) stopped: %s", self.ctx.stats.role, self.ctx.stats)

    # ================================================================ helpers

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVCacheConnectorMetadata):
            raise ConfigError(f"unexpected connector metadata {type(meta).__name__}")
        return meta.plan


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
