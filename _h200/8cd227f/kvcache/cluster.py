"""The cluster map: which storage nodes exist, where they listen, and their failure domains.

The map is a static TOML file in the embedded setup (written by ``kvcache up``)::

    epoch = 1
    [[nodes]]
    id = "node-00"
    data = "tcp://127.0.0.1:7100"
    admin = "http://127.0.0.1:7200"
    domain = "rack-a"      # optional, defaults to the node id
    weight = 1.0           # optional
    state = "up"           # "up" or "out" (out: no new placements)

Placement (``kvcache.placement``) is a pure function of (map, key).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.config import load_toml
from kvcache.errors import ConfigError

__all__ = ["ClusterMap", "NodeInfo", "NodeState"]

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")


class NodeState(enum.Enum):
    """Whether a node takes new placements."""

    UP = "up"
    OUT = "out"


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeInfo:
    """One storage node as the map describes it."""

    id: str
    data: str
    admin: str = ""
    domain: str = ""
    weight: float = 1.0
    state: NodeState = NodeState.UP

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not _ID_RE.match(self.id):
            raise ConfigError(f"node id {self.id!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        if not isinstance(self.data, str) or not self.data.startswith(("tcp://", "ipc://")):
            raise ConfigError(
                f"node {self.id}: data address {self.data!r} must be tcp:// or ipc://"
            )
        if self.admin and not self.admin.startswith(("http://", "https://")):
            raise ConfigError(f"node {self.id}: admin address {self.admin!r} must be http(s)://")
        if not isinstance(self.weight, int | float) or not 0 < float(self.weight) < 1e6:
            raise ConfigError(f"node {self.id}: weight must be a positive number")
        if not self.domain:
            object.__setattr__(self, "domain", self.id)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> NodeInfo:
        """Build from a TOML table, naming the bad field on error."""
        known = {"id", "data", "admin", "domain", "weight", "state"}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(f"node entry has unknown fields {sorted(unknown)}")
        if "id" not in raw or "data" not in raw:
            raise ConfigError(f"node entry {dict(raw)!r} needs at least id and data")
        try:
            state = NodeState(raw.get("state", "up"))
        except ValueError:
            raise ConfigError(f"node {raw['id']}: state must be 'up' or 'out'") from None
        return cls(
            id=raw["id"],
            data=raw["data"],
            admin=raw.get("admin", ""),
            domain=raw.get("domain", ""),
            weight=float(raw.get("weight", 1.0)),
            state=state,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterMap:
    """The nodes of a cluster and the map's epoch (bumped on every change)."""

    epoch: int
    nodes: tuple[NodeInfo, ...]

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ConfigError("cluster map has no nodes")
        ids = [n.id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"cluster map has duplicate node ids: {sorted(ids)}")
        if not isinstance(self.epoch, int) or self.epoch < 0:
            raise ConfigError(f"cluster epoch must be a non-negative int, got {self.epoch!r}")

    @property
    def placeable(self) -> tuple[NodeInfo, ...]:
        """Nodes that take placements (state up)."""
        return tuple(n for n in self.nodes if n.state is NodeState.UP)

    def node(self, node_id: str) -> NodeInfo:
        """The node with this id."""
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise ConfigError(f"no node {node_id!r} in the cluster map")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> ClusterMap:
        """Build from a parsed TOML document."""
        nodes = raw.get("nodes")
        if not isinstance(nodes, list):
            raise ConfigError("cluster map needs a [[nodes]] array")
        return cls(
            epoch=int(raw.get("epoch", 0)),
            nodes=tuple(NodeInfo.from_mapping(n) for n in nodes),
        )

    @classmethod
    def load(cls, path: str | Path) -> ClusterMap:
        """Read a cluster file."""
        try:
            return cls.from_mapping(load_toml(path))
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    def to_toml(self) -> str:
        """The map as TOML text (what ``load`` reads back)."""
        lines = [f"epoch = {self.epoch}", ""]
        for n in self.nodes:
            lines += [
                "[[nodes]]",
                f'id = "{n.id}"',
                f'data = "{n.data}"',
                f'admin = "{n.admin}"',
                f'domain = "{n.domain}"',
                f"weight = {float(n.weight)!r}",
                f'state = "{n.state.value}"',
                "",
            ]
        return "\n".join(lines)


def node_ids(nodes: Sequence[NodeInfo]) -> list[str]:
    """Ids of ``nodes`` in order."""
    return [n.id for n in nodes]
