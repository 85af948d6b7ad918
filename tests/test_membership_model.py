"""Membership records and decisions (pure), and ``kvcache node`` on a static cluster file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache.cli import main as kvcache_main
from kvcache.cluster import ClusterMap, EtcdSettings, NodeInfo, NodeState, read_cluster_file
from kvcache.errors import ConfigError
from kvcache.membership.cli import change_node
from kvcache.membership.model import (
    Action,
    MemberRecord,
    Registration,
    apply_action,
    build_map,
    join_record,
    parse_members,
    parse_registrations,
)

ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,20}", fullmatch=True)
ports = st.integers(1, 65535)


@st.composite
def registrations(draw: st.DrawFn) -> Registration:
    return Registration(
        id=draw(ids),
        data=f"tcp://127.0.0.1:{draw(ports)}",
        admin=f"http://127.0.0.1:{draw(ports)}",
        domain=draw(st.one_of(st.just(""), ids)),
        weight=draw(st.floats(0.01, 100, allow_nan=False)),
        capacity_bytes=draw(st.integers(0, 1 << 50)),
        started_ms=draw(st.integers(0, 1 << 45)),
        pid=draw(st.integers(0, 1 << 22)),
    )


@given(registrations())
def test_registration_round_trips(reg: Registration) -> None:
    back = Registration.from_json(reg.to_json())
    assert back.id == reg.id and back.data == reg.data and back.weight == reg.weight
    assert back.domain == (reg.domain or reg.id)


@given(registrations(), st.sampled_from(list(NodeState)))
def test_member_record_round_trips(reg: Registration, state: NodeState) -> None:
    record = MemberRecord(id=reg.id, data=reg.data, domain=reg.domain or reg.id, state=state)
    assert MemberRecord.from_json(record.to_json()) == record


@given(st.binary(max_size=64))
def test_garbage_values_are_refused_by_name(raw: bytes) -> None:
    # Unparseable values never crash a watcher: they are reported and left out.
    members = parse_members({"x": raw})
    assert set(members) <= {"x"} and all(m.id == "x" for m in members.values())
    regs = parse_registrations({"x": raw})
    assert set(regs) <= {"x"} and all(r.id == "x" for r in regs.values())
    with pytest.raises(ConfigError):
        MemberRecord.from_json(raw + b"\xff")


def test_join_keeps_an_operators_state_and_follows_the_address() -> None:
    reg = Registration(id="n1", data="tcp://10.0.0.1:7400", domain="host-a")
    new = join_record(None, reg)
    assert new is not None and new.state is NodeState.UP and new.domain == "host-a"
    drained = MemberRecord(
        id="n1", data="tcp://10.0.0.1:7400", domain="host-a", state=NodeState.DRAIN
    )
    assert join_record(drained, reg) is None  # nothing to change
    moved = join_record(drained, Registration(id="n1", data="tcp://10.0.0.2:7400", domain="host-a"))
    assert moved is not None and moved.state is NodeState.DRAIN and moved.data.endswith("2:7400")


def test_liveness_counts_only_at_the_recorded_address() -> None:
    members = {
        "a": MemberRecord(id="a", data="tcp://10.0.0.1:1"),
        "b": MemberRecord(id="b", data="tcp://10.0.0.2:1"),
    }
    live = {
        "a": Registration(id="a", data="tcp://10.0.0.1:1"),
        "b": Registration(id="b", data="tcp://10.0.0.9:1"),  # moved, record not updated yet
        "c": Registration(id="c", data="tcp://10.0.0.3:1"),  # not a member
    }
    cluster, alive = build_map(members, live, 7)
    assert cluster.epoch == 7 and [n.id for n in cluster.nodes] == ["a", "b"]
    assert alive == frozenset({"a"})
    with pytest.raises(ConfigError, match="no node has joined"):
        build_map({}, live, 1)


def test_actions() -> None:
    members = {"a": MemberRecord(id="a", data="tcp://10.0.0.1:1")}
    assert apply_action(members, "a", Action.DRAIN) == MemberRecord(
        id="a", data="tcp://10.0.0.1:1", state=NodeState.DRAIN
    )
    with pytest.raises(ConfigError, match="take it out first"):
        apply_action(members, "a", Action.REMOVE)
    assert apply_action(members, "a", Action.REMOVE, force=True) is None
    with pytest.raises(ConfigError, match="no node 'z'"):
        apply_action(members, "z", Action.OUT)


def static_file(tmp_path: Path) -> Path:
    nodes = tuple(NodeInfo(id=f"n{i}", data=f"tcp://127.0.0.1:{7400 + i}") for i in range(3))
    path = tmp_path / "cluster.toml"
    path.write_text(ClusterMap(epoch=4, nodes=nodes).to_toml())
    return path


def test_node_command_edits_a_static_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = static_file(tmp_path)
    assert kvcache_main(["node", "out", "n1", "--cluster-file", str(path)]) == 0
    cluster = ClusterMap.load(path)
    assert cluster.epoch == 5
    assert {n.id: n.state for n in cluster.nodes}["n1"] is NodeState.OUT
    assert change_node(path, "n1", Action.OUT) == 5  # no change, no new epoch
    assert kvcache_main(["node", "remove", "n1", "--cluster-file", str(path)]) == 0
    assert [n.id for n in ClusterMap.load(path).nodes] == ["n0", "n2"]
    assert kvcache_main(["node", "drain", "n9", "--cluster-file", str(path)]) != 0
    assert "no node 'n9'" in capsys.readouterr().err
    assert kvcache_main(["node", "list", "--cluster-file", str(path), "--json"]) == 0
    assert '"n2"' in capsys.readouterr().out


def _drain_at_once(path: str, node: str, barrier: Any, results: Any) -> None:
    barrier.wait()
    try:
        results.put((node, change_node(Path(path), node, Action.DRAIN)))
    except Exception as exc:
        results.put((node, repr(exc)))


def test_concurrent_changes_of_one_file_are_each_kept(tmp_path: Path) -> None:
    """Six processes draining six nodes of one file at the same moment: each read the map
    and the last replace won (changes reported done were lost, epochs reused), and writers
    sharing one temporary file name died with FileNotFoundError."""
    import multiprocessing

    nodes = tuple(NodeInfo(id=f"n{i}", data=f"tcp://127.0.0.1:{7400 + i}") for i in range(6))
    path = tmp_path / "cluster.toml"
    path.write_text(ClusterMap(epoch=1, nodes=nodes).to_toml())
    path.chmod(0o640)
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(6), context.Queue()
    workers = [
        context.Process(target=_drain_at_once, args=(str(path), n.id, barrier, results))
        for n in nodes
    ]
    for worker in workers:
        worker.start()
    answers = dict(results.get(timeout=60) for _ in workers)
    for worker in workers:
        worker.join(60)
    assert sorted(answers.values()) == [2, 3, 4, 5, 6, 7]  # one epoch each, none reused
    cluster = ClusterMap.load(path)
    assert cluster.epoch == 7
    assert all(n.state is NodeState.DRAIN for n in cluster.nodes)
    assert path.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cluster.toml", "cluster.toml.lock"]


def test_cluster_file_with_etcd_table(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    etcd = EtcdSettings(endpoints=("http://127.0.0.1:2379",), prefix="/kvcache/x")
    nodes = (NodeInfo(id="n0", data="tcp://127.0.0.1:7400"),)
    path.write_text(ClusterMap(epoch=1, nodes=nodes).to_toml(etcd))
    static, back = read_cluster_file(path)
    assert back == etcd and static is not None and static.nodes == nodes
    path.write_text('[etcd]\nendpoints = ["ftp://x"]\n')
    with pytest.raises(ConfigError, match="must look like http://host:port"):
        read_cluster_file(path)
