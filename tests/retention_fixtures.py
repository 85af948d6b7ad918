"""Reading what the daemons of a real cluster hold: every shard's class and expiry (LIST)."""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.server.probe import Probe
from kvcache.testing.localcluster import LocalCluster


def shard_retention(
    cluster: LocalCluster, keys: Sequence[bytes], *, tenant: str = "default"
) -> dict[bytes, list[tuple[str, int, str]]]:
    """Per block key: (node id, expiry ms, stored class) of every live shard on every daemon."""
    secret = next(t.secret for t in cluster.credentials().tenants if t.name == tenant)
    out: dict[bytes, list[tuple[str, int, str]]] = {bytes(k): [] for k in keys}
    for node in cluster.nodes:
        with Probe(node.data, tenant=tenant, secret=secret, timeout_s=10) as probe:
            for k in keys:
                rows = probe.list(bytes(k), 0, inclusive=True, limit=255)
                for row in rows:
                    if bytes(row["key"]) != bytes(k):
                        break
                    name = bytes(row["traffic_class"]).rstrip(b"\0").decode("ascii")
                    out[bytes(k)].append((node.id, int(row["expiry_ms"]), name))
    return out
