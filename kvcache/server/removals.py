"""Whether the retention promise held: every removal of a shard, by (tenant, class) and cause.

A daemon removes a shard for one of four causes:

* ``expired``: its expiry passed (the sweeper, or eviction reaching an already
  expired shard): the promise kept;
* ``evicted``: capacity pressure removed it while it was still live, *before
  its TTL*: the promise broken, what an operator must see at once
  (``kvcache_removed_shards_total{cause="evicted"}``, the shipped alert rule);
* ``quota``: the tenant's own writes removed it to stay within its quota (a
  live shard too, but by the tenant's own doing);
* ``deleted``: a DELETE.

For each (tenant, class, cause) this book keeps shards and bytes removed and a
histogram of the age at removal (now − when this daemon stored the shard); the
store fills it from its removal paths, the admin port renders it (``/metrics``,
``/stats``). Safe to read from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache.credentials import TenantId

__all__ = ["AGE_BUCKETS_S", "CAUSES", "RemovalBook", "render_removals"]

#: Causes of removal, in the order they are reported.
CAUSES = ("expired", "evicted", "quota", "deleted")
#: Upper bounds (seconds) of the age-at-removal histogram: minutes to two weeks, so the
#: 3-day and 7-day classes' promises fall on bucket edges.
AGE_BUCKETS_S = (60, 600, 3600, 6 * 3600, 86400, 2 * 86400, 3 * 86400, 5 * 86400,
                 7 * 86400, 14 * 86400)  # fmt: skip
_EDGES_MS = np.array([b * 1000 for b in AGE_BUCKETS_S], np.int64)


@dataclass
class _Cell:
    shards: int = 0
    nbytes: int = 0
    age_sum_ms: int = 0
    #: Counts per bucket (not cumulative), the last one for ages past every bound.
    buckets: list[int] = field(default_factory=lambda: [0] * (len(AGE_BUCKETS_S) + 1))


class RemovalBook:
    """Removal counters and age histograms per (tenant id, class, cause)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cells: dict[tuple[bytes, str, str], _Cell] = {}
        #: Told of every counted removal with its storage keys, on the store's thread:
        #: (tenant, class, cause, keys). The daemon's event publisher (kvcache.events).
        self.listener: Callable[[bytes, str, str, Sequence[bytes]], None] | None = None

    def record(
        self,
        tenant: bytes,
        traffic_class: str,
        cause: str,
        *,
        sizes: Iterable[int] | npt.NDArray[np.int64],
        ages_ms: Iterable[int] | npt.NDArray[np.int64],
        keys: Sequence[bytes] = (),
    ) -> None:
        """Count removed shards of one (tenant, class) for ``cause``, their sizes and ages
        (``keys``: their storage keys, for :attr:`listener`)."""
        if cause not in CAUSES:
            raise ValueError(f"unknown removal cause {cause!r}; known: {CAUSES}")
        size_arr = np.asarray(sizes if isinstance(sizes, np.ndarray) else list(sizes), np.int64)
        if not len(size_arr):
            return
        if self.listener is not None and keys:
            self.listener(tenant, traffic_class, cause, keys)
        age_arr = np.asarray(ages_ms if isinstance(ages_ms, np.ndarray) else list(ages_ms))
        ages: npt.NDArray[np.int64] = np.maximum(age_arr.astype(np.int64), 0)
        hist = np.bincount(np.searchsorted(_EDGES_MS, ages, side="left"),
                           minlength=len(AGE_BUCKETS_S) + 1)  # fmt: skip
        with self._lock:
            cell = self._cells.setdefault((bytes(tenant), traffic_class, cause), _Cell())
            cell.shards += len(size_arr)
            cell.nbytes += int(size_arr.sum())
            cell.age_sum_ms += int(ages.sum())
            cell.buckets = [a + int(b) for a, b in zip(cell.buckets, hist, strict=True)]

    def snapshot(self, names: Mapping[TenantId, str] | None = None) -> list[dict[str, Any]]:
        """One row per (tenant, class, cause): tenant (name where known), class, cause,
        shards, bytes, age_sum_s and cumulative ``buckets`` ([le seconds or "+Inf", count])."""
        names = names or {}
        with self._lock:
            cells = {k: (c.shards, c.nbytes, c.age_sum_ms, list(c.buckets))
                     for k, c in self._cells.items()}  # fmt: skip
        rows = []
        for (tenant, cls, cause), (shards, nbytes, age_ms, buckets) in sorted(cells.items()):
            cumulative = np.cumsum(buckets).tolist()
            rows.append(
                {
                    "tenant": names.get(TenantId(tenant), tenant.hex()),
                    "class": cls,
                    "cause": cause,
                    "shards": shards,
                    "bytes": nbytes,
                    "age_sum_s": age_ms / 1000,
                    "buckets": [
                        [le, n] for le, n in zip([*AGE_BUCKETS_S, "+Inf"], cumulative, strict=True)
                    ],
                }
            )
        return rows


def render_removals(
    rows: list[dict[str, Any]], oldest_s: Mapping[tuple[str, str], float], *, prefix: str
) -> list[str]:
    """Prometheus text lines for :meth:`RemovalBook.snapshot` rows and the oldest live ages
    (seconds, by (tenant name, class))."""

    def esc(text: str) -> str:
        return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    lines: list[str] = []
    for name, key, help_text in (
        ("removed_shards_total", "shards", "Shards removed, by tenant, class and cause "
         "(expired, evicted = before their TTL, quota, deleted)."),
        ("removed_bytes_total", "bytes", "Record bytes removed, by tenant, class and cause."),
    ):  # fmt: skip
        lines += [f"# HELP {prefix}_{name} {help_text}", f"# TYPE {prefix}_{name} counter"]
        for r in rows:
            labels = f'tenant="{esc(r["tenant"])}",class="{esc(r["class"])}",cause="{r["cause"]}"'
            lines.append(f"{prefix}_{name}{{{labels}}} {r[key]}")
    name = f"{prefix}_removal_age_seconds"
    lines += [
        f"# HELP {name} Age at removal (since this daemon stored the shard), by tenant, class "
        "and cause.",
        f"# TYPE {name} histogram",
    ]
    for r in rows:
        labels = f'tenant="{esc(r["tenant"])}",class="{esc(r["class"])}",cause="{r["cause"]}"'
        for le, n in r["buckets"]:
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {n}')
        lines.append(f"{name}_sum{{{labels}}} {r['age_sum_s']}")
        lines.append(f"{name}_count{{{labels}}} {r['shards']}")
    name = f"{prefix}_oldest_live_age_seconds"
    lines += [
        f"# HELP {name} Age of the earliest-expiring live shard (the next one pressure would "
        "remove), by tenant and class.",
        f"# TYPE {name} gauge",
    ]
    for (tenant, cls), age in sorted(oldest_s.items()):
        lines.append(f'{name}{{tenant="{esc(tenant)}",class="{esc(cls)}"}} {age}')
    return lines
