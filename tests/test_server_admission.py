"""Admission: no tenant or stray peer can stall a daemon (issue 18).

Pure rules (:class:`kvcache.server.admission.Admission`) with time passed in, then
the hostile cases against a real ``kvcache server`` process: half-sent 256 MiB PUTs
from one tenant while another reads, and a flood of connections that never
authenticate while a real client connects.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from server_fixtures import DaemonProcess, block_records, http

from kvcache.server.admission import Admission, AdmissionLimits
from kvcache.wire import Header, Op, make_items

MiB = 1 << 20


# ------------------------------------------------------------------ pure rules


def test_bytes_count_as_received_and_per_tenant() -> None:
    adm: Admission[int] = Admission(
        AdmissionLimits(max_inflight_bytes=100 * MiB, tenant_inflight_bytes=10 * MiB)
    )
    assert adm.may_start("a")
    adm.moved("a", 9 * MiB)
    assert adm.may_start("a")  # under its share
    adm.moved("a", 2 * MiB)
    assert not adm.may_start("a")  # over its share: its next request waits
    assert adm.may_start("b")  # another tenant is not held up
    adm.moved("a", -11 * MiB)
    assert adm.may_start("a") and adm.inflight == 0


def test_a_tenant_holding_nothing_may_always_start_one_request() -> None:
    adm: Admission[int] = Admission(
        AdmissionLimits(max_inflight_bytes=10 * MiB, tenant_inflight_bytes=10 * MiB)
    )
    adm.moved("a", 10 * MiB)
    assert not adm.may_start("a")
    assert adm.may_start("b")
    adm.moved("b", 1)
    assert not adm.may_start("b")  # over the total now, and holding some


def test_slow_and_overlong_requests_are_overdue() -> None:
    adm: Admission[int] = Admission(
        AdmissionLimits(request_timeout_s=60, request_grace_s=5, min_request_rate=MiB)
    )
    assert adm.request_overdue(0.0, 1000, 4.0) is None  # inside the grace
    assert adm.request_overdue(0.0, 1000, 6.0) == "slow_request"
    assert adm.request_overdue(0.0, 100 * MiB, 6.0) is None
    assert adm.request_overdue(0.0, 10_000 * MiB, 61.0) == "request_timeout"


def test_preauth_pool_evicts_the_oldest_and_bounds_each_peer() -> None:
    adm: Admission[int] = Admission(AdmissionLimits(max_preauth=3, max_preauth_per_peer=2))
    assert adm.preauth_open(1, "10.0.0.1", 0.0) == []
    assert adm.preauth_open(2, "10.0.0.1", 0.1) == []
    # The peer's third waiting connection displaces its own oldest.
    assert adm.preauth_open(3, "10.0.0.1", 0.2) == [1]
    assert adm.preauth_open(4, "10.0.0.2", 0.3) == []
    # The pool is full: the oldest of all makes room.
    assert adm.preauth_open(5, "10.0.0.3", 0.4) == [2]
    adm.preauth_close(3)
    assert adm.preauth == 2
    assert adm.handshakes_overdue(100.0) == [4, 5]


def test_tenant_connection_bound() -> None:
    adm: Admission[int] = Admission(AdmissionLimits(max_connections=10, tenant_connections=2))
    adm.tenant_connected("a")
    adm.tenant_connected("a")
    assert adm.tenant_may_connect("a", 2) == "tenant_connection_limit"
    assert adm.tenant_may_connect("b", 2) is None
    assert adm.tenant_may_connect("b", 10) == "too_many_connections"
    adm.tenant_disconnected("a")
    assert adm.tenant_may_connect("a", 1) is None


# ------------------------------------------------------------------ a real daemon


def _errors(daemon: DaemonProcess) -> dict[str, float]:
    status, body = http("GET", daemon.admin + "/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith("kvcache_server_errors_total{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            out[kind] = float(line.rsplit(" ", 1)[1])
    return out


def test_half_sent_huge_puts_of_one_tenant_stall_no_one(tmp_path: Path) -> None:
    server = {"request_grace_s": 1.0, "min_request_rate": 1 << 20}
    with DaemonProcess(tmp_path, server=server) as daemon:
        key = bytes(range(16))
        records = block_records(key, body_len=4096)
        with daemon.probe("alice") as victim:
            assert (victim.put(records) == 0).all()
            attackers = [daemon.probe("default") for _ in range(5)]
            for probe in attackers:
                put = make_items(Op.PUT, 1, reply=False)
                put["key"] = key
                put["length"] = 256 * MiB
                header = Header(op=Op.PUT, request_id=1, count=1, data_len=256 * MiB)
                probe.send_raw(header.pack() + put.tobytes() + b"\0" * 1000)
            # The other tenant is answered at once, and every time.
            started = time.monotonic()
            for _ in range(6):
                statuses, _records = victim.get([(key, i) for i in range(12)])
                assert (statuses == 0).all()
            assert time.monotonic() - started < 5.0
            # The half-sent requests are cut off once they fall under the minimum rate.
            for probe in attackers:
                assert probe.recv_message(timeout_s=30) is None  # closed by the daemon
                probe.close()
            assert _errors(daemon).get("slow_request", 0) >= 5


def test_a_flood_of_unauthenticated_connections_does_not_lock_out_clients(
    tmp_path: Path,
) -> None:
    server = {"max_preauth": 64, "max_preauth_per_peer": 64}
    with DaemonProcess(tmp_path, server=server) as daemon:
        host, port = daemon.data.removeprefix("tcp://").rsplit(":", 1)
        flood: list[socket.socket] = []
        try:
            for _ in range(300):
                s = socket.create_connection((host, int(port)), timeout=5)
                flood.append(s)
            ok = 0
            for _ in range(20):
                with daemon.probe("alice") as probe:
                    ok += probe.stats() is not None
            assert ok == 20
            assert _errors(daemon).get("preauth_evicted", 0) >= 300 - 64
        finally:
            for s in flood:
                s.close()


def test_declared_size_alone_reserves_nothing(tmp_path: Path) -> None:
    """Bytes a request only declares are not counted: a daemon with a 1 MiB in-flight
    budget still serves other tenants while one tenant has declared far more."""
    server = {"max_inflight_bytes": MiB, "tenant_inflight_bytes": MiB}
    with (
        DaemonProcess(tmp_path, server=server) as daemon,
        daemon.probe("alice") as victim,
        daemon.probe("default") as greedy,
    ):
        put = make_items(Op.PUT, 1, reply=False)
        put["length"] = 256 * MiB
        header = Header(op=Op.PUT, request_id=1, count=1, data_len=256 * MiB)
        greedy.send_raw(header.pack() + put.tobytes() + b"\0" * 100)
        assert victim.stats()["node_id"] == "test-node"
        assert _errors(daemon).get("inflight_paused", 0) == 0
