"""Damage one stored block beyond repair, through the wire, the way a faulty node would.

Runs in the project's venv (not vLLM's). For the block with ``key``, three
shards (more than the two parity shards can make up for) are replaced by
records with the same key, stripe and index whose bodies have flipped bits and
whose shard checksums were recomputed to match: each looks healthy on its own,
a HAS still counts twelve shards, and only the payload hash over the rebuilt
block shows that it is wrong. A prefix match therefore still reports the block
and the engine plans to load it; the load must then refuse it.
"""

from __future__ import annotations

import dataclasses

from kvcache.keys import BlockKey
from kvcache.server.probe import Probe
from kvcache.shard import HEADER_BYTES, ShardHeader, shard_hash
from kvcache.testing.localcluster import LocalCluster
from kvcache.wire import Status

__all__ = ["damage_block"]


def damage_block(
    cluster: LocalCluster,
    key: BlockKey,
    *,
    shards: int = 3,
    tenant: str = "default",
    first_node: int = 0,
) -> list[int]:
    """Corrupt ``shards`` shards of ``key``'s stripe in place, looking at the cluster's
    nodes from ``first_node`` on (and round); returns the shard indices hit. (A prompt's
    blocks share their holders: a different ``first_node`` per block spreads the damage
    over them.)"""
    damaged: list[int] = []
    entry = cluster.credentials().tenant(tenant)
    if entry is None:
        raise RuntimeError(f"no tenant {tenant!r} in the cluster's credentials")
    start = first_node % len(cluster.nodes)
    for node in [*cluster.nodes[start:], *cluster.nodes[:start]]:
        if len(damaged) == shards:
            break
        with Probe(node.data, tenant=tenant, secret=entry.secret) as probe:
            held = probe.has([key])[key]
            for index, _stripe in sorted(held.items()):
                if len(damaged) == shards:
                    break
                status, records = probe.get([(key, index)])
                record = records[0]
                if status[0] != Status.OK or record is None:
                    raise RuntimeError(
                        f"{node.id} listed shard {index} of {key.hex()} but GET failed"
                    )
                body = bytearray(record[HEADER_BYTES:])
                for i in range(0, len(body), 97):
                    body[i] ^= 0x5A
                header = dataclasses.replace(
                    ShardHeader.unpack(record), shard_hash=shard_hash(bytes(body))
                )
                # The same stripe id: the daemon takes it as a rewrite of the same shard.
                if probe.put([(key, index, header.pack() + bytes(body))])[0] != Status.OK:
                    raise RuntimeError(f"{node.id} refused the damaged shard {index}")
                damaged.append(index)
    if len(damaged) < shards:
        raise RuntimeError(f"found only {len(damaged)} shards of {key.hex()} to damage")
    return damaged
