"""A single-member etcd as a process of our own (``kvcache up --etcd``, tests, benchmarks).

Debian's ``etcd-server`` package (etcd 3.4.23 on Debian 12, installed by
``scripts/install.sh``) ships the binary; no systemd unit is involved. The
process listens on loopback (or a given host) and keeps its data under a
directory of ours; it is ready in about a second.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvcache.cluster import EtcdSettings
from kvcache.errors import ClusterError, ConfigError

__all__ = ["LocalEtcd", "etcd_binary"]

log = logging.getLogger(__name__)


def etcd_binary() -> str:
    """Path of the ``etcd`` binary; ConfigError saying how to install it when missing."""
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if found is None:
        raise ConfigError(
            "etcd is not installed: `apt-get install etcd-server` (scripts/install.sh does it)"
        )
    return found


class LocalEtcd:
    """One etcd process with its data under ``data_dir``."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        client_port: int,
        peer_port: int,
        host: str = "127.0.0.1",
        prefix: str = "/kvcache/default",
        log_file: str | Path | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.client_port = client_port
        self.peer_port = peer_port
        self.prefix = prefix
        self.log_file = (
            Path(log_file) if log_file is not None else self.data_dir.with_suffix(".log")
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The client URL."""
        return f"http://{self.host}:{self.client_port}"

    @property
    def settings(self) -> EtcdSettings:
        """What a cluster file's ``[etcd]`` table says for this etcd."""
        return EtcdSettings(endpoints=(self.url,), prefix=self.prefix)

    @property
    def pid(self) -> int:
        """The process id (0 before start)."""
        return self.proc.pid if self.proc is not None else 0

    def command(self) -> list[str]:
        """The command line that starts it."""
        return [
            etcd_binary(),
            "--name", "kvcache-etcd",
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", f"http://{self.host}:{self.peer_port}",
            "--initial-advertise-peer-urls", f"http://{self.host}:{self.peer_port}",
            "--initial-cluster", f"kvcache-etcd=http://{self.host}:{self.peer_port}",
        ]  # fmt: skip

    def start(self, *, timeout_s: float = 30.0) -> LocalEtcd:
        """Start the process and wait until it reports healthy."""
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        with open(self.log_file, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.proc.poll() is not None:
                raise ClusterError(
                    f"etcd exited with {self.proc.returncode} at start; see {self.log_file}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ClusterError(f"etcd not healthy after {timeout_s} s; see {self.log_file}")
            time.sleep(0.05)
        log.info("etcd %s up (pid %d, data %s)", self.url, self.proc.pid, self.data_dir)
        return self

    def registered_ids(self) -> set[str]:
        """Ids of the nodes registered (live) under :attr:`prefix`, read over etcd's JSON
        gateway (no gRPC event loop in the calling process)."""
        return registered_ids(self.url, self.prefix)

    def healthy(self) -> bool:
        """Whether ``/health`` answers ``{"health": "true"}``."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1) as resp:
                return bool(json.loads(resp.read()).get("health") == "true")
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s`` (idempotent)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=timeout_s)

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def registered_ids(url: str, prefix: str, *, timeout_s: float = 2.0) -> set[str]:
    """Ids of nodes that are both members and live under ``prefix`` in the etcd at
    ``url`` (read over its v3 JSON gateway). ClusterError when etcd does not answer."""
    return _ids(url, prefix, "live/", timeout_s) & _ids(url, prefix, "members/", timeout_s)


def _ids(url: str, prefix: str, sub: str, timeout_s: float) -> set[str]:
    key = (prefix.rstrip("/") + "/" + sub).encode()
    end = key[:-1] + bytes([key[-1] + 1])
    body = json.dumps(
        {
            "key": base64.b64encode(key).decode(),
            "range_end": base64.b64encode(end).decode(),
            "keys_only": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"{url}/v3/kv/range", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            doc = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ClusterError(f"etcd {url}: {exc}") from None
    return {base64.b64decode(kv["key"])[len(key) :].decode() for kv in doc.get("kvs", [])}
