"""Membership of a kvcache cluster in etcd (the static cluster file stays the embedded default).

* :mod:`.model` — records and decisions, pure: registrations, member records,
  the map and its epoch, what ``kvcache node`` does.
* :mod:`.etcd` — the etcd I/O (``aetcd``), thin.
* :mod:`.agent` — a daemon's registration under a lease.
* :mod:`.source` — where clients get the map and hear of changes (etcd or a file).
* :mod:`.localetcd` — an etcd process of our own (``kvcache up --etcd``, tests).
* :mod:`.cli` — ``kvcache node``.

``docs/membership.md`` describes the keys, the states and the guarantees.
"""

from __future__ import annotations

from kvcache.membership.model import (
    Action,
    MemberRecord,
    Membership,
    Registration,
    apply_action,
    build_map,
    join_record,
)

__all__ = [
    "Action",
    "MemberRecord",
    "Membership",
    "Registration",
    "apply_action",
    "build_map",
    "join_record",
]
