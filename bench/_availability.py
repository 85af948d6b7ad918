"""Issue 18's figures of damaged headers, damaged files, reopening and tenant isolation.

Self-contained parts of ``bench/reliability.py`` (it calls them and adds their keys to
its ``--json``), each on real daemons over loopback:

- ``header_flip_load_exceptions``: every byte of 3 shards' 104-byte headers flipped
  (XOR 0xFC) on every copy in the daemon's file, another shard of the block deleted so
  a repair is due, then loads with read repair on: loads that raised (target 0), with
  the wrong bytes they returned;
- ``truncated_start_clean``: ``data.mdb`` cut to half its used size, to 8 KiB and by one
  page while the daemon was stopped, started with ``damaged_file`` quarantine and refuse:
  1 when each start was quarantined (healthy, empty) or refused (exit 1) with a log
  line, and never died of a signal;
- ``reopen_after_kill9_s``: a daemon filled with shards and killed with SIGKILL; the
  time to open its store again (``ShardStore(...)``, in this process), and the time to a
  restarted daemon's first healthy ``/healthz``;
- ``cross_tenant_quota_refusals``: PUT items of one tenant answered QUOTA while another
  tenant floods the same node past its quota on 6 connections (target 0).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from kvcache.chaos import ShardFault, find_shard, flip_record_byte, plant
from kvcache.client import Client
from kvcache.credentials import Credentials, TenantCredentials
from kvcache.errors import KVCacheError
from kvcache.keys import Namespace, block_keys
from kvcache.layout import DType, KVLayout
from kvcache.server.lmdb_check import parse_meta
from kvcache.server.probe import Probe, fake_shard
from kvcache.server.store import ShardStore
from kvcache.shard import HEADER_BYTES
from kvcache.testing.localcluster import LocalCluster
from kvcache.wire import Status
from kvcache.workload import payload_for_key

__all__ = ["cross_tenant_quota", "header_flips", "reopen_after_kill9", "truncated_starts"]

SMALL = KVLayout(tokens_per_block=16, bytes_per_token=64, dtype=DType.INT8, layers_in_block=1)


# ---------------------------------------------------------------------- header flips


def header_flips(
    cluster: LocalCluster, *, shards: tuple[int, ...], step: int = 1
) -> dict[str, Any]:
    """Flip byte p of shard i's header (every copy) for each p (every ``step``-th) and i."""
    exceptions = wrong = short = loads = 0
    errors: list[str] = []
    with Client(cluster.client_config()) as client:
        for index in shards:
            for position in range(0, HEADER_BYTES, step):
                ns = Namespace(model=f"flip-{index}-{position}", revision="1", layout=SMALL)
                tokens = np.arange(32, dtype=np.uint32) + 7 * position + 1000 * index
                keys = block_keys(ns, tokens)
                expected = [payload_for_key(k, SMALL.payload_bytes) for k in keys]
                client.store(ns, tokens, expected)
                node, _stripe, record = find_shard(cluster, keys[0], index)
                flip_record_byte(cluster, node, record, position, mask=0xFC)
                plant(cluster, keys[0], (index + 5) % 12, ShardFault.MISSING)
                for _ in range(2):
                    loads += 1
                    try:
                        result = client.load_prefix(ns, tokens)
                    except Exception as exc:  # what is counted: any exception at all
                        exceptions += 1
                        errors.append(f"shard {index} byte {position}: {exc!r}"[:200])
                        continue
                    short += result.blocks < 2
                    wrong += sum(
                        int(np.count_nonzero(got != want))
                        for got, want in zip(result.payloads, expected, strict=False)
                    )
    return {
        "header_flip_load_exceptions": exceptions,
        "header_flip_loads": loads,
        "header_flip_short_loads": short,
        "header_flip_wrong_bytes": wrong,
        "header_flip_errors": errors[:5],
    }


# ---------------------------------------------------------------------- daemons of our own


class _Daemon:
    """``kvcache server`` in a directory of its own (config file, ready file, log)."""

    def __init__(self, root: Path, credentials: Credentials, **server: Any) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.data_dir = root / "data"
        self.credentials = credentials
        creds = root / "credentials.toml"
        credentials.write(creds)
        settings = {"capacity_bytes": 4 << 30, "credentials_file": str(creds), **server}
        lines = ["[server]"] + [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
        self.config = root / "node.toml"
        self.config.write_text("\n".join(lines) + "\n")
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.data = self.admin = ""

    def command(self) -> list[str]:
        return [sys.executable, "-m", "kvcache.cli", "server", "--config", str(self.config),
                "--data-dir", str(self.data_dir), "--listen", "tcp://127.0.0.1:0",
                "--admin-listen", "127.0.0.1:0", "--ready-file", str(self.root / "ready.json")]  # fmt: skip

    def start(self, timeout_s: float = 60.0) -> float:
        """Start; seconds until /healthz answered 200 (raises if it exited)."""
        ready = self.root / "ready.json"
        ready.unlink(missing_ok=True)
        started = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=log,
                env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
            )  # fmt: skip
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise KVCacheError(f"daemon exited with {self.proc.returncode}")
            if ready.exists():
                info = json.loads(ready.read_text())
                self.data, self.admin = info["data"], info["admin"]
                if _healthz(self.admin) == 200:
                    return time.monotonic() - started
            time.sleep(0.01)
        raise KVCacheError("daemon did not become healthy")

    def probe(self, tenant: str = "default") -> Probe:
        entry = self.credentials.tenant(tenant)
        assert entry is not None
        return Probe(self.data, tenant=tenant, secret=entry.secret, timeout_s=30)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(30)


def _healthz(admin: str) -> int:
    try:
        with urllib.request.urlopen(admin.rstrip("/") + "/healthz", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def _fill(daemon: _Daemon, nbytes: int, *, body: int = 64 << 10, per_put: int = 64) -> int:
    """PUT about ``nbytes`` of shards (fresh keys); returns the shards stored."""
    stored = 0
    blob = os.urandom(body)
    with daemon.probe() as probe:
        for batch in range(max(1, nbytes // (body * per_put))):
            shards = [
                ((batch * per_put + j).to_bytes(16, "big"), 0, fake_shard(
                    (batch * per_put + j).to_bytes(16, "big"), 0, blob))
                for j in range(per_put)
            ]  # fmt: skip
            stored += int(np.count_nonzero(probe.put(shards) == Status.OK))
    return stored


def _used_bytes(data_file: Path) -> int:
    raw = data_file.read_bytes()[: 65536 * 2]
    first = parse_meta(raw[:4096])
    assert not isinstance(first, str)
    second = parse_meta(raw[first.page_size : 2 * first.page_size])
    assert not isinstance(second, str)
    meta = max(first, second, key=lambda m: m.txnid)
    return (meta.last_page + 1) * meta.page_size


# ---------------------------------------------------------------------- truncated files


def truncated_starts(root: Path) -> dict[str, Any]:
    """Each cut, each mode: clean (quarantined and healthy, or refused with exit 1, a log
    line naming the damage, no signal death)?"""
    creds = Credentials.generate()
    cases: dict[str, bool] = {}
    for mode in ("quarantine", "refuse"):
        for cut in ("half", "8KiB", "one-page"):
            daemon = _Daemon(root / f"{mode}-{cut}", creds, damaged_file=mode)
            daemon.start()
            _fill(daemon, 8 << 20)
            daemon.stop()
            data_file = daemon.data_dir / "data.mdb"
            used = _used_bytes(data_file)
            os.truncate(data_file, {"half": used // 2, "8KiB": 8192, "one-page": used - 4096}[cut])
            if mode == "quarantine":
                try:
                    daemon.start()
                    with daemon.probe() as probe:
                        empty = probe.has([(5).to_bytes(16, "big")])[(5).to_bytes(16, "big")] == {}
                    code = daemon.stop()
                    clean = empty and code == 0 and "is damaged" in daemon.log.read_text()
                except KVCacheError:
                    clean = False
            else:
                done = subprocess.run(daemon.command(), capture_output=True, text=True, timeout=60)
                clean = done.returncode == 1 and "is damaged" in done.stderr
            cases[f"{mode}-{cut}"] = clean
    return {"truncated_start_clean": int(all(cases.values())), "truncated_start_cases": cases}


# ---------------------------------------------------------------------- reopen


def reopen_after_kill9(root: Path, nbytes: int) -> dict[str, Any]:
    """Fill a daemon with ``nbytes`` of shards, kill -9 it, time reopening its store."""
    daemon = _Daemon(root / "reopen", Credentials.generate())
    daemon.start()
    shards = _fill(daemon, nbytes)
    daemon.stop(signal.SIGKILL)
    size = (daemon.data_dir / "data.mdb").stat().st_size
    started = time.perf_counter()
    store = ShardStore(daemon.data_dir, capacity_bytes=4 << 30)
    opened = time.perf_counter() - started
    count = store.usage()["shards"]
    store.close()
    restart = daemon.start()
    daemon.stop()
    return {
        "reopen_after_kill9_s": opened,
        "restart_after_kill9_healthy_s": restart,
        "reopen_file_bytes": size,
        "reopen_shards": shards,
        "reopen_shards_found": count,
    }


# ---------------------------------------------------------------------- quota isolation


def cross_tenant_quota(root: Path, seconds: float) -> dict[str, Any]:
    """Alice PUTs small batches; bob floods the same daemon far past his 1 MiB quota on
    6 connections; alice's items answered QUOTA are the figure."""
    creds = Credentials(
        tenants=(
            *Credentials.generate(("default", "alice")).tenants,
            TenantCredentials(name="bob", secret=b"b" * 32, quota_bytes=1 << 20),
        ),
        admin_token=Credentials.generate().admin_token,
    )
    daemon = _Daemon(root / "quota", creds, capacity_bytes=1 << 30)
    daemon.start()
    stop = threading.Event()
    flood_quota = [0]

    def flood(worker: int) -> None:
        blob = os.urandom(128 << 10)
        n = 0
        with daemon.probe("bob") as probe:
            while not stop.is_set():
                keys = [(worker << 40 | n + j).to_bytes(16, "big") for j in range(8)]
                n += 8
                status = probe.put([(k, 0, fake_shard(k, 0, blob)) for k in keys])
                flood_quota[0] += int(np.count_nonzero(status == Status.QUOTA))

    threads = [threading.Thread(target=flood, args=(w + 1,)) for w in range(6)]
    for thread in threads:
        thread.start()
    refused = items = 0
    body = os.urandom(4 << 10)
    deadline = time.monotonic() + seconds
    try:
        with daemon.probe("alice") as alice:
            n = 0
            while time.monotonic() < deadline:
                shards = [((n + j).to_bytes(16, "big"), 0, fake_shard((n + j).to_bytes(16, "big"), 0, body)) for j in range(12)]  # fmt: skip
                n += 12
                status = alice.put(shards)
                items += len(status)
                refused += int(np.count_nonzero(status == Status.QUOTA))
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        daemon.stop()
    return {
        "cross_tenant_quota_refusals": refused,
        "cross_tenant_quota_items": items,
        "quota_flood_items_refused": flood_quota[0],
    }


def run_all(cluster: LocalCluster, *, quick: bool) -> dict[str, Any]:
    """Every figure of this module (a fresh temporary directory for the daemons of its own)."""
    figures: dict[str, Any] = {}
    figures.update(header_flips(cluster, shards=(0,) if quick else (0, 5, 11)))
    with tempfile.TemporaryDirectory(prefix="kvcache-availability-") as tmp:
        root = Path(tmp)
        figures.update(truncated_starts(root))
        figures.update(reopen_after_kill9(root, (256 << 20) if quick else (1800 << 20)))
        figures.update(cross_tenant_quota(root, 3.0 if quick else 10.0))
    return figures
