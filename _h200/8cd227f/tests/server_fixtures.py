"""Helpers for storage-daemon tests: shard records, a fake clock, daemon subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvcache.credentials import Credentials
from kvcache.server.probe import Probe, fake_shard
from kvcache.wire import Op, make_items

__all__ = [
    "DaemonProcess",
    "FakeClock",
    "block_records",
    "get_items",
    "http",
    "keys_items",
    "put_items",
    "wait_until",
]

START_TIMEOUT_S = 30.0


class FakeClock:
    """A clock tests step by hand (seconds since the epoch)."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def step(self, seconds: float) -> None:
        self.now += seconds


def block_records(
    key: bytes,
    *,
    body_len: int = 640,
    traffic_class: str = "chat",
    indices: Sequence[int] = range(12),
    seed: int = 0,
) -> list[tuple[bytes, int, bytes]]:
    """(key, index, record) for the shards of one block, one stripe id, seeded bodies."""
    rng = np.random.default_rng([seed, *key])
    stripe = int(rng.integers(1, 2**63))
    return [
        (
            key,
            i,
            fake_shard(
                key,
                i,
                rng.integers(0, 256, body_len, dtype=np.uint8).tobytes(),
                traffic_class=traffic_class,
                stripe_id=stripe,
            ),
        )
        for i in indices
    ]


def put_items(shards: Sequence[tuple[bytes, int, bytes]]) -> tuple[np.ndarray, memoryview]:
    """PUT request items and data for (key, index, record) triples."""
    items = make_items(Op.PUT, len(shards), reply=False)
    items["key"] = [s[0] for s in shards]
    items["index"] = [s[1] for s in shards]
    items["length"] = [len(s[2]) for s in shards]
    return items, memoryview(b"".join(s[2] for s in shards))


def get_items(wanted: Sequence[tuple[bytes, int]]) -> np.ndarray:
    """GET request items for (key, index) pairs."""
    items = make_items(Op.GET, len(wanted), reply=False)
    items["key"] = [w[0] for w in wanted]
    items["index"] = [w[1] for w in wanted]
    return items


def keys_items(op: Op, keys: Sequence[bytes]) -> np.ndarray:
    """HAS or TOUCH request items for keys."""
    items = make_items(op, len(keys), reply=False)
    items["key"] = list(keys)
    return items


def wait_until(predicate: Callable[[], Any], *, timeout_s: float = 10.0, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or predicate}")
        time.sleep(0.02)


def http(method: str, url: str, body: Any = None, *, token: str | None = None) -> tuple[int, bytes]:
    """A small HTTP call: (status, body)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class DaemonProcess:
    """``kvcache server`` as a subprocess on free loopback ports with its own data dir."""

    def __init__(
        self,
        root: Path,
        *,
        server: dict[str, Any] | None = None,
        retention: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        preexec: Callable[[], None] | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.config_path = root / "node.toml"
        self.ready_path = root / "ready.json"
        self.log_path = root / "daemon.log"
        self.credentials_path = root / "credentials.toml"
        self.credentials = credentials or Credentials.generate(("default", "alice"))
        self.credentials.write(self.credentials_path)
        settings: dict[str, Any] = {
            "capacity_bytes": 256 << 20,
            "node_id": "test-node",
            "credentials_file": str(self.credentials_path),
        }
        settings.update(server or {})
        lines = ["[server]"] + [f"{k} = {_toml(v)}" for k, v in settings.items()]
        if retention:
            lines.append("[retention]")
            lines += [f"{k} = {_toml(v)}" for k, v in retention.items() if k != "classes"]
            if "classes" in retention:
                lines.append("[retention.classes]")
                lines += [f"{k} = {_toml(v)}" for k, v in retention["classes"].items()]
        self.config_path.write_text("\n".join(lines) + "\n")
        self._env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})}
        self._preexec = preexec
        self.proc: subprocess.Popen[bytes] | None = None
        self.data = ""
        self.admin = ""

    def start(self) -> DaemonProcess:
        """Start and wait until the ready file exists and /healthz answers 200."""
        self.ready_path.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "kvcache.cli",
            "server",
            "--config",
            str(self.config_path),
            "--data-dir",
            str(self.data_dir),
            "--listen",
            "tcp://127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--ready-file",
            str(self.ready_path),
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=log, env=self._env, preexec_fn=self._preexec
            )

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            return self.ready_path.exists()

        wait_until(ready, timeout_s=START_TIMEOUT_S, what="the daemon's ready file")
        info = json.loads(self.ready_path.read_text())
        self.data, self.admin = info["data"], info["admin"]
        wait_until(lambda: http("GET", self.admin + "/healthz")[0] == 200, what="/healthz")
        return self

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(
                f"daemon ignored SIGTERM for {timeout_s} s:\n{self.log()}"
            ) from None

    @property
    def admin_token(self) -> str:
        """The admin token of the daemon's credentials."""
        assert self.credentials.admin_token is not None
        return self.credentials.admin_token

    def probe(self, tenant: str = "default", **kwargs: Any) -> Probe:
        """An authenticated single-node connection as ``tenant``."""
        entry = self.credentials.tenant(tenant)
        assert entry is not None
        return Probe(self.data, tenant=tenant, secret=entry.secret, **kwargs)

    def kill(self) -> None:
        """SIGKILL (``kill -9``) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.proc is not None and self.proc.poll() is None

    def stats(self) -> dict[str, Any]:
        """GET /stats as JSON."""
        status, body = http("GET", self.admin + "/stats")
        assert status == 200, body
        result: dict[str, Any] = json.loads(body)
        return result

    def log(self) -> str:
        """The daemon's output so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self.kill()


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))
