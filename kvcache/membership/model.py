"""Membership as data: what daemons register, what the map is made of, what a command changes.

Pure: no etcd, no clock reads. :mod:`kvcache.membership.etcd` stores these
records and reads them back; everything it decides is decided here.

Keys under a cluster's prefix (``docs/membership.md``)::

    {prefix}/epoch           the map's epoch, a decimal integer
    {prefix}/members/{id}    MemberRecord (JSON): a node of the map and its state; persistent
    {prefix}/live/{id}       Registration (JSON), under the daemon's lease: it is alive

The **map** (:class:`~kvcache.cluster.ClusterMap`) is the member records and
the epoch; every change of a member record bumps the epoch in the same etcd
transaction, so one epoch names one map on every client. **Liveness** is the
set of live registrations: a daemon that stops renewing its lease disappears
from it when the lease runs out, without a map change. A node that is down
keeps its place in the map (its shards come back with it); writers send its
shards to the next node in rendezvous order meanwhile (``kvcache.placement``).
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from kvcache.cluster import ClusterMap, NodeInfo, NodeState
from kvcache.errors import ConfigError

__all__ = [
    "Action",
    "MemberRecord",
    "Membership",
    "Registration",
    "apply_action",
    "build_map",
    "join_record",
    "parse_members",
    "parse_registrations",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Membership:
    """A cluster map and which of its nodes are live (what a map source delivers).

    ``live`` None means no liveness source (a static cluster file): every node
    counts as live, and the client's own health tracking decides the rest.
    """

    cluster: ClusterMap
    live: frozenset[str] | None = None


def _check_fields(raw: Any, required: set[str], optional: set[str], what: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} must be a JSON object")
    missing = required - set(raw)
    unknown = set(raw) - required - optional
    if missing or unknown:
        raise ConfigError(f"{what}: missing {sorted(missing)}, unknown {sorted(unknown)}")
    return raw


@dataclass(frozen=True, slots=True, kw_only=True)
class Registration:
    """What a live daemon publishes under its lease."""

    id: str
    data: str
    admin: str = ""
    domain: str = ""
    weight: float = 1.0
    capacity_bytes: int = 0
    started_ms: int = 0
    pid: int = 0

    def __post_init__(self) -> None:
        # The same checks as a map entry (id, addresses, weight).
        NodeInfo(id=self.id, data=self.data, admin=self.admin, weight=self.weight)
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes < 0:
            raise ConfigError(f"registration {self.id}: capacity_bytes must be an int >= 0")

    def to_json(self) -> bytes:
        """The value stored in etcd."""
        return json.dumps(
            {
                "id": self.id,
                "data": self.data,
                "admin": self.admin,
                "domain": self.domain or self.id,
                "weight": float(self.weight),
                "capacity_bytes": self.capacity_bytes,
                "started_ms": self.started_ms,
                "pid": self.pid,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Registration:
        """Parse a stored value; ConfigError if it is not a registration."""
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"registration is not JSON: {exc}") from None
        fields = _check_fields(
            doc,
            {"id", "data"},
            {"admin", "domain", "weight", "capacity_bytes", "started_ms", "pid"},
            "registration",
        )
        return cls(**fields)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemberRecord:
    """A node of the map: where it was last seen, its domain, weight and state."""

    id: str
    data: str
    admin: str = ""
    domain: str = ""
    weight: float = 1.0
    state: NodeState = NodeState.UP

    def __post_init__(self) -> None:
        self.node()  # validates

    def node(self) -> NodeInfo:
        """The map entry."""
        return NodeInfo(
            id=self.id,
            data=self.data,
            admin=self.admin,
            domain=self.domain,
            weight=self.weight,
            state=self.state,
        )

    def to_json(self) -> bytes:
        """The value stored in etcd."""
        return json.dumps(
            {
                "id": self.id,
                "data": self.data,
                "admin": self.admin,
                "domain": self.domain or self.id,
                "weight": float(self.weight),
                "state": self.state.value,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> MemberRecord:
        """Parse a stored value; ConfigError if it is not a member record."""
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"member record is not JSON: {exc}") from None
        fields = _check_fields(
            doc, {"id", "data"}, {"admin", "domain", "weight", "state"}, "member record"
        )
        try:
            state = NodeState(fields.pop("state", "up"))
        except ValueError:
            raise ConfigError(f"member {doc.get('id')!r}: unknown state") from None
        return cls(state=state, **fields)


class _Record(Protocol):
    @property
    def id(self) -> str: ...


R = TypeVar("R", bound=_Record)


def _parse_records(
    raw: Mapping[str, bytes], parse: Callable[[bytes], R], what: str
) -> dict[str, R]:
    """Records by id from stored values; malformed ones, and ones stored under another
    node's name, are logged and skipped."""
    out: dict[str, R] = {}
    for name, value in raw.items():
        try:
            record = parse(value)
        except ConfigError as exc:
            log.error("ignoring %s %s: %s", what, name, exc)
            continue
        if record.id != name:
            log.error("ignoring %s %s: it names node %s", what, name, record.id)
            continue
        out[name] = record
    return out


def parse_members(raw: Mapping[str, bytes]) -> dict[str, MemberRecord]:
    """Member records by id from stored values; malformed ones are logged and skipped."""
    return _parse_records(raw, MemberRecord.from_json, "member record")


def parse_registrations(raw: Mapping[str, bytes]) -> dict[str, Registration]:
    """Registrations by id from stored values; malformed ones are logged and skipped."""
    return _parse_records(raw, Registration.from_json, "registration")


def build_map(
    members: Mapping[str, MemberRecord], live: Mapping[str, Registration], epoch: int
) -> tuple[ClusterMap, frozenset[str]]:
    """The map (members, in id order) and the ids of live members.

    A registration counts as live only at the address its member record names:
    a daemon that moved is live again once its record is updated (which it does
    itself when it registers). ConfigError when there are no members.
    """
    if not members:
        raise ConfigError("no node has joined the cluster yet")
    nodes = tuple(members[i].node() for i in sorted(members))
    alive = frozenset(i for i, reg in live.items() if i in members and members[i].data == reg.data)
    return ClusterMap(epoch=epoch, nodes=nodes), alive


def join_record(existing: MemberRecord | None, reg: Registration) -> MemberRecord | None:
    """The member record a registering daemon writes, or None when the current one stands.

    A new node joins as ``up``. A known node keeps the state an operator gave it,
    and its record follows the daemon's address, domain and weight.
    """
    wanted = MemberRecord(
        id=reg.id,
        data=reg.data,
        admin=reg.admin,
        domain=reg.domain or reg.id,
        weight=reg.weight,
        state=existing.state if existing is not None else NodeState.UP,
    )
    if existing is not None and replace(existing, domain=existing.domain or existing.id) == wanted:
        return None
    return wanted


class Action(enum.Enum):
    """What ``kvcache node`` does to a node."""

    DRAIN = "drain"
    OUT = "out"
    IN = "in"
    REMOVE = "remove"


def apply_action(
    members: Mapping[str, MemberRecord], node_id: str, action: Action, *, force: bool = False
) -> MemberRecord | None:
    """The node's new record (None: remove it). ConfigError naming what is wrong when the
    node is unknown, or when removing a node that is not ``out`` without ``force``."""
    record = members.get(node_id)
    if record is None:
        known = ", ".join(sorted(members)) or "none"
        raise ConfigError(f"no node {node_id!r} in the cluster map (nodes: {known})")
    if action is Action.REMOVE:
        if record.state is not NodeState.OUT and not force:
            raise ConfigError(
                f"node {node_id} is {record.state.value}: take it out first "
                f"(`kvcache node out {node_id}`, then let repair run), or pass --force"
            )
        return None
    state = {
        Action.DRAIN: NodeState.DRAIN,
        Action.OUT: NodeState.OUT,
        Action.IN: NodeState.UP,
    }[action]
    return replace(record, state=state)
