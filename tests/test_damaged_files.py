"""Damaged LMDB files fail cleanly (issue 18, item 5), and /healthz tells the truth (item 6).

Real ``kvcache server`` processes on loopback with real data files: truncated while
the daemon is stopped (to half its used size, to 8 KiB, by one page), the next start
is refused with a log line or quarantines the file and starts empty, never a SIGBUS;
pages damaged while it runs make it refuse PUTs (UNAVAILABLE) and answer /healthz 503.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.server.lmdb_check import check_data_file, parse_meta
from kvcache.server.lmdb_env import QUARANTINE_NAME
from kvcache.server.probe import Probe
from kvcache.server.selfprobe import SelfProbe
from kvcache.wire import Message, Op, Status, make_items
from tests.server_fixtures import DaemonProcess, block_records, http, wait_until

CUTS = ["half", "8KiB", "one-page"]


def used_bytes(data_file: Path) -> int:
    """Bytes LMDB's newest meta page says the file uses."""
    raw = data_file.read_bytes()
    first = parse_meta(raw[:4096])
    assert not isinstance(first, str)
    second = parse_meta(raw[first.page_size : 2 * first.page_size])
    assert not isinstance(second, str)
    meta = max(first, second, key=lambda m: m.txnid)
    return (meta.last_page + 1) * meta.page_size


def filled(root: Path, **server: object) -> DaemonProcess:
    """A daemon that stored some shards and was stopped (SIGTERM)."""
    daemon = DaemonProcess(root, server=dict(server)).start()
    with daemon.probe() as probe:
        for b in range(40):
            assert probe.put(block_records(b.to_bytes(16, "big"), seed=b)).tolist() == [0] * 12
    assert daemon.stop() == 0
    return daemon


def cut(data_file: Path, how: str) -> None:
    used = used_bytes(data_file)
    size = {"half": used // 2, "8KiB": 8192, "one-page": used - 4096}[how]
    os.truncate(data_file, size)
    assert check_data_file(data_file) is not None


@pytest.mark.parametrize("how", CUTS)
def test_truncated_file_is_quarantined_and_the_daemon_starts_empty(
    tmp_path: Path, how: str
) -> None:
    daemon = filled(tmp_path)
    data_file = daemon.data_dir / "data.mdb"
    cut(data_file, how)
    daemon.start()  # healthy (/healthz 200), as start() waits for
    try:
        assert "is damaged" in daemon.log() and "starting empty" in daemon.log()
        assert (daemon.data_dir / QUARANTINE_NAME).exists()
        with daemon.probe() as probe:
            key = (3).to_bytes(16, "big")
            assert probe.has([key])[key] == {}
            assert probe.put(block_records(key, seed=99)).tolist() == [0] * 12
    finally:
        assert daemon.stop() == 0
    assert check_data_file(data_file) is None


@pytest.mark.parametrize("how", CUTS)
def test_truncated_file_is_refused_with_a_log_line_when_configured(
    tmp_path: Path, how: str
) -> None:
    daemon = filled(tmp_path, damaged_file="refuse")
    data_file = daemon.data_dir / "data.mdb"
    cut(data_file, how)
    size = data_file.stat().st_size
    done = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "server", "--config", str(daemon.config_path),
         "--data-dir", str(daemon.data_dir), "--listen", "tcp://127.0.0.1:0",
         "--admin-listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1  # an exit status, not a signal (a SIGBUS would be -7)
    assert "is damaged" in done.stderr and "truncated" in done.stderr
    assert "Traceback" not in done.stderr
    assert data_file.stat().st_size == size  # left as it was, for the operator
    assert not (daemon.data_dir / QUARANTINE_NAME).exists()


def start_refused(daemon: DaemonProcess) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "server", "--config", str(daemon.config_path),
         "--data-dir", str(daemon.data_dir), "--listen", "tcp://127.0.0.1:0",
         "--admin-listen", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.parametrize("how", ["empty", "missing"])
def test_an_index_lost_beside_its_segments_is_damage_not_a_new_store(
    tmp_path: Path, how: str
) -> None:
    """An empty or missing data.mdb was taken for a new store, and the start removed every
    segment file its empty index did not name: every record gone, under refuse too."""
    daemon = filled(tmp_path, damaged_file="refuse")
    data_file = daemon.data_dir / "data.mdb"
    segments = sorted((daemon.data_dir / "segments").glob("*.seg"))
    assert segments
    if how == "empty":
        os.truncate(data_file, 0)
    else:
        data_file.unlink()
    done = start_refused(daemon)
    assert done.returncode == 1, done.stderr
    assert f"it is {how}, and {len(segments)} segment file(s)" in done.stderr
    assert sorted((daemon.data_dir / "segments").glob("*.seg")) == segments  # all kept


def test_another_applications_lmdb_file_is_refused(tmp_path: Path) -> None:
    import lmdb

    data_dir = tmp_path / "data"
    env = lmdb.open(str(data_dir), max_dbs=2, map_size=1 << 20)
    users = env.open_db(b"users")
    with env.begin(write=True) as txn:
        txn.put(b"alice", b"1", db=users)
    env.close()
    daemon = DaemonProcess(tmp_path)
    done = start_refused(daemon)
    assert done.returncode == 1, done.stderr
    assert "another application's LMDB file (it holds ['users']" in done.stderr
    env = lmdb.open(str(data_dir), max_dbs=4, readonly=True)
    with env.begin() as txn:  # none of the store's databases was written into it
        assert [bytes(k) for k, _ in txn.cursor()] == [b"users"]
    env.close()


def raw_put(probe: Probe, shards: list[tuple[bytes, int, bytes]]) -> Message:
    """A PUT's whole reply (its message status too, which Probe.put raises on)."""
    items = make_items(Op.PUT, len(shards), reply=False)
    items["key"] = [s[0] for s in shards]
    items["index"] = [s[1] for s in shards]
    items["length"] = [len(s[2]) for s in shards]
    return probe.request(Op.PUT, items, b"".join(s[2] for s in shards))


def damage_pages(data_file: Path) -> int:
    """Overwrite the flags of every B-tree page of a live file (they no longer say what
    the page is): LMDB's next look at them is an MDB_CORRUPTED."""
    fd = os.open(data_file, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        damaged = 0
        for page in range(2, size // 4096):
            pgno, _pad, flags = struct.unpack("<QHH", os.pread(fd, 12, page * 4096))
            if pgno == page and flags in (1, 2):  # a branch or leaf page
                os.pwrite(fd, b"\0\0", page * 4096 + 10)
                damaged += 1
        return damaged
    finally:
        os.close(fd)


def test_damage_at_run_time_stops_puts_and_fails_healthz(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path).start()
    try:
        with daemon.probe() as probe:
            assert probe.put(block_records(b"a" * 16, seed=1)).tolist() == [0] * 12
            assert http("GET", daemon.admin + "/healthz")[0] == 200
            assert damage_pages(daemon.data_dir / "data.mdb") > 0
            # The PUT that meets the damage fails; from then on every PUT is refused whole.
            for seed in (2, 3):
                reply = raw_put(probe, block_records(bytes([seed]) * 16, seed=seed))
                assert reply.header.status in (Status.OK, Status.UNAVAILABLE)
                if reply.header.status == Status.OK:
                    assert (reply.items["status"] != 0).all()
            reply = raw_put(probe, block_records(b"d" * 16, seed=4))
            assert reply.header.status == Status.UNAVAILABLE
            assert "damaged" in reply.error_text()
        status, body = http("GET", daemon.admin + "/healthz")
        assert status == 503 and b"damaged" in body
        assert "refusing PUTs" in daemon.log()
        assert daemon.alive()
    finally:
        daemon.kill()


def test_healthz_fails_while_the_data_path_takes_no_new_connection(tmp_path: Path) -> None:
    """Two authenticated connections fill a table of two: the HTTP thread is fine, but a
    new client would not be served, so /healthz says 503 (it said 200) and why; one
    connection closed, it says 200 again."""
    daemon = DaemonProcess(tmp_path, server={"max_connections": 2}).start()
    try:
        first, second = daemon.probe(), daemon.probe()
        try:
            assert first.stats() and second.stats()
            # The verdict of the start's check is cached for a second: poll past it.
            _status, body = wait_until(
                lambda: (got := http("GET", daemon.admin + "/healthz"))[0] == 503 and got,
                what="/healthz 503",
            )
            assert b"unhealthy" in body
        finally:
            first.close()
        wait_until(lambda: http("GET", daemon.admin + "/healthz")[0] == 200, what="healthy again")
        second.close()
    finally:
        assert daemon.stop() == 0


def test_self_probe_verdicts_are_cached_for_cache_s() -> None:
    now = [100.0]
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    probe = SelfProbe(
        lambda: f"tcp://0.0.0.0:{port}", tenant="default", secret=b"s" * 32, timeout_s=0.5,
        clock=lambda: now[0],
    )  # fmt: skip
    first = probe.verdict()
    assert not first.ok and first.reason
    assert probe.verdict() is first and probe.runs == 1
    now[0] += 1.5
    assert probe.verdict() is not first and probe.runs == 2 and probe.failures == 2
