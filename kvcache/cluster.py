"""The cluster map: which storage nodes exist, where they listen, and their failure domains.

The map is a static TOML file in the embedded setup (written by ``kvcache up``)::

    epoch = 1
    [[nodes]]
    id = "node-00"
    data = "tcp://127.0.0.1:7100"
    admin = "http://127.0.0.1:7200"
    domain = "rack-a"      # optional, defaults to the node id
    weight = 1.0           # optional
    state = "up"           # "up", "drain" or "out" (see NodeState)

At scale the map lives in etcd (``kvcache.membership``): the cluster file then
names the etcd cluster instead of (or as well as) listing nodes::

    [etcd]
    endpoints = ["http://10.0.0.5:2379"]
    prefix = "/kvcache/prod"   # optional

:meth:`ClusterMap.load` reads such a file's map from etcd, so every tool that
takes a cluster file works with either; clients watch etcd instead
(:mod:`kvcache.membership.source`). Nodes listed next to ``[etcd]`` are a
fallback for when etcd cannot be reached.

Placement (``kvcache.placement``) is a pure function of (map, key).
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.config import load_toml
from kvcache.errors import ClusterError, ConfigError, KVCacheError

__all__ = ["ClusterMap", "EtcdSettings", "NodeInfo", "NodeState", "read_cluster_file"]

log = logging.getLogger(__name__)

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
_ETCD_URL_RE = re.compile(r"https?://(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})/?\Z")
_PREFIX_RE = re.compile(r"/[A-Za-z0-9_.\-/]{0,200}\Z")


class NodeState(enum.Enum):
    """What a node is used for (``kvcache node drain|out|in``).

    * ``up``: it holds new shards and is read.
    * ``drain``: no new shards; it is still read, and the repairer copies its
      shards to their current holders so it can be taken out without losing
      redundancy.
    * ``out``: no new shards and not read; the repairer rebuilds its shards
      elsewhere from the other shards of each stripe.
    """

    UP = "up"
    DRAIN = "drain"
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
        if not isinstance(self.admin, str) or (
            self.admin and not self.admin.startswith(("http://", "https://"))
        ):
            raise ConfigError(f"node {self.id}: admin address {self.admin!r} must be http(s)://")
        if not isinstance(self.weight, int | float) or not 0 < float(self.weight) < 1e6:
            raise ConfigError(f"node {self.id}: weight must be a positive number")
        if not isinstance(self.domain, str):
            raise ConfigError(f"node {self.id}: domain must be a string, got {self.domain!r}")
        if not self.domain:
            object.__setattr__(self, "domain", self.id)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> NodeInfo:
        """Build from a TOML table, naming the bad field on error."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"a node entry must be a table, got {raw!r}")
        known = {"id", "data", "admin", "domain", "weight", "state"}
        unknown = set(raw) - known
        if unknown:
            raise ConfigError(f"node entry has unknown fields {sorted(unknown)}")
        if "id" not in raw or "data" not in raw:
            raise ConfigError(f"node entry {dict(raw)!r} needs at least id and data")
        try:
            state = NodeState(raw.get("state", "up"))
        except ValueError:
            raise ConfigError(
                f"node {raw['id']}: state must be one of {[s.value for s in NodeState]}"
            ) from None
        weight = raw.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ConfigError(f"node {raw['id']}: weight must be a number, got {weight!r}")
        return cls(
            id=raw["id"],
            data=raw["data"],
            admin=raw.get("admin", ""),
            domain=raw.get("domain", ""),
            weight=float(weight),
            state=state,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class EtcdSettings:
    """Where a cluster's membership lives in etcd (the ``[etcd]`` table of a cluster file)."""

    #: Client URLs of the etcd cluster (``http://host:port``).
    endpoints: tuple[str, ...]
    #: Key prefix of this kvcache cluster (several clusters can share one etcd).
    prefix: str = "/kvcache/default"
    #: Seconds one etcd call may take before it counts as failed.
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("[etcd] needs at least one endpoint")
        for url in self.endpoints:
            found = _ETCD_URL_RE.match(url) if isinstance(url, str) else None
            if found is None or not 0 < int(found.group(2)) < 65536:
                raise ConfigError(f"etcd endpoint {url!r} must look like http://host:port")
        if not isinstance(self.prefix, str) or not _PREFIX_RE.match(self.prefix):
            raise ConfigError(
                f"etcd prefix {self.prefix!r} must start with / and use A-Z a-z 0-9 _ . - /"
            )
        if not isinstance(self.timeout_s, int | float) or not 0 < self.timeout_s < 86_400:
            raise ConfigError(
                f"etcd timeout_s must be > 0 s and under a day, got {self.timeout_s!r}"
            )

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> EtcdSettings:
        """Build from the ``[etcd]`` table, naming the bad field on error."""
        if not isinstance(raw, Mapping):
            raise ConfigError("[etcd] must be a table")
        unknown = set(raw) - {"endpoints", "prefix", "timeout_s"}
        if unknown:
            raise ConfigError(f"[etcd] has unknown fields {sorted(unknown)}")
        endpoints = raw.get("endpoints", ())
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e]
        if not isinstance(endpoints, list | tuple):
            raise ConfigError("[etcd] endpoints must be a list of http://host:port")
        return cls(
            endpoints=tuple(endpoints),
            prefix=raw.get("prefix", "/kvcache/default"),
            timeout_s=raw.get("timeout_s", 5.0),
        )

    def host_ports(self) -> list[tuple[str, int]]:
        """(host, port) of every endpoint."""
        out = []
        for url in self.endpoints:
            match = _ETCD_URL_RE.match(url)
            assert match is not None  # checked in __post_init__
            out.append((match.group(1).strip("[]"), int(match.group(2))))
        return out

    def to_toml(self) -> str:
        """The ``[etcd]`` table."""
        urls = ", ".join(f'"{u}"' for u in self.endpoints)
        return f'[etcd]\nendpoints = [{urls}]\nprefix = "{self.prefix}"\n'


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
        epoch = raw.get("epoch", 0)
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise ConfigError(f"cluster map: epoch must be an integer, got {epoch!r}")
        return cls(epoch=epoch, nodes=tuple(NodeInfo.from_mapping(n) for n in nodes))

    @classmethod
    def load(cls, path: str | Path) -> ClusterMap:
        """Read a cluster file; a file naming ``[etcd]`` is read from etcd (its nodes, if
        it lists any, are the fallback when etcd cannot be reached)."""
        static, etcd = read_cluster_file(path)
        if etcd is None:
            assert static is not None  # read_cluster_file returns one of them at least
            return static
        from kvcache.membership.etcd import fetch_map  # etcd I/O only when a file names it

        try:
            return fetch_map(etcd).cluster
        except KVCacheError as exc:
            if static is None:
                raise ClusterError(
                    f"{path}: cannot read the cluster map from etcd {list(etcd.endpoints)}: {exc}"
                ) from None
            log.warning("%s: etcd unreachable (%s); using the nodes listed in the file", path, exc)
            return static

    def to_toml(self, etcd: EtcdSettings | None = None) -> str:
        """The map as TOML text (what ``load`` reads back), with an ``[etcd]`` table if given."""
        lines = [f"epoch = {self.epoch}", ""]
        if etcd is not None:
            lines += [etcd.to_toml()]
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


def read_cluster_file(path: str | Path) -> tuple[ClusterMap | None, EtcdSettings | None]:
    """A cluster file's static map (None if it lists no nodes) and its ``[etcd]`` table
    (None if it has none); at least one of them, or ConfigError naming the file."""
    try:
        raw = load_toml(path)
        unknown = set(raw) - {"epoch", "nodes", "etcd"}
        if unknown:
            raise ConfigError(f"unknown top-level keys {sorted(unknown)}")
        etcd = EtcdSettings.from_mapping(raw["etcd"]) if "etcd" in raw else None
        static = ClusterMap.from_mapping(raw) if raw.get("nodes") or etcd is None else None
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return static, etcd


def node_ids(nodes: Sequence[NodeInfo]) -> list[str]:
    """Ids of ``nodes`` in order."""
    return [n.id for n in nodes]
