"""Whose shards make room, decided without I/O.

Two pressures free space on a node:

* **Quotas.** A PUT that would take a tenant past its byte quota (or one of
  its classes past its class quota) first evicts that tenant's own
  earliest-expiring shards (of that class); when they cannot make room the
  PUT is refused with QUOTA. A tenant's flood therefore churns its own
  blocks, never another tenant's.
* **Capacity.** Above the high watermark, shards are evicted earliest-expiry
  first down to the low watermark, taking from the most-to-blame tenants
  first: the writing tenant if it holds at least its share, then every tenant
  over its share, then anyone. A tenant's share is its quota when it has one,
  else an equal part of the capacity among the tenants holding data.

The store turns these decisions into cursor walks (``kvcache.server.store``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvcache.credentials import TenantId

__all__ = ["Quota", "QuotaNeed", "capacity_tiers", "quota_needs"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Quota:
    """A tenant's byte limits on one node (None: no limit)."""

    total: int | None = None
    classes: Mapping[str, int] = field(default_factory=dict)
    #: Bytes of pinned shards the tenant may keep (0: none; pins are then dropped).
    pins: int = 0


@dataclass(frozen=True, slots=True)
class QuotaNeed:
    """Bytes a tenant must free before a PUT fits: of one class, or of any (class None)."""

    traffic_class: str | None
    nbytes: int


def quota_needs(
    quota: Quota,
    *,
    tenant_bytes: int,
    class_bytes: Mapping[str, int],
    incoming: Mapping[str, int],
) -> list[QuotaNeed]:
    """What a tenant must evict of its own for ``incoming`` bytes per class to fit its quotas.

    Class quotas come first (freeing a class also lowers the tenant total);
    an incoming class larger than its quota, or an incoming total larger than
    the tenant quota, can never fit: the caller refuses it when eviction
    cannot free ``nbytes``.
    """
    needs: list[QuotaNeed] = []
    freed = 0
    for cls, size in sorted(incoming.items()):
        limit = quota.classes.get(cls)
        if limit is None:
            continue
        over = class_bytes.get(cls, 0) + size - limit
        if over > 0:
            needs.append(QuotaNeed(cls, over))
            freed += over
    if quota.total is not None:
        over = tenant_bytes - freed + sum(incoming.values()) - quota.total
        if over > 0:
            needs.append(QuotaNeed(None, over))
    return needs


def capacity_tiers(
    writer: TenantId | None,
    *,
    tenant_bytes: Mapping[TenantId, int],
    quotas: Mapping[TenantId, Quota],
    capacity: int,
) -> list[list[TenantId]]:
    """Tenants to evict from, tier by tier, when the node is above its high watermark.

    Within a tier the store takes earliest-expiring shards first; it moves to
    the next tier only when a tier has nothing left.
    """
    holders = [t for t, n in tenant_bytes.items() if n > 0]
    active = set(holders) | ({writer} if writer is not None else set())
    fair = capacity // max(1, len(active))

    def share(tenant: TenantId) -> int:
        limit = quotas.get(tenant, Quota()).total
        return fair if limit is None else min(limit, capacity)

    tiers: list[list[TenantId]] = []
    if writer is not None and tenant_bytes.get(writer, 0) >= share(writer):
        tiers.append([writer])
    over = sorted(
        (t for t in holders if tenant_bytes[t] > share(t) and [t] not in tiers),
        key=lambda t: tenant_bytes[t] - share(t),
        reverse=True,
    )
    if over:
        tiers.append(over)
    tiers.append(sorted(holders))
    return tiers
