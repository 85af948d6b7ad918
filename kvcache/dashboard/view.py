"""The status page's data: one JSON document built from a poll of every node. Pure.

:func:`build_view` takes each node's ``/stats`` (or its error), the history of
earlier polls and when each node was last seen, and returns what the page
draws: the cluster map with health, capacity and watermark state, bytes per
class and tenant, hit and miss rates per class over the last minute and as a
series over the last minutes, daemon-side request latency percentiles, errors
by kind, garbage collection, and repair/scrub (none exists yet, and it says so).

Latencies are the daemons' own: from a request's arrival on the daemon to its
reply being handed to the socket, per batch request (``request_seconds``), not
what a client sees end to end (that adds the network and the client's work).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvcache.dashboard.quantiles import histogram_quantile
from kvcache.dashboard.samples import ClusterSample, History, NodePoll, window_delta

__all__ = ["REPAIR_NOTE", "VIEW_VERSION", "ViewContext", "build_view"]

#: Version of the document's layout (the page checks it).
VIEW_VERSION = 1
REPAIR_NOTE = (
    "Repair runs as `kvcache repair` (a pass, or --follow to keep running): its progress "
    "is in its own output. Clients also put back shards a load found missing or corrupt "
    "(read repair), counted in the client's counters."
)
#: What each op's latency means, in the page's words.
OP_LABELS = {
    "get": "load: GET shards",
    "put": "store: PUT shards",
    "has": "match: HAS",
    "touch": "TOUCH (slide expiry)",
    "delete": "DELETE",
    "stats": "STATS",
}
_QUANTILES = (("p50_ms", 0.5), ("p90_ms", 0.9), ("p99_ms", 0.99))
_GC = ("expired_shards", "expired_bytes", "evicted_shards", "evicted_bytes", "quota_evicted_shards")


@dataclass(frozen=True, slots=True, kw_only=True)
class ViewContext:
    """Facts about the server of the page rather than the cluster."""

    served_by: str
    cluster_source: str
    cluster_epoch: int | None = None
    cluster_error: str = ""
    refresh_ms: int = 2000
    auth: str = "token"


def build_view(
    polls: Sequence[NodePoll],
    *,
    now: float,
    history: History,
    last_seen: Mapping[str, float],
    context: ViewContext,
    window_s: float = 60.0,
) -> dict[str, Any]:
    """The page's JSON document for one poll (see the module docstring)."""
    current = ClusterSample.of(now, list(polls))
    old = history.before(now, window_s)
    delta = window_delta(old, current)
    since_start = window_delta(None, current)
    span = now - old.at if old is not None else None
    bounds = _bounds(polls)
    return {
        "version": VIEW_VERSION,
        "generated_at": now,
        "served_by": context.served_by,
        "refresh_ms": context.refresh_ms,
        "auth": context.auth,
        "cluster": {
            "source": context.cluster_source,
            "epoch": context.cluster_epoch,
            "error": context.cluster_error,
        },
        "window": {"seconds": span, "label": _window_label(span)},
        "nodes": [_node(p, now, last_seen, old) for p in polls],
        "totals": _totals(polls),
        "rates": _rates(delta, span, since_start),
        "series": _series([*history.samples(), current]),
        "latency": _latency(delta, since_start, bounds),
        "errors": _errors(delta, since_start),
        "gc": {
            name: {
                "total": since_start.get(f"gc:{name}", 0.0),
                "per_s": _per_s(delta.get(f"gc:{name}", 0.0), span),
            }
            for name in _GC
        },
        "repair": _repair(polls),
        "retention": _retention(polls),
    }


def _retention(polls: Sequence[NodePoll]) -> dict[str, Any]:
    """Whether the retention promise holds, per (tenant, class), summed over the answering
    nodes' ``/stats`` ``retention``: shards removed by cause (``evicted`` = before their
    TTL), and the youngest of the nodes' oldest-live ages."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}

    def row(tenant: str, cls: str) -> dict[str, Any]:
        return rows.setdefault(
            (tenant, cls),
            {"tenant": tenant, "class": cls, "expired": 0, "evicted": 0, "quota": 0,
             "deleted": 0, "evicted_bytes": 0, "oldest_live_age_s": None},
        )  # fmt: skip

    for p in polls:
        retention = (p.stats or {}).get("retention")
        if not isinstance(retention, Mapping):
            continue
        for r in retention.get("removals", []):
            entry = row(str(r["tenant"]), str(r["class"]))
            cause = str(r["cause"])
            if cause in ("expired", "evicted", "quota", "deleted"):
                entry[cause] += int(r["shards"])
            if cause == "evicted":
                entry["evicted_bytes"] += int(r["bytes"])
        for r in retention.get("oldest_live_age_s", []):
            entry = row(str(r["tenant"]), str(r["class"]))
            age = float(r["age_s"])
            old = entry["oldest_live_age_s"]
            entry["oldest_live_age_s"] = age if old is None else min(old, age)
    ordered = [rows[k] for k in sorted(rows)]
    broken = sum(r["evicted"] for r in ordered)
    return {
        "rows": ordered,
        "evicted_before_ttl": broken,
        "text": (
            "Every removal so far was an expiry, a quota or a delete: the retention promise held."
            if not broken
            else f"{broken:,} live shards were evicted for capacity before their TTL: the "
            "retention promise was broken (add capacity; `kvcache retention plan` sizes it)."
        ),
    }


def _repair(polls: Sequence[NodePoll]) -> dict[str, Any]:
    """Scrub state per answering node (from its ``/stats``), and a one-line summary."""
    nodes: list[dict[str, Any]] = []
    for p in polls:
        scrub = (p.stats or {}).get("scrub")
        if not isinstance(scrub, Mapping):
            continue
        nodes.append(
            {
                "node": p.node.id,
                "enabled": bool(scrub.get("enabled")),
                "running": bool(scrub.get("running")),
                "progress": float(scrub.get("pass_progress", 1.0)),
                "passes": int(scrub.get("passes", 0)),
                "checked": int(scrub.get("shards_checked", 0)),
                "bad": int(scrub.get("shards_bad", 0)),
            }
        )
    running = [n for n in nodes if n["running"]]
    checked = sum(n["checked"] for n in nodes)
    bad = sum(n["bad"] for n in nodes)
    if not nodes:
        scrub_text = "scrub: no node reports it."
    else:
        scrub_text = (
            f"scrub: {len(running)} of {len(nodes)} nodes scrubbing; {checked:,} shards "
            f"re-verified and {bad:,} bad ones deleted since the daemons started."
        )
    return {
        "running": bool(running),
        "text": f"{scrub_text} {REPAIR_NOTE}",
        "nodes": nodes,
    }


def _window_label(span: float | None) -> str:
    if span is None:
        return "since each daemon started"
    return f"last {span:.0f} s"


def _per_s(value: float, span: float | None) -> float | None:
    return value / span if span else None


def _bounds(polls: Sequence[NodePoll]) -> list[float]:
    for p in polls:
        latency = (p.stats or {}).get("latency")
        if isinstance(latency, Mapping) and isinstance(latency.get("bounds_s"), list):
            return [float(b) for b in latency["bounds_s"]]
    return []


def _node(
    poll: NodePoll, now: float, last_seen: Mapping[str, float], old: ClusterSample | None
) -> dict[str, Any]:
    node = poll.node
    stats = poll.stats or {}
    raw_usage = stats.get("usage")
    usage: Mapping[str, Any] = raw_usage if isinstance(raw_usage, Mapping) else {}
    used = int(usage.get("used_bytes", 0))
    capacity = int(usage.get("capacity_bytes", 0))
    seen = last_seen.get(node.id)
    out: dict[str, Any] = {
        "id": node.id,
        "domain": node.domain,
        "state": node.state.value,
        "data": node.data,
        "admin": node.admin,
        "health": "healthy" if poll.ok else "unreachable",
        "error": poll.error,
        "last_seen": seen,
        "age_s": None if seen is None else max(0.0, now - seen),
        "poll_ms": round(poll.seconds * 1000, 1),
        "uptime_s": stats.get("uptime_s"),
        "used_bytes": used,
        "capacity_bytes": capacity,
        "shards": int(usage.get("shards", 0)),
        "connections": stats.get("connections"),
        "watermark": _watermark(used, capacity, stats.get("watermarks")),
        "requests_per_s": None,
    }
    if poll.ok and old is not None and node.id in old.nodes:
        mine = ClusterSample(now, {node.id: ClusterSample.of(now, [poll]).nodes[node.id]})
        own = window_delta(ClusterSample(old.at, {node.id: old.nodes[node.id]}), mine)
        requests = sum(v for k, v in own.items() if k.startswith("requests:"))
        out["requests_per_s"] = _per_s(requests, now - old.at)
    return out


def _watermark(used: int, capacity: int, marks: object) -> dict[str, Any]:
    """Fill against the eviction watermarks: ``ok`` below low, ``between`` (eviction, once
    started above high, runs down to low), ``high`` at or above high (evicting)."""
    high = float(marks.get("high", 0.9)) if isinstance(marks, Mapping) else 0.9
    low = float(marks.get("low", 0.8)) if isinstance(marks, Mapping) else 0.8
    fill = used / capacity if capacity else 0.0
    state = "ok" if fill < low else "between" if fill < high else "high"
    return {"fill": fill, "low": low, "high": high, "state": state}


def _totals(polls: Sequence[NodePoll]) -> dict[str, Any]:
    used = capacity = shards = 0
    classes: dict[str, dict[str, int]] = {}
    tenants: dict[str, dict[str, Any]] = {}
    for p in polls:
        usage = (p.stats or {}).get("usage")
        if not isinstance(usage, Mapping):
            continue
        used += int(usage.get("used_bytes", 0))
        capacity += int(usage.get("capacity_bytes", 0))
        shards += int(usage.get("shards", 0))
        for name, c in dict(usage.get("classes") or {}).items():
            entry = classes.setdefault(name, {"bytes": 0, "shards": 0})
            entry["bytes"] += int(c.get("bytes", 0))
            entry["shards"] += int(c.get("shards", 0))
        for name, t in dict(usage.get("tenants") or {}).items():
            entry_t = tenants.setdefault(name, {"bytes": 0, "shards": 0, "classes": {}})
            entry_t["bytes"] += int(t.get("bytes", 0))
            entry_t["shards"] += int(t.get("shards", 0))
            for cls, c in dict(t.get("classes") or {}).items():
                entry_t["classes"][cls] = entry_t["classes"].get(cls, 0) + int(c.get("bytes", 0))
    return {
        "nodes": len(polls),
        "healthy": sum(1 for p in polls if p.ok),
        "used_bytes": used,
        "capacity_bytes": capacity,
        "shards": shards,
        "classes": dict(sorted(classes.items())),
        "tenants": dict(sorted(tenants.items())),
    }


def _class_counts(delta: Mapping[str, float], kind: str) -> dict[str, float]:
    prefix = f"{kind}:get:"
    return {k[len(prefix) :]: v for k, v in delta.items() if k.startswith(prefix)}


def _rates(
    delta: Mapping[str, float], span: float | None, since_start: Mapping[str, float]
) -> dict[str, Any]:
    """GET shards served (hits) and not found (misses) per class, in the window and since
    each daemon started; misses per class only where the daemons count them (``misses``
    in ``/stats``), else None, with the cluster-wide figures from the item statuses."""
    per_class_misses = any(k.startswith("misses:") for k in since_start)

    def counts(source: Mapping[str, float]) -> dict[str, tuple[float, float | None]]:
        hits, misses = _class_counts(source, "hits"), _class_counts(source, "misses")
        return {
            name: (hits.get(name, 0.0), misses.get(name, 0.0) if per_class_misses else None)
            for name in set(hits) | set(misses)
        }

    def row(h: float, m: float | None, th: float, tm: float | None) -> dict[str, Any]:
        return {
            "hits": h,
            "misses": m,
            "hits_per_s": _per_s(h, span),
            "misses_per_s": None if m is None else _per_s(m, span),
            "hit_ratio": None if m is None else _ratio(h, m),
            "total_hit_ratio": None if tm is None else _ratio(th, tm),
        }

    window, total = counts(delta), counts(since_start)
    classes = {
        name: row(*window.get(name, (0.0, 0.0 if per_class_misses else None)), *total[name])
        for name in sorted(total)
    }
    return {
        "classes": classes,
        "per_class_misses": per_class_misses,
        "all": row(
            delta.get("items:get:ok", 0.0),
            delta.get("items:get:not_found", 0.0),
            since_start.get("items:get:ok", 0.0),
            since_start.get("items:get:not_found", 0.0),
        ),
    }


def _series(samples: Sequence[ClusterSample]) -> dict[str, Any]:
    """Per interval between consecutive samples: GET shard hit ratio, overall and per class
    (per class only where misses are counted per class), and GET shards served per second."""
    t: list[float] = []
    overall: list[float | None] = []
    served: list[float] = []
    intervals: list[tuple[dict[str, float], dict[str, float]]] = []
    for a, b in itertools.pairwise(samples):
        span = b.at - a.at
        if span <= 0:
            continue
        d = window_delta(a, b)
        ok, missed = d.get("items:get:ok", 0.0), d.get("items:get:not_found", 0.0)
        t.append(b.at)
        overall.append(_ratio(ok, missed))
        served.append(ok / span)
        intervals.append((_class_counts(d, "hits"), _class_counts(d, "misses")))
    names = sorted({n for hits, misses in intervals for n in (*hits, *misses)})
    per_class = {
        name: [
            _ratio(hits.get(name, 0.0), misses.get(name, 0.0)) if misses else None
            for hits, misses in intervals
        ]
        for name in names
    }
    return {
        "t": t,
        "hit_ratio": overall,
        "get_shards_per_s": served,
        "class_hit_ratio": per_class,
    }


def _ratio(hits: float, misses: float) -> float | None:
    return None if hits + misses == 0 else hits / (hits + misses)


def _percentiles(delta: Mapping[str, float], op: str, bounds: list[float]) -> dict[str, Any]:
    buckets = [int(delta.get(f"lat:{op}:{i}", 0)) for i in range(len(bounds) + 1)]
    count = int(delta.get(f"latn:{op}:count", 0))
    out: dict[str, Any] = {"count": count}
    total_s = delta.get(f"latn:{op}:sum", 0.0)
    out["mean_ms"] = total_s / count * 1000 if count else None
    for name, q in _QUANTILES:
        value = histogram_quantile(q, bounds, buckets) if bounds else None
        out[name] = None if value is None else value * 1000
    return out


def _latency(
    delta: Mapping[str, float], since_start: Mapping[str, float], bounds: list[float]
) -> dict[str, Any]:
    ops = sorted({k.split(":")[1] for k in since_start if k.startswith("latn:")})
    rows = {}
    for op in ops:
        total = _percentiles(since_start, op, bounds)
        if not total["count"]:
            continue
        rows[op] = {
            "label": OP_LABELS.get(op, op),
            "window": _percentiles(delta, op, bounds),
            "total": total,
        }
    return {
        "what": "time per batch request, from its arrival to its reply handed to the socket",
        "bounds_ms": [b * 1000 for b in bounds],
        "ops": rows,
    }


def _errors(delta: Mapping[str, float], since_start: Mapping[str, float]) -> list[dict[str, Any]]:
    kinds = {k[7:] for k in since_start if k.startswith("errors:")}
    rows = [
        {
            "kind": kind,
            "total": since_start[f"errors:{kind}"],
            "window": delta.get(f"errors:{kind}", 0.0),
        }
        for kind in kinds
        if since_start[f"errors:{kind}"]
    ]
    return sorted(rows, key=lambda r: (-r["total"], r["kind"]))
