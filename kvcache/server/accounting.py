"""Who uses how much of a node: bytes and shards per (tenant, traffic class). No LMDB here.

The store writes the counters in the same transaction as the shards they
count (so a crash never leaves them wrong) and mirrors them here after the
commit; other threads (the admin server) read snapshots.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterable
from typing import Any

from kvcache.credentials import TenantId
from kvcache.server.records import TENANT_LEN, split_partition, usage_key

__all__ = ["Deltas", "UsageBook"]

_COUNTS = struct.Struct(">QQ")


class Deltas:
    """Counter changes of one transaction, per partition, and what it removed."""

    __slots__ = ("_deltas", "freed_bytes", "freed_shards", "removed", "segments")

    def __init__(self) -> None:
        self._deltas: dict[bytes, list[int]] = {}
        #: Live bytes and records per segment (kvcache.server.segments) that the
        #: transaction freed (negative) or moved there (compaction).
        self.segments: dict[int, list[int]] = {}
        self.freed_bytes = 0
        self.freed_shards = 0
        #: Storage keys removed by the transaction.
        self.removed: list[bytes] = []

    def add(self, part: bytes, dbytes: int, dcount: int) -> None:
        """Count ``dbytes`` and ``dcount`` shards more (or fewer) in partition ``part``."""
        entry = self._deltas.get(part)
        if entry is None:
            self._deltas[part] = [dbytes, dcount]
        else:
            entry[0] += dbytes
            entry[1] += dcount
        if dcount < 0:
            self.freed_bytes -= dbytes
            self.freed_shards -= dcount

    def add_segment(self, seg: int, dbytes: int, dcount: int) -> None:
        """Count ``dbytes`` and ``dcount`` records more (or fewer) live in segment ``seg``."""
        entry = self.segments.get(seg)
        if entry is None:
            self.segments[seg] = [dbytes, dcount]
        else:
            entry[0] += dbytes
            entry[1] += dcount

    def items(self) -> list[tuple[bytes, int, int]]:
        """(partition, bytes, shards) of every nonzero change."""
        return [(p, b, c) for p, (b, c) in self._deltas.items() if b or c]


class UsageBook:
    """Bytes and shards per partition, kept in memory; thread-safe snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: dict[bytes, list[int]] = {}
        self.used = 0
        self.shards = 0

    def load(self, rows: Iterable[tuple[bytes, bytes]]) -> None:
        """Start from stored (meta key, packed counters) rows."""
        for key, value in rows:
            nbytes, count = _COUNTS.unpack(value)
            if count:
                self._parts[key[len(b"usage:") :]] = [nbytes, count]
                self.used += nbytes
                self.shards += count

    def meta_rows(self, deltas: Deltas) -> list[tuple[bytes, bytes]]:
        """The meta rows a transaction writes so the stored counters include ``deltas``."""
        rows = []
        for part, dbytes, dcount in deltas.items():
            before = self._parts.get(part, [0, 0])
            rows.append((usage_key(part), _COUNTS.pack(before[0] + dbytes, before[1] + dcount)))
        return rows

    def apply(self, deltas: Deltas) -> None:
        """Mirror a committed transaction's changes."""
        with self._lock:
            for part, dbytes, dcount in deltas.items():
                entry = self._parts.setdefault(part, [0, 0])
                entry[0] += dbytes
                entry[1] += dcount
                self.used += dbytes
                self.shards += dcount
                if entry == [0, 0]:
                    del self._parts[part]

    # ------------------------------------------------------------------ queries

    def partitions(self, tenant: bytes | None = None) -> list[bytes]:
        """Partitions holding shards (of ``tenant`` only, when given)."""
        with self._lock:
            return [p for p in self._parts if tenant is None or p[:TENANT_LEN] == tenant]

    def partition_bytes(self, part: bytes) -> int:
        """Bytes held in one partition."""
        with self._lock:
            return self._parts.get(part, [0, 0])[0]

    def tenant_bytes(self, tenant: bytes) -> int:
        """Bytes held by one tenant."""
        with self._lock:
            return sum(v[0] for p, v in self._parts.items() if p[:TENANT_LEN] == tenant)

    def tenants(self) -> set[TenantId]:
        """Tenants holding shards."""
        with self._lock:
            return {TenantId(p[:TENANT_LEN]) for p in self._parts}

    def snapshot(self, names: dict[TenantId, str] | None = None) -> dict[str, Any]:
        """Totals, per class, and per tenant and class (tenants by name where known)."""
        names = names or {}
        with self._lock:
            parts = {p: list(v) for p, v in self._parts.items()}
            used, shards = self.used, self.shards
        classes: dict[str, dict[str, int]] = {}
        tenants: dict[str, dict[str, Any]] = {}
        for part, (nbytes, count) in sorted(parts.items()):
            tenant, cls = split_partition(part)
            c = classes.setdefault(cls, {"bytes": 0, "shards": 0})
            c["bytes"] += nbytes
            c["shards"] += count
            name = names.get(tenant, tenant.hex())
            t = tenants.setdefault(name, {"bytes": 0, "shards": 0, "classes": {}})
            t["bytes"] += nbytes
            t["shards"] += count
            t["classes"][cls] = {"bytes": nbytes, "shards": count}
        return {
            "used_bytes": used,
            "shards": shards,
            "classes": dict(sorted(classes.items())),
            "tenants": dict(sorted(tenants.items())),
        }
