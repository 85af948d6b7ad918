"""A storage cluster spread over simulated hosts: ``hosts × per_host`` daemons, the host as failure domain.

Each daemon is ``python -m kvcache.cli server`` started inside its host
(:class:`~kvcache.testing.hosts.HostNet`: a network namespace, or a loopback
address per host), listening on that host's address; its node in the cluster
file has ``domain = "host-<h>"``. The cluster is closed like any other: a
credentials file (mode 0600) is written and handed to every daemon, and
``client.toml`` points a client at both files.

Faults are those of whole machines: :meth:`HostCluster.kill_host` SIGKILLs a
host's daemons (and, with ``partition``, takes its link down, so clients see
silence instead of connection resets); :meth:`HostCluster.restart_host` brings
them back on the same addresses, with their disks or with empty ones. Every
process this class starts is tracked by its pid and only those are signalled.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.client.config import ClientConfig
from kvcache.cluster import ClusterMap, NodeInfo
from kvcache.credentials import Credentials
from kvcache.errors import ArgumentError, ClusterError
from kvcache.testing.hosts import HostNet, HostNetMode
from kvcache.testing.localcluster import DAEMON_ENV

__all__ = ["HostCluster", "HostDaemon"]

log = logging.getLogger(__name__)

#: Ports of daemon ``d`` on every host, when each host has an address space of its own.
DATA_PORT, ADMIN_PORT = 7400, 7480
_POLL_S = 0.05


@dataclass
class HostDaemon:
    """One daemon: where it runs, its node entry, its files and its process."""

    host: int
    info: NodeInfo
    data_dir: Path
    ready_file: Path
    log_path: Path
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        """Whether the process this object started is still running."""
        return self.proc is not None and self.proc.poll() is None


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        port: int = sock.getsockname()[1]
        return port


class HostCluster:
    """Daemons on the hosts of ``net`` under ``root`` (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        net: HostNet,
        *,
        per_host: int = 3,
        capacity: str = "256MiB",
        client_settings: Mapping[str, Any] | None = None,
    ) -> None:
        if not 1 <= per_host <= 60:
            raise ArgumentError(f"per_host must lie in 1..60, got {per_host}")
        self.root = Path(root)
        self.net = net
        self.per_host = per_host
        self.capacity = capacity
        self.client_settings = dict(client_settings or {})
        self.daemons: list[HostDaemon] = []

    @property
    def cluster_file(self) -> Path:
        """The cluster map (every daemon's real address and its host as domain)."""
        return self.root / "cluster.toml"

    @property
    def credentials_file(self) -> Path:
        """The cluster's credentials (mode 0600)."""
        return self.root / "credentials.toml"

    @property
    def client_file(self) -> Path:
        """Client config: the two files above plus ``client_settings``."""
        return self.root / "client.toml"

    def credentials(self) -> Credentials:
        """The cluster's credentials."""
        return Credentials.load(self.credentials_file)

    def cluster_map(self) -> ClusterMap:
        """The cluster map as written."""
        return ClusterMap.load(self.cluster_file)

    def client_config(self, **overrides: Any) -> ClientConfig:
        """A client config for this cluster."""
        return ClientConfig.load(self.client_file, overrides=overrides)

    def on_host(self, host: int) -> list[int]:
        """Indices (into :attr:`daemons`) of host ``host``'s daemons."""
        return [i for i, d in enumerate(self.daemons) if d.host == host]

    # -------------------------------------------------------------- start / stop

    def start(self, *, timeout_s: float = 60.0) -> HostCluster:
        """Write the files, start every daemon, wait until each has written its ready file."""
        self.root.mkdir(parents=True, exist_ok=True)
        Credentials.generate(("default",)).write(self.credentials_file)
        lines = [
            f'cluster_file = "{self.cluster_file.name}"',
            f'credentials_file = "{self.credentials_file.name}"',
            *(f"{k} = {json.dumps(v)}" for k, v in sorted(self.client_settings.items())),
        ]
        self.client_file.write_text("\n".join(lines) + "\n")
        own_ports = self.net.mode is HostNetMode.NETNS
        for host in range(self.net.hosts):
            address = self.net.address(host)
            for d in range(self.per_host):
                node_id = f"h{host}-d{d}"
                data_port = DATA_PORT + d if own_ports else _free_port(address)
                admin_port = ADMIN_PORT + d if own_ports else _free_port(address)
                info = NodeInfo(
                    id=node_id,
                    data=f"tcp://{address}:{data_port}",
                    admin=f"http://{address}:{admin_port}",
                    domain=f"host-{host}",
                )
                data_dir = self.root / node_id
                ready = self.root / f"{node_id}.ready.json"
                argv = [
                    sys.executable, "-m", "kvcache.cli", "server",
                    "--node-id", node_id,
                    "--data-dir", str(data_dir.resolve()),
                    "--listen", info.data,
                    "--admin-listen", f"{address}:{admin_port}",
                    "--capacity", self.capacity,
                    "--credentials", str(self.credentials_file.resolve()),
                    "--cluster-file", str(self.cluster_file.resolve()),
                    "--ready-file", str(ready.resolve()),
                ]  # fmt: skip
                self.daemons.append(
                    HostDaemon(host, info, data_dir, ready, self.root / f"{node_id}.log", argv)
                )
        cmap = ClusterMap(epoch=1, nodes=tuple(d.info for d in self.daemons))
        self.cluster_file.write_text(cmap.to_toml())
        try:
            self._launch(range(len(self.daemons)), timeout_s=timeout_s)
        except ClusterError:
            self.stop()
            raise
        log.info("%d daemons up on %d hosts (%s)", len(self.daemons), self.net.hosts, self.net.note)
        return self

    def _launch(self, indices: Iterable[int], *, timeout_s: float) -> None:
        chosen = list(indices)
        for i in chosen:
            daemon = self.daemons[i]
            if daemon.running:
                raise ClusterError(f"{daemon.info.id} is still running")
            daemon.data_dir.mkdir(parents=True, exist_ok=True)
            daemon.ready_file.unlink(missing_ok=True)
            daemon.proc = self.net.spawn(
                daemon.host, daemon.argv, log_path=daemon.log_path, env=DAEMON_ENV
            )
        deadline = time.monotonic() + timeout_s
        for i in chosen:
            daemon = self.daemons[i]
            while not daemon.ready_file.exists():
                if not daemon.running:
                    code = daemon.proc.returncode if daemon.proc else None
                    raise ClusterError(f"{daemon.info.id} exited with {code}: {self._tail(daemon)}")
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"{daemon.info.id} not ready after {timeout_s} s: {self._tail(daemon)}"
                    )
                time.sleep(_POLL_S)

    @staticmethod
    def _tail(daemon: HostDaemon) -> str:
        try:
            return daemon.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def stop(self, *, timeout_s: float = 15.0) -> None:
        """SIGTERM every running daemon, SIGKILL those still there after ``timeout_s``."""
        running = [d for d in self.daemons if d.running]
        for daemon in running:
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for daemon in running:
            assert daemon.proc is not None
            try:
                daemon.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop on SIGTERM; killing it", daemon.info.id)
                daemon.proc.kill()
                daemon.proc.wait(timeout=10)

    def __enter__(self) -> HostCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -------------------------------------------------------------- faults

    def kill(self, index: int) -> None:
        """SIGKILL daemon ``index`` (a crash) and reap it."""
        daemon = self.daemons[index]
        if daemon.running:
            assert daemon.proc is not None
            daemon.proc.kill()
            daemon.proc.wait(timeout=10)

    def kill_host(self, host: int, *, partition: bool = False) -> bool:
        """SIGKILL every daemon of ``host``; with ``partition`` also cut its link.

        Returns whether the link was cut (only namespaces can model that).
        """
        cut = self.net.partition(host) if partition else False
        for i in self.on_host(host):
            self.kill(i)
        return cut

    def restart(
        self, indices: Iterable[int], *, wipe: bool = False, timeout_s: float = 30.0
    ) -> None:
        """Start daemons ``indices`` again on their addresses; ``wipe`` empties their disks first."""
        chosen = list(indices)
        for i in chosen:
            daemon = self.daemons[i]
            if daemon.running:
                raise ClusterError(f"{daemon.info.id} is still running")
            if wipe:
                shutil.rmtree(daemon.data_dir, ignore_errors=True)
        self._launch(chosen, timeout_s=timeout_s)

    def restart_host(self, host: int, *, wipe: bool = False, timeout_s: float = 30.0) -> None:
        """Reconnect ``host`` and start its daemons again (with empty disks when ``wipe``)."""
        self.net.heal(host)
        self.restart(self.on_host(host), wipe=wipe, timeout_s=timeout_s)
