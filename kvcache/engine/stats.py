"""Counters an engine adapter writes for tools and tests: one JSON file per process."""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EXPORTED_COUNTERS", "ConnectorStats", "CounterDeltas", "StatsFile"]

log = logging.getLogger(__name__)


class StatsFile:
    """Writes counters to ``{dir}/kvcache-{role}-{pid}.json`` when they change (atomically)."""

    def __init__(self, directory: Path | None, role: str, pid: int) -> None:
        self.path = None if directory is None else Path(directory) / f"kvcache-{role}-{pid}.json"
        self._last: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def write(self, snapshot: dict[str, Any], *, force: bool = False) -> None:
        """Write ``snapshot`` unless it equals the last one written (``force``: always)."""
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


@dataclass
class ConnectorStats:
    """Counters one connector process keeps; written to ``stats_dir`` as JSON.

    Scheduler half: ``lookups`` (prefix lookups answered), ``lookup_deferred``
    ("ask again" answers), ``lookup_errors``/``lookup_timeouts`` (treated as
    misses), ``tokens_matched`` (tokens offered to vLLM to load),
    ``requests_matched``. Worker half: ``blocks_loaded``/``tokens_loaded``
    (verified and placed into the engine's cache), ``load_error_blocks``
    (reported to vLLM for recomputation), ``blocks_saved`` (written),
    ``blocks_save_touched`` (already stored), ``blocks_save_failed``,
    ``blocks_save_dropped`` (queue full or shutdown), ``saves_skipped``
    (saves withheld because the same step's load failed), ``hints_bad`` (requests
    whose retention hint was malformed and ignored), ``saves_declined`` (saves not
    planned because the request's hint said ``store: false``), ``requests_isolated``
    (requests with a LoRA adapter or a ``cache_salt``, which the store's keys do not
    name: neither loaded nor saved), ``save_jobs_queued`` /
    ``save_jobs_done`` (blocks and states handed to the saver thread, and finished
    with, stored or failed: equal when no save is pending), ``async_loads``
    (loads run while their request waited). Scheduler half, fetch or recompute:
    ``fetch_decisions`` (hits offered), ``recompute_decisions`` (hits declined
    because recomputing was predicted faster), ``tokens_recompute_chosen``, and the
    planner's current ``load_gbps_estimate`` and ``prefill_tokens_per_s_estimate``.

    Hybrid models, scheduler half: ``swa_hits`` (hits backed by a worker's state),
    ``swa_tokens_without_state`` (stored tokens not offered because no worker holds
    the state after them). Worker half: ``swa_states_saved`` / ``swa_state_bytes_saved``
    (states taken and held), ``swa_local_hits`` / ``swa_remote_hits`` (states loaded
    from this worker's RAM / fetched from a peer), ``swa_misses`` (states that could
    not be had: the request was recomputed), and ``swa_state_dropped`` (states whose
    window was freed before they could be taken, or refused).

    Bounded-replay models (DeepSeek V4.1), scheduler half: ``swa_state_restores`` (hits
    loaded with their window: vLLM replays nothing), ``swa_bounded_replays`` (hits loaded
    without it: vLLM replays the last window), ``swa_full_recomputes`` (loads that claimed
    the window and failed: vLLM recomputed the request whole).
    """

    role: str
    pid: int
    namespace: dict[str, Any] = field(default_factory=dict)
    lookups: int = 0
    lookup_deferred: int = 0
    lookup_errors: int = 0
    lookup_timeouts: int = 0
    requests_matched: int = 0
    tokens_matched: int = 0
    load_requests: int = 0
    blocks_loaded: int = 0
    tokens_loaded: int = 0
    load_error_blocks: int = 0
    load_failed_requests: int = 0
    blocks_saved: int = 0
    blocks_save_touched: int = 0
    blocks_save_failed: int = 0
    blocks_save_dropped: int = 0
    saves_skipped: int = 0
    hints_bad: int = 0
    saves_declined: int = 0
    requests_isolated: int = 0
    save_jobs_queued: int = 0
    save_jobs_done: int = 0
    save_queue_peak_bytes: int = 0
    async_loads: int = 0
    fetch_decisions: int = 0
    recompute_decisions: int = 0
    tokens_recompute_chosen: int = 0
    load_gbps_estimate: float | None = None
    prefill_tokens_per_s_estimate: float | None = None
    swa_hits: int = 0
    swa_tokens_without_state: int = 0
    swa_states_saved: int = 0
    swa_state_bytes_saved: int = 0
    swa_local_hits: int = 0
    swa_remote_hits: int = 0
    swa_misses: int = 0
    swa_state_dropped: int = 0
    swa_state_restores: int = 0
    swa_bounded_replays: int = 0
    swa_full_recomputes: int = 0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return asdict(self)


#: The counters a connector reports through vLLM's stats path to its Prometheus
#: ``/metrics`` (as ``vllm:kvcache_<name>_total``, summed over the engine's processes).
EXPORTED_COUNTERS: tuple[str, ...] = (
    "lookups",
    "requests_matched",
    "tokens_matched",
    "blocks_loaded",
    "tokens_loaded",
    "load_error_blocks",
    "load_failed_requests",
    "blocks_saved",
    "blocks_save_failed",
    "blocks_save_dropped",
    "swa_local_hits",
    "swa_remote_hits",
    "swa_misses",
    "swa_state_restores",
    "swa_bounded_replays",
    "swa_full_recomputes",
)


class CounterDeltas:
    """What grew since the last call: vLLM asks each connector half for its stats every
    step and sums them across processes, so each half hands over increments, never totals
    (the totals stay in the stats file)."""

    def __init__(self, names: tuple[str, ...] = EXPORTED_COUNTERS) -> None:
        self.names = names
        self._last: dict[str, int] = dict.fromkeys(names, 0)

    def take(self, stats: ConnectorStats) -> dict[str, int]:
        """The exported counters' increments since the last ``take`` (only those that grew)."""
        out: dict[str, int] = {}
        for name in self.names:
            now = int(getattr(stats, name))
            grew = now - self._last[name]
            if grew > 0:
                out[name] = grew
            self._last[name] = now
        return out
