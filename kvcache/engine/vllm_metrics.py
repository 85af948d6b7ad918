"""The connector's counters on vLLM's Prometheus ``/metrics``, through vLLM's own stats path.

vLLM 0.32 asks each connector half for ``get_kv_connector_stats()`` every step: the
workers' go back to the engine core in the model runner's output, the scheduler's is
added there (``Scheduler.update_from_output``: ``aggregate``), and the frontend's stat
logger rebuilds them with ``build_kv_connector_stats`` and hands their ``data`` to the
``KVConnectorPromMetrics`` that ``build_prom_metrics`` made, once per step. So each half
hands over the *increments* of its counters (:class:`kvcache.engine.stats.CounterDeltas`),
the aggregate sums them, and :class:`KVCachePromMetrics` adds them to one Prometheus
counter per name, ``vllm:kvcache_<name>_total`` with vLLM's engine labels:
``vllm:kvcache_swa_state_restores_total``, ``..._swa_bounded_replays_total``,
``..._swa_full_recomputes_total`` and the lookup, load and save counters of
``EXPORTED_COUNTERS``. The stats file keeps the per-process totals.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvcache.engine.stats import EXPORTED_COUNTERS

__all__ = ["KVCacheConnectorStats", "KVCachePromMetrics"]

_HELP = {
    "swa_state_restores": "Hits loaded with their sliding window: vLLM replayed nothing.",
    "swa_bounded_replays": "Hits loaded without their window: vLLM replayed the last 128 tokens.",
    "swa_full_recomputes": "Loads that claimed the window and failed: recomputed whole.",
}


class KVCacheConnectorStats(KVConnectorStats):  # type: ignore[misc]  # vLLM: untyped
    """Counter increments of one interval: ``data`` maps a counter name to how much it grew."""

    def reset(self) -> None:
        """Forget the interval's increments."""
        self.data: dict[str, int] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """The sum of two intervals' (or two processes') increments."""
        merged = dict(self.data)
        for name, value in (other.data or {}).items():
            merged[name] = merged.get(name, 0) + value
        self.data = merged
        return self

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's periodic log line prints: the increments themselves."""
        return dict(self.data)

    def is_empty(self) -> bool:
        """Nothing grew."""
        return not any(self.data.values())


class KVCachePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]  # vLLM: untyped
    """One Prometheus counter per exported connector counter, per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name in EXPORTED_COUNTERS:
            counter = self._counter_cls(
                name=f"vllm:kvcache_{name}",
                documentation=_HELP.get(name, f"kvcache connector: {name.replace('_', ' ')}."),
                labelnames=labelnames,
            )
            self.counters[name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one step's increments."""
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
