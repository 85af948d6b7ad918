"""Counters and latency histograms of one daemon, rendered in the Prometheus text format.

The service thread records; the admin thread renders. Recording is per
request (a batch), never per item, and takes one uncontended lock. Each
recorded request may also become a sampled DEBUG line on the
``kvcache.server.requests`` logger (:class:`kvcache.logs.RequestLog`: at most
10 a second; with DEBUG off it costs one level check).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache.logs import RequestLog
from kvcache.wire import Op, Status

__all__ = ["LATENCY_BUCKETS_S", "Metrics", "render_prometheus", "store_errors"]

#: Upper bounds (seconds) of the request latency histogram.
LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
_ITEM_STATUSES = [s for s in Status if s < 16]
_OP_NAMES = {op: op.name.lower() for op in Op}
_PREFIX = "kvcache_server"
#: The logger of the sampled per-request lines (enable with ``--log-level DEBUG``).
REQUEST_LOGGER = "kvcache.server.requests"


class _Histogram:
    __slots__ = ("buckets", "count", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, value)] += 1
        self.count += 1
        self.sum += value


class Metrics:
    """What the data path did: requests, items by status, bytes, latency, errors by kind."""

    def __init__(self, *, request_log: RequestLog | None = None) -> None:
        self._lock = threading.Lock()
        #: Sampled DEBUG line per recorded request.
        self.request_log = request_log or RequestLog(logging.getLogger(REQUEST_LOGGER))
        self.started = time.time()
        ops = [op.name.lower() for op in Op]
        self._requests = dict.fromkeys(ops, 0)
        self._bytes_in = dict.fromkeys(ops, 0)
        self._bytes_out = dict.fromkeys(ops, 0)
        self._items = {op: np.zeros(16, dtype=np.int64) for op in ops}
        self._latency = {op: _Histogram() for op in ops}
        self._errors: dict[str, int] = {}
        #: Shards served by GET and keys refreshed by TOUCH, by (kind, traffic class).
        self._hits: dict[tuple[str, str], int] = {}
        #: GET shards and TOUCH keys not found, by (kind, traffic class); see :meth:`miss`.
        self._misses: dict[tuple[str, str], int] = {}
        #: Data-path peers connected now, and connections closed so far (by the
        #: peer, or by the daemon after a protocol or auth error). Loop thread only.
        self.connections = 0
        self.disconnects = 0
        #: Bytes of half-received requests held now (admission's in-flight count).
        self.inflight_bytes = 0
        #: The native data plane's cumulative counters (kvcache.server.native_plane), folded
        #: into these on every read: see :meth:`attach_native`.
        self._native: Callable[[], npt.NDArray[np.void]] | None = None
        self._native_label: Callable[[int], str] = str
        self._native_seen: npt.NDArray[np.void] | None = None
        #: Requests the plane answered, by op, and the ones it handed to Python, by reason.
        self._native_requests = {"get": 0, "has": 0}
        self._native_handed: dict[str, int] = {}
        self._handoff_reasons: tuple[str, ...] = ()

    def observe(
        self,
        op: Op,
        seconds: float,
        *,
        bytes_in: int,
        bytes_out: int,
        statuses: npt.NDArray[np.uint8] | None = None,
        counts: npt.NDArray[np.int64] | None = None,
    ) -> None:
        """Record one answered request: its per-item outcomes as ``statuses``, or
        already counted per status value as ``counts`` (16 entries)."""
        name = _OP_NAMES[op]
        if counts is None and statuses is not None:
            counts = np.bincount(statuses, minlength=16)[:16]
        with self._lock:
            self._requests[name] += 1
            self._bytes_in[name] += bytes_in
            self._bytes_out[name] += bytes_out
            self._latency[name].observe(seconds)
            if counts is not None:
                self._items[name] += counts
        if self.request_log.enabled():
            self.request_log.record(
                name,
                seconds,
                items=0 if counts is None else int(counts.sum()),
                statuses=(
                    {}
                    if counts is None
                    else {
                        Status(s).name.lower(): int(counts[s]) for s in _ITEM_STATUSES if counts[s]
                    }
                ),
                bytes_in=bytes_in,
                bytes_out=bytes_out,
            )

    def attach_native(
        self,
        read: Callable[[], npt.NDArray[np.void]],
        label: Callable[[int], str],
        handoff_reasons: Sequence[str],
    ) -> None:
        """Count what the native data plane answers: ``read`` gives its cumulative counters
        (:data:`kvcache.server.native_plane.STATS_DTYPE`, any thread), ``label`` the class
        label of a counter slot; folded in whenever these metrics are read."""
        with self._lock:
            self._native = read
            self._native_label = label
            self._handoff_reasons = tuple(handoff_reasons)
            self._native_seen = None

    def _fold_native(self) -> None:
        """Add what the native plane counted since the last fold (holding the lock)."""
        if self._native is None:
            return
        now = self._native()[0]
        last = self._native_seen
        self._native_seen = now
        for op in ("get", "has"):
            cur = now[op] if op == "get" else now[op][None]
            prev = None if last is None else (last[op] if op == "get" else last[op][None])
            names = cur.dtype.names or ()
            diff = {name: cur[name] if prev is None else cur[name] - prev[name] for name in names}
            for slot in np.flatnonzero(diff["requests"]).tolist():
                self._add_native(op, slot, {name: d[slot] for name, d in diff.items()})
        self._native_handed = {
            reason: int(n)
            for reason, n in zip(self._handoff_reasons, now["handed"].tolist(), strict=True)
        }

    def _add_native(self, op: str, slot: int, delta: Mapping[str, Any]) -> None:
        n = int(delta["requests"])
        self._requests[op] += n
        self._native_requests[op] += n
        self._bytes_in[op] += int(delta["bytes_in"])
        self._bytes_out[op] += int(delta["bytes_out"])
        hist = self._latency[op]
        for b, count in enumerate(delta["buckets"].tolist()):
            hist.buckets[b] += count
        hist.count += n
        hist.sum += float(delta["latency_sum"])
        items = int(delta["items_ok"])
        key = (op, self._native_label(slot))
        if items:
            self._items[op][Status.OK] += items
            self._hits[key] = self._hits.get(key, 0) + items
        missed = int(delta["items_missed"])
        if missed:
            self._items[op][Status.NOT_FOUND] += missed
            self._misses[key] = self._misses.get(key, 0) + missed

    def native(self) -> dict[str, Any]:
        """Requests the native data plane answered (by op) and handed to Python (by why)."""
        with self._lock:
            self._fold_native()
            return {"requests": dict(self._native_requests), "handed": dict(self._native_handed)}

    def error(self, kind: str, count: int = 1) -> None:
        """Count a failure of ``kind`` (bad_request, unauthorized, too_large, internal, ...)."""
        with self._lock:
            self._errors[kind] = self._errors.get(kind, 0) + count

    def hit(self, kind: str, traffic_class: str, count: int) -> None:
        """Count ``count`` hits of ``kind`` ("get" shards, "touch" keys) for a class."""
        with self._lock:
            key = (kind, traffic_class)
            self._hits[key] = self._hits.get(key, 0) + count

    def miss(self, kind: str, traffic_class: str, count: int) -> None:
        """Count ``count`` misses of ``kind`` ("get" shards, "touch" keys) for a class.

        The request handler calls it beside :meth:`hit` with the items that
        came back NOT_FOUND, so hit and miss rates per class can be told apart.
        """
        with self._lock:
            key = (kind, traffic_class)
            self._misses[key] = self._misses.get(key, 0) + count

    def errors(self) -> dict[str, int]:
        """Errors counted so far, by kind."""
        with self._lock:
            return dict(self._errors)

    def snapshot(self) -> dict[str, Any]:
        """Plain counters for ``/stats`` and the STATS op."""
        with self._lock:
            self._fold_native()
            return {
                "native": {
                    "requests": dict(self._native_requests),
                    "handed": dict(self._native_handed),
                },
                "uptime_s": round(time.time() - self.started, 3),
                "requests": dict(self._requests),
                "bytes_in": dict(self._bytes_in),
                "bytes_out": dict(self._bytes_out),
                "items": {
                    op: {Status(s).name.lower(): int(c[s]) for s in _ITEM_STATUSES if c[s]}
                    for op, c in self._items.items()
                },
                "errors": dict(self._errors),
                "hits": {
                    kind: {c: n for (k, c), n in sorted(self._hits.items()) if k == kind}
                    for kind in ("get", "touch")
                },
                "misses": {
                    kind: {c: n for (k, c), n in sorted(self._misses.items()) if k == kind}
                    for kind in ("get", "touch")
                },
                "latency": {
                    "bounds_s": list(LATENCY_BUCKETS_S),
                    "ops": {
                        op: {"buckets": list(h.buckets), "count": h.count, "sum_s": h.sum}
                        for op, h in self._latency.items()
                    },
                },
                "connections": self.connections,
                "inflight_bytes": self.inflight_bytes,
                "disconnects": self.disconnects,
            }

    def render(self, extra_errors: Mapping[str, int] | None = None) -> list[str]:
        """Prometheus lines for the request metrics (``extra_errors``: counted elsewhere)."""
        with self._lock:
            self._fold_native()
            errors = dict(self._errors)
            for kind, n in (extra_errors or {}).items():
                errors[kind] = errors.get(kind, 0) + n
            lines = _family(
                "requests_total",
                "counter",
                "Requests answered, by op.",
                ((f'op="{op}"', n) for op, n in self._requests.items()),
            )
            lines += _family(
                "items_total",
                "counter",
                "Items answered, by op and status.",
                (
                    (f'op="{op}",status="{Status(s).name.lower()}"', int(c[s]))
                    for op, c in self._items.items()
                    for s in _ITEM_STATUSES
                    if c[s]
                ),
            )
            lines += _family(
                "received_bytes_total",
                "counter",
                "Request bytes received, by op.",
                ((f'op="{op}"', n) for op, n in self._bytes_in.items()),
            )
            lines += _family(
                "sent_bytes_total",
                "counter",
                "Reply bytes sent, by op.",
                ((f'op="{op}"', n) for op, n in self._bytes_out.items()),
            )
            lines += _family(
                "errors_total",
                "counter",
                "Failed requests and items, by kind.",
                ((f'kind="{k}"', n) for k, n in sorted(errors.items()) if n),
            )
            lines += _family(
                "hits_total",
                "counter",
                "Shards served by GET and keys refreshed by TOUCH, by traffic class.",
                (
                    (f'kind="{kind}",class="{_esc(cls)}"', n)
                    for (kind, cls), n in sorted(self._hits.items())
                ),
            )
            lines += _family(
                "misses_total",
                "counter",
                "GET shards and TOUCH keys not found, by traffic class.",
                (
                    (f'kind="{kind}",class="{_esc(cls)}"', n)
                    for (kind, cls), n in sorted(self._misses.items())
                ),
            )
            lines += _family(
                "native_requests_total",
                "counter",
                "Requests the native data plane answered without Python, by op (also in "
                "requests_total).",
                ((f'op="{op}"', n) for op, n in self._native_requests.items()),
            )
            lines += _family(
                "native_handoffs_total",
                "counter",
                "Requests the native data plane handed to the Python loop, by why.",
                ((f'reason="{r}"', n) for r, n in sorted(self._native_handed.items())),
            )
            lines += _family(
                "connections", "gauge", "Connected data-path peers.", [("", self.connections)]
            )
            lines += _family(
                "inflight_bytes",
                "gauge",
                "Bytes of half-received requests held (counted against max_inflight_bytes).",
                [("", self.inflight_bytes)],
            )
            lines += _family(
                "disconnects_total",
                "counter",
                "Data-path connections closed (by peers, or by the daemon after a protocol error).",
                [("", self.disconnects)],
            )
            lines.append(f"# HELP {_PREFIX}_request_seconds Request handling time, by op.")
            lines.append(f"# TYPE {_PREFIX}_request_seconds histogram")
            for op, hist in self._latency.items():
                running = 0
                for bound, n in zip((*LATENCY_BUCKETS_S, float("inf")), hist.buckets, strict=True):
                    running += n
                    le = "+Inf" if bound == float("inf") else repr(bound)
                    lines.append(
                        f'{_PREFIX}_request_seconds_bucket{{op="{op}",le="{le}"}} {running}'
                    )
                lines.append(f'{_PREFIX}_request_seconds_sum{{op="{op}"}} {hist.sum!r}')
                lines.append(f'{_PREFIX}_request_seconds_count{{op="{op}"}} {hist.count}')
        return lines


def render_prometheus(
    metrics: Metrics,
    *,
    node_id: str,
    usage: Mapping[str, Any],
    store_counters: Mapping[str, int],
    swa_directory: Mapping[str, int] | None = None,
    scrub: Mapping[str, Any] | None = None,
) -> str:
    """The whole ``/metrics`` page: request metrics, storage usage per class, GC counters,
    and the SWA holder directory's records and counters."""
    classes: Mapping[str, Mapping[str, int]] = usage["classes"]
    lines = _family("info", "gauge", "Daemon identity.", [(f'node_id="{_esc(node_id)}"', 1)])
    lines += metrics.render(store_errors(store_counters))
    lines += _family("used_bytes", "gauge", "Bytes of shards stored.", [("", usage["used_bytes"])])
    lines += _family(
        "capacity_bytes", "gauge", "Configured capacity.", [("", usage["capacity_bytes"])]
    )
    lines += _family("shards", "gauge", "Shards stored.", [("", usage["shards"])])
    lines += _family(
        "class_bytes",
        "gauge",
        "Bytes stored, by traffic class (the class holding each shard's expiry).",
        ((f'class="{c}"', v["bytes"]) for c, v in classes.items()),
    )
    lines += _family(
        "class_shards",
        "gauge",
        "Shards stored, by traffic class.",
        ((f'class="{c}"', v["shards"]) for c, v in classes.items()),
    )
    tenants: Mapping[str, Mapping[str, Any]] = usage.get("tenants", {})
    lines += _family(
        "tenant_bytes",
        "gauge",
        "Bytes stored, by tenant and traffic class.",
        (
            (f'tenant="{_esc(t)}",class="{c}"', v["bytes"])
            for t, entry in tenants.items()
            for c, v in entry["classes"].items()
        ),
    )
    lines += _family(
        "tenant_shards",
        "gauge",
        "Shards stored, by tenant and traffic class.",
        (
            (f'tenant="{_esc(t)}",class="{c}"', v["shards"])
            for t, entry in tenants.items()
            for c, v in entry["classes"].items()
        ),
    )
    for name, help_text in (
        ("expired_shards", "Shards deleted by the sweeper after their expiry."),
        ("expired_bytes", "Bytes deleted by the sweeper after their expiry."),
        ("evicted_shards", "Shards evicted early under capacity pressure."),
        ("evicted_bytes", "Bytes evicted early under capacity pressure."),
        ("quota_evicted_shards", "Shards a tenant's own PUTs evicted to stay within its quota."),
        ("quota_evicted_bytes", "Bytes a tenant's own PUTs evicted to stay within its quota."),
        ("touches_written", "Expiry slides written after hits."),
        ("hints_clamped", "Retention hints not granted as asked (TTL clamped, pin dropped)."),
        ("pins_refused", "Pins dropped because the tenant's pin quota was full."),
        ("put_conflicts", "PUT items refused because another stripe of the block is stored."),
        ("put_lookup_retries", "PUT transactions written again after meeting an earlier row."),
        ("segments_dropped", "Segment files removed (or kept as spares) with nothing live."),
        ("segments_reused", "Segments started on a dropped segment's file instead of a new one."),
        ("segments_compacted", "Segments whose live records were copied forward and dropped."),
        ("compacted_shards", "Records copied forward by segment compaction."),
        (
            "segments_uncompactable",
            "Segments a compaction pass could not empty (a damaged batch head): left alone.",
        ),
        (
            "rows_unreadable",
            "Index rows whose record could not be read (its segment gone or cut short).",
        ),
    ):
        lines += _family(f"{name}_total", "counter", help_text, [("", store_counters[name])])
    if swa_directory is not None:
        lines += _family(
            "swa_directory_records",
            "gauge",
            "SWA holder records held in RAM (DIR_PUT, HAS_DIR).",
            [("", swa_directory.get("records", 0))],
        )
        lines += _family(
            "swa_directory_events_total",
            "counter",
            "SWA holder directory events, by kind.",
            ((f'kind="{_esc(k)}"', v) for k, v in sorted(swa_directory.items()) if k != "records"),
        )
    if scrub is not None:
        for name, kind, help_text, value in (
            ("scrub_shards_checked_total", "counter", "Stored shards re-verified by scrub.",
             scrub["shards_checked"]),
            ("scrub_bytes_checked_total", "counter", "Bytes of stored shards re-verified.",
             scrub["bytes_checked"]),
            ("scrub_shards_bad_total", "counter", "Stored shards scrub found bad (and deleted).",
             scrub["shards_bad"]),
            ("scrub_passes_total", "counter", "Scrub passes finished.", scrub["passes"]),
            ("scrub_running", "gauge", "1 while a scrub pass is in progress.",
             int(scrub["running"])),
            ("scrub_pass_progress", "gauge", "Fraction of the current pass done (1: idle).",
             scrub["pass_progress"]),
        ):  # fmt: skip
            lines += _family(name, kind, help_text, [("", value)])
    return "\n".join(lines) + "\n"


def store_errors(store_counters: Mapping[str, int]) -> dict[str, int]:
    """The store's ``error_<kind>`` counters as {kind: count}."""
    return {k[6:]: v for k, v in store_counters.items() if k.startswith("error_")}


def _family(
    name: str, kind: str, help_text: str, samples: Iterable[tuple[str, int | float]]
) -> list[str]:
    lines = [f"# HELP {_PREFIX}_{name} {help_text}", f"# TYPE {_PREFIX}_{name} {kind}"]
    for labels, value in samples:
        label_text = f"{{{labels}}}" if labels else ""
        lines.append(f"{_PREFIX}_{name}{label_text} {value}")
    return lines


def _esc(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
