"""A whole cluster on one machine: N storage daemons on loopback under one directory.

``kvcache up`` / ``status`` / ``down`` use this, and so do the demo, the
benchmarks and the integration tests. Each daemon is a real ``kvcache server``
process with its own LMDB directory and log; the cluster file and the pids are
written next to them so a later command can find and stop them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.cluster import ClusterMap, NodeInfo
from kvcache.errors import ClusterError, ConfigError

__all__ = ["LocalCluster", "free_ports"]

log = logging.getLogger(__name__)

#: Environment for the daemons: no spinning BLAS threads, and glibc's malloc settings from
#: process start (kvcache.memtune explains why; the daemon also applies them itself).
DAEMON_ENV = {
    "OPENBLAS_NUM_THREADS": "1",
    "MALLOC_MMAP_THRESHOLD_": str(64 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(512 << 20),
    "MALLOC_TOP_PAD_": str(64 << 20),
}

CLUSTER_FILE = "cluster.toml"
PIDS_FILE = "pids.json"


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class _Node:
    info: NodeInfo
    data_dir: Path
    pid: int
    proc: subprocess.Popen[bytes] | None = None


class LocalCluster:
    """Starts, inspects and stops daemons of a local cluster under ``root``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._nodes: list[_Node] = []

    @property
    def cluster_file(self) -> Path:
        """The cluster map clients load."""
        return self.root / CLUSTER_FILE

    @property
    def nodes(self) -> list[NodeInfo]:
        """The nodes, in id order."""
        return [n.info for n in self._nodes]

    def pid(self, index: int) -> int:
        """Process id of node ``index``."""
        return self._nodes[index].pid

    # -------------------------------------------------------------- start / stop

    def start(
        self,
        *,
        nodes: int = 12,
        capacity: str = "2GiB",
        token: str | None = None,
        extra_args: tuple[str, ...] = (),
        timeout_s: float = 60.0,
    ) -> LocalCluster:
        """Start ``nodes`` daemons, write the cluster file, wait until all are healthy."""
        if nodes < 1:
            raise ConfigError("a cluster needs at least one node")
        if (self.root / PIDS_FILE).exists() and self._alive_pids():
            raise ClusterError(
                f"a cluster is already running under {self.root}; run `kvcache down` first"
            )
        self.root.mkdir(parents=True, exist_ok=True)
        ports = free_ports(2 * nodes)
        env = {**os.environ, **DAEMON_ENV}
        if token:
            env["KVCACHE_SERVER_TOKEN"] = token
        self._nodes = []
        for i in range(nodes):
            node_id = f"node-{i:02d}"
            data_port, admin_port = ports[2 * i], ports[2 * i + 1]
            info = NodeInfo(
                id=node_id,
                data=f"tcp://127.0.0.1:{data_port}",
                admin=f"http://127.0.0.1:{admin_port}",
            )
            data_dir = self.root / node_id
            data_dir.mkdir(exist_ok=True)
            log_file = open(self.root / f"{node_id}.log", "ab")  # noqa: SIM115 - owned by the child
            cmd = [
                sys.executable, "-m", "kvcache.cli", "server",
                "--node-id", node_id,
                "--data-dir", str(data_dir),
                "--listen", info.data,
                "--admin-listen", f"127.0.0.1:{admin_port}",
                "--capacity", capacity,
                *extra_args,
            ]  # fmt: skip
            proc = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            log_file.close()
            self._nodes.append(_Node(info, data_dir, proc.pid, proc))
        cmap = ClusterMap(epoch=1, nodes=tuple(n.info for n in self._nodes))
        self.cluster_file.write_text(cmap.to_toml())
        (self.root / PIDS_FILE).write_text(json.dumps({n.info.id: n.pid for n in self._nodes}))
        try:
            self.wait_healthy(timeout_s=timeout_s)
        except ClusterError:
            self.stop()
            raise
        log.info("local cluster of %d nodes up under %s", nodes, self.root)
        return self

    @classmethod
    def attach(cls, root: str | Path) -> LocalCluster:
        """A handle on a cluster started earlier (by another process) under ``root``."""
        self = cls(root)
        try:
            cmap = ClusterMap.load(self.cluster_file)
            pids = json.loads((self.root / PIDS_FILE).read_text())
        except (ConfigError, OSError, ValueError) as exc:
            raise ClusterError(f"no local cluster under {self.root}: {exc}") from None
        self._nodes = [_Node(n, self.root / n.id, int(pids.get(n.id, 0))) for n in cmap.nodes]
        return self

    def wait_healthy(self, *, timeout_s: float = 60.0, indices: list[int] | None = None) -> None:
        """Poll each node's /healthz until it answers 200, or raise ClusterError."""
        deadline = time.monotonic() + timeout_s
        for i in indices if indices is not None else range(len(self._nodes)):
            node = self._nodes[i]
            while not self._healthy(node.info):
                if node.proc is not None and node.proc.poll() is not None:
                    raise ClusterError(
                        f"{node.info.id} exited with {node.proc.returncode}; "
                        f"see {self.root / (node.info.id + '.log')}"
                    )
                if time.monotonic() > deadline:
                    raise ClusterError(f"{node.info.id} not healthy after {timeout_s}s")
                time.sleep(0.05)

    @staticmethod
    def _healthy(info: NodeInfo) -> bool:
        try:
            with urllib.request.urlopen(f"{info.admin}/healthz", timeout=1) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _alive_pids(self) -> list[int]:
        try:
            pids = json.loads((self.root / PIDS_FILE).read_text()).values()
        except (OSError, ValueError):
            return []
        return [p for p in pids if _alive(int(p))]

    def stop(self, *, timeout_s: float = 15.0) -> None:
        """SIGTERM every daemon (SIGCONT first, in case one is paused), then SIGKILL stragglers."""
        for node in self._nodes:
            _signal(node.pid, signal.SIGCONT)
            _signal(node.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for node in self._nodes:
            while _alive(node.pid, node.proc) and time.monotonic() < deadline:
                time.sleep(0.02)
            if _alive(node.pid, node.proc):
                log.warning("%s did not stop on SIGTERM; killing it", node.info.id)
                _signal(node.pid, signal.SIGKILL)
                _reap(node)
        (self.root / PIDS_FILE).unlink(missing_ok=True)

    # -------------------------------------------------------------- faults

    def kill(self, index: int) -> None:
        """SIGKILL node ``index`` (as a crash would)."""
        node = self._nodes[index]
        _signal(node.pid, signal.SIGKILL)
        _reap(node)

    def pause(self, index: int) -> None:
        """SIGSTOP node ``index``: it keeps its connections but answers nothing."""
        _signal(self._nodes[index].pid, signal.SIGSTOP)

    def resume(self, index: int) -> None:
        """SIGCONT a paused node."""
        _signal(self._nodes[index].pid, signal.SIGCONT)

    def restart(self, index: int, *, timeout_s: float = 30.0) -> None:
        """Start node ``index`` again on its old addresses and data directory."""
        node = self._nodes[index]
        if _alive(node.pid, node.proc):
            raise ClusterError(f"{node.info.id} is still running")
        admin_port = node.info.admin.rsplit(":", 1)[1]
        log_file = open(self.root / f"{node.info.id}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "kvcache.cli", "server",
                "--node-id", node.info.id,
                "--data-dir", str(node.data_dir),
                "--listen", node.info.data,
                "--admin-listen", f"127.0.0.1:{admin_port}",
            ],
            stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **DAEMON_ENV},
        )  # fmt: skip
        log_file.close()
        node.pid, node.proc = proc.pid, proc
        self.wait_healthy(timeout_s=timeout_s, indices=[index])

    # -------------------------------------------------------------- status

    def node_stats(self) -> list[dict[str, Any]]:
        """Each node's /stats JSON, or an error entry."""
        out: list[dict[str, Any]] = []
        for node in self._nodes:
            try:
                with urllib.request.urlopen(f"{node.info.admin}/stats", timeout=2) as resp:
                    stats = json.loads(resp.read())
                out.append({"node": node.info.id, "up": True, **stats})
            except (urllib.error.URLError, OSError, ValueError) as exc:
                out.append({"node": node.info.id, "up": False, "error": str(exc)})
        return out

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _alive(pid: int, proc: subprocess.Popen[bytes] | None = None) -> bool:
    if pid <= 0:
        return False
    if proc is not None:
        return proc.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except OSError:
        return False


def _signal(pid: int, sig: signal.Signals) -> None:
    if pid > 0:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _reap(node: _Node) -> None:
    if node.proc is not None:
        try:
            node.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.warning("%s did not exit after SIGKILL", node.info.id)
