"""``kvcache node``: list a cluster's nodes, or drain, take out, bring in or remove one.

The cluster file decides where the change is made: with an ``[etcd]`` table,
in etcd (one transaction that also bumps the map's epoch; clients watching
see it within their watch latency); without one, in the file itself, rewritten
atomically with the epoch bumped (clients re-read it when it changes).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvcache.cluster import ClusterMap, EtcdSettings, NodeInfo, read_cluster_file
from kvcache.errors import ConfigError
from kvcache.membership.model import Action, MemberRecord, apply_action

__all__ = ["change_node", "list_nodes", "register"]

DEFAULT_CLUSTER_FILE = Path("kvcache-local/cluster.toml")


def register(sub: Any) -> None:
    """Add ``kvcache node`` to the ``kvcache`` parser."""
    node = sub.add_parser(
        "node",
        help="list the cluster's nodes, or drain / take out / bring in / remove one",
        description="Changes a node's state in the cluster map: in etcd when the cluster file "
        "has an [etcd] table, else in the file. drain: no new shards, still read, repair copies "
        "its shards away; out: no new shards, not read, repair rebuilds its shards elsewhere; "
        "in: back to up; remove: forget a node that is out.",
    )
    node.add_argument(
        "action",
        choices=["list", *(a.value for a in Action)],
        help="what to do",
    )
    node.add_argument("node_id", nargs="?", help="the node (all but list)")
    node.add_argument(
        "--cluster-file",
        type=Path,
        default=DEFAULT_CLUSTER_FILE,
        help=f"cluster file (default {DEFAULT_CLUSTER_FILE})",
    )
    node.add_argument("--force", action="store_true", help="remove a node that is not out")
    node.add_argument("--json", action="store_true", help="list as JSON")
    node.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.action == "list":
        rows = list_nodes(args.cluster_file)
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            print(f"{'node':<16} {'state':<6} {'live':<5} {'domain':<12} {'weight':>6}  data")
            for r in rows:
                live = {True: "yes", False: "no", None: "-"}[r["live"]]
                print(
                    f"{r['id']:<16} {r['state']:<6} {live:<5} {r['domain']:<12} "
                    f"{r['weight']:>6g}  {r['data']}"
                )
        return 0
    if not args.node_id:
        raise ConfigError(f"`kvcache node {args.action}` needs a node id")
    epoch = change_node(args.cluster_file, args.node_id, Action(args.action), force=args.force)
    print(f"node {args.node_id}: {args.action} (map epoch {epoch})", file=sys.stderr)
    return 0


def list_nodes(cluster_file: Path) -> list[dict[str, Any]]:
    """The map's nodes as rows (``live`` None where no liveness is known: a static file)."""
    static, etcd = read_cluster_file(cluster_file)
    live: frozenset[str] | None = None
    if etcd is not None:
        from kvcache.membership.etcd import fetch_map

        snap = fetch_map(etcd)
        cluster, live = snap.cluster, snap.live_ids
    else:
        assert static is not None  # read_cluster_file returns one at least
        cluster = static
    return [
        {
            "id": n.id,
            "state": n.state.value,
            "live": None if live is None else n.id in live,
            "domain": n.domain,
            "weight": n.weight,
            "data": n.data,
            "admin": n.admin,
            "epoch": cluster.epoch,
        }
        for n in cluster.nodes
    ]


def change_node(cluster_file: Path, node_id: str, action: Action, *, force: bool = False) -> int:
    """Apply ``action`` to ``node_id``; the map's epoch after it."""
    static, etcd = read_cluster_file(cluster_file)
    if etcd is not None:
        return _change_in_etcd(etcd, node_id, action, force=force)
    # Concurrent changes of one file are serialised (each read the map, and the last
    # replace won: changes reported done were lost, and epochs reused).
    with _file_lock(cluster_file):
        static, _ = read_cluster_file(cluster_file)
        assert static is not None
        return _change_in_file(cluster_file, static, node_id, action, force=force)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock for changes of the map in ``path`` (on ``<path>.lock`` beside it:
    the map itself is replaced, not rewritten, so its own inode cannot carry the lock)."""
    lock = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(f"cannot lock {path} for a change ({lock}: {exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _change_in_etcd(etcd: EtcdSettings, node_id: str, action: Action, *, force: bool) -> int:
    from kvcache.membership.etcd import EtcdStore, run_sync

    async def change() -> int:
        store = EtcdStore(etcd)
        try:
            _changed, epoch = await store.change_member(
                node_id, lambda members: _decide(members, node_id, action, force)
            )
            return epoch
        finally:
            await store.close()

    return run_sync(change, timeout_s=etcd.timeout_s * 4 + 5)


def _decide(members: Any, node_id: str, action: Action, force: bool) -> MemberRecord | bool | None:
    new = apply_action(members, node_id, action, force=force)
    return False if new == members[node_id] else new


def _change_in_file(
    path: Path, cluster: ClusterMap, node_id: str, action: Action, *, force: bool
) -> int:
    members = {
        n.id: MemberRecord(
            id=n.id, data=n.data, admin=n.admin, domain=n.domain, weight=n.weight, state=n.state
        )
        for n in cluster.nodes
    }
    new = apply_action(members, node_id, action, force=force)
    if new == members[node_id]:
        return cluster.epoch
    nodes: list[NodeInfo] = []
    for n in cluster.nodes:
        if n.id != node_id:
            nodes.append(n)
        elif new is not None:
            nodes.append(new.node())
    if not nodes:
        raise ConfigError(f"removing {node_id} would leave the cluster map empty")
    updated = ClusterMap(epoch=cluster.epoch + 1, nodes=tuple(nodes))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(updated.to_toml())
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return updated.epoch
