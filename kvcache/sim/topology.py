"""Synthetic cluster maps and sampled block keys for the simulator. Pure, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvcache.cluster import ClusterMap, NodeInfo, NodeState
from kvcache.errors import ArgumentError
from kvcache.keys import KEY_BYTES, BlockKey

__all__ = ["Layout", "node_id", "sample_keys", "synthetic_map"]

#: Data address every synthetic node carries (never dialled: the simulator does no I/O).
_ADDRESS = "tcp://127.0.0.1:1"


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """A cluster's shape: ``nodes`` storage nodes, ``domain_size`` of them per failure
    domain (0: every node its own domain, the map's default)."""

    nodes: int
    domain_size: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise ArgumentError(f"a layout needs >= 1 node, got {self.nodes!r}")
        if not isinstance(self.domain_size, int) or self.domain_size < 0:
            raise ArgumentError(f"domain_size must be >= 0, got {self.domain_size!r}")

    @property
    def domains(self) -> int:
        """How many failure domains the layout has."""
        if self.domain_size == 0:
            return self.nodes
        return -(-self.nodes // self.domain_size)

    def domain(self, i: int) -> str:
        """The failure domain of node ``i`` ("" for its own)."""
        return f"rack-{i // self.domain_size:05d}" if self.domain_size else ""


def node_id(i: int) -> str:
    """The id of synthetic node ``i``."""
    return f"node-{i:05d}"


def synthetic_map(
    layout: Layout,
    *,
    extra: int = 0,
    first_extra: int = 0,
    out: frozenset[int] = frozenset(),
    epoch: int = 1,
) -> ClusterMap:
    """The map of ``layout``, plus ``extra`` joined nodes (after the others in the map,
    named from ``node_id(nodes + first_extra)`` on, each in an existing domain: a host
    added to a rack), with the nodes in ``out`` in state out."""
    if extra < 0 or first_extra < 0:
        raise ArgumentError(f"extra and first_extra must be >= 0, got {extra}, {first_extra}")
    nodes = []
    for i in range(layout.nodes + extra):
        number = i if i < layout.nodes else i + first_extra
        domain = layout.domain(number % layout.nodes)
        nodes.append(
            NodeInfo(
                id=node_id(number),
                data=_ADDRESS,
                domain=domain,
                state=NodeState.OUT if i in out else NodeState.UP,
            )
        )
    return ClusterMap(epoch=epoch, nodes=tuple(nodes))


def sample_keys(count: int, rng: np.random.Generator) -> list[BlockKey]:
    """``count`` random block keys (block keys are uniform hashes, so random bytes are
    a faithful sample). Only a key's placement tag places it, so each stands for a
    placement group of a prompt's blocks (``docs/spec/hashing.md``)."""
    if count < 0:
        raise ArgumentError(f"key count must be >= 0, got {count}")
    raw = rng.integers(0, 256, size=(count, KEY_BYTES), dtype=np.uint8).tobytes()
    return [BlockKey(raw[i * KEY_BYTES : (i + 1) * KEY_BYTES]) for i in range(count)]
