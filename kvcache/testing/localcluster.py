"""A whole cluster on one machine: N storage daemons on loopback under one directory.

``kvcache up`` / ``status`` / ``down`` use this, and so do the demo, the
benchmarks and the integration tests. Each daemon is a real ``kvcache server``
process with its own LMDB directory and log. Next to them go the cluster file,
the credentials (generated, mode 0600: the cluster is closed by default), a
``client.toml`` that points a client at both, and ``nodes.json``: each
daemon's pid, process start time and full command line, so a later ``down``
signals only processes that are still those daemons, and ``restart`` starts a
daemon again with every setting it had.
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcache.client.config import ClientConfig
from kvcache.cluster import ClusterMap, EtcdSettings, NodeInfo, read_cluster_file
from kvcache.credentials import Credentials
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
CREDENTIALS_FILE = "credentials.toml"
CLIENT_FILE = "client.toml"
PIDS_FILE = "nodes.json"
#: The entry of ``nodes.json`` that records the cluster's own etcd process.
ETCD_RECORD = "_etcd"


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
    cmd: list[str] | None = None
    started: int = 0

    def record(self) -> dict[str, Any]:
        return {"pid": self.pid, "started": self.started, "cmd": self.cmd}


class LocalCluster:
    """Starts, inspects and stops daemons of a local cluster under ``root``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._nodes: list[_Node] = []
        self._etcd: _Node | None = None
        self._capacity = "2GiB"
        self._extra_args: tuple[str, ...] = ()
        self._lease_ttl_s = 10
        self._etcd_settings: EtcdSettings | None = None

    @property
    def cluster_file(self) -> Path:
        """The cluster map clients load."""
        return self.root / CLUSTER_FILE

    @property
    def credentials_file(self) -> Path:
        """The cluster's credentials (every tenant's secret and the admin token)."""
        return self.root / CREDENTIALS_FILE

    @property
    def client_file(self) -> Path:
        """A client config pointing at the cluster file and the credentials."""
        return self.root / CLIENT_FILE

    def credentials(self) -> Credentials:
        """The cluster's credentials."""
        return Credentials.load(self.credentials_file)

    def client_config(self, **overrides: Any) -> ClientConfig:
        """A client config for this cluster (tenant ``default`` unless overridden)."""
        return ClientConfig.load(self.client_file, overrides=overrides)

    @property
    def nodes(self) -> list[NodeInfo]:
        """The nodes, in id order."""
        return [n.info for n in self._nodes]

    def pid(self, index: int) -> int:
        """Process id of node ``index``."""
        return self._nodes[index].pid

    def data_dir(self, index: int) -> Path:
        """Data directory (the LMDB environment) of node ``index``."""
        return self._nodes[index].data_dir

    # -------------------------------------------------------------- start / stop

    def start(
        self,
        *,
        nodes: int = 12,
        capacity: str = "2GiB",
        tenants: tuple[str, ...] = ("default",),
        credentials: Credentials | None = None,
        extra_args: tuple[str, ...] = (),
        timeout_s: float = 60.0,
        etcd: bool = False,
        lease_ttl_s: int = 10,
        domains: Sequence[str] | None = None,
    ) -> LocalCluster:
        """Start ``nodes`` daemons, write the cluster, credential and client files, wait
        until all are healthy. Credentials are generated for ``tenants`` unless given.

        With ``etcd``, an etcd of the cluster's own is started first (data under
        ``etcd/``), the cluster file names it (the nodes listed there too, as the
        fallback), and the daemons register in it under ``lease_ttl_s`` leases;
        start returns once every node is live in etcd. ``domains[i]`` is node
        ``i``'s failure domain (default: its own id).
        """
        if nodes < 1:
            raise ConfigError("a cluster needs at least one node")
        if domains is not None and len(domains) != nodes:
            raise ConfigError(f"{len(domains)} domains for {nodes} nodes")
        if (self.root / PIDS_FILE).exists() and self._alive_pids():
            raise ClusterError(
                f"a cluster is already running under {self.root}; run `kvcache down` first"
            )
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise ConfigError(f"{self.root} exists and is not a directory") from None
        except OSError as exc:
            raise ConfigError(f"cannot create {self.root}: {exc.strerror or exc}") from None
        (credentials or Credentials.generate(tenants)).write(self.credentials_file)
        self.client_file.write_text(
            f'cluster_file = "{CLUSTER_FILE}"\ncredentials_file = "{CREDENTIALS_FILE}"\n'
        )
        self._capacity, self._extra_args = capacity, tuple(extra_args)
        self._lease_ttl_s = lease_ttl_s
        self._nodes = []
        if etcd:
            self._start_etcd(timeout_s)
        # All ports at once: free_ports holds them open together, so they are distinct.
        ports = free_ports(2 * nodes)
        for i in range(nodes):
            self._nodes.append(
                self._new_node(i, domains[i] if domains else "", ports[2 * i : 2 * i + 2])
            )
        cmap = ClusterMap(epoch=1, nodes=tuple(n.info for n in self._nodes))
        # Written before the daemons start: they find etcd (and the status page its map) in it.
        self.cluster_file.write_text(cmap.to_toml(self.etcd_settings))
        for node in self._nodes:
            self._spawn(node)
        self._write_records()
        try:
            self.wait_healthy(timeout_s=timeout_s)
            if etcd:
                self.wait_registered(timeout_s=timeout_s)
        except ClusterError:
            self.stop()
            raise
        log.info("local cluster of %d nodes up under %s", nodes, self.root)
        return self

    def _new_node(self, i: int, domain: str, ports: list[int]) -> _Node:
        node_id = f"node-{i:02d}"
        data_port, admin_port = ports
        info = NodeInfo(
            id=node_id,
            data=f"tcp://127.0.0.1:{data_port}",
            admin=f"http://127.0.0.1:{admin_port}",
            domain=domain or node_id,
        )
        data_dir = self.root / node_id
        data_dir.mkdir(exist_ok=True)
        cmd = [
            sys.executable, "-m", "kvcache.cli", "server",
            "--node-id", node_id,
            "--data-dir", str(data_dir.resolve()),
            "--listen", info.data,
            "--admin-listen", f"127.0.0.1:{admin_port}",
            "--capacity", self._capacity,
            "--credentials", str(self.credentials_file.resolve()),
            # The status page of every daemon shows the whole cluster (read lazily); with
            # an [etcd] table the daemon registers there.
            "--cluster-file", str(self.cluster_file.resolve()),
            *(("--domain", domain) if domain else ()),
            *(("--lease-ttl", str(self._lease_ttl_s)) if self._etcd is not None else ()),
            *self._extra_args,
        ]  # fmt: skip
        return _Node(info, data_dir, 0, cmd=cmd)

    def add_node(self, *, domain: str = "", timeout_s: float = 60.0) -> NodeInfo:
        """Start one more daemon and make it a member: in etcd it joins by registering;
        with a static file, the file gets the node and a new epoch. Returns the node."""
        if not self._nodes:
            raise ClusterError("start the cluster before adding nodes")
        used = {int(u.rsplit(":", 1)[1]) for n in self._nodes for u in (n.info.data, n.info.admin)}
        ports = free_ports(2)
        while used & set(ports):  # a port a stopped node of ours had: ask again
            ports = free_ports(2)
        node = self._new_node(
            max(int(n.info.id.split("-")[1]) for n in self._nodes) + 1, domain, ports
        )
        self._spawn(node)
        self._nodes.append(node)
        self._write_records()
        self.wait_healthy(timeout_s=timeout_s, indices=[len(self._nodes) - 1])
        if self._etcd is not None:
            self.wait_registered(timeout_s=timeout_s)
        else:
            cmap = ClusterMap.load(self.cluster_file)
            updated = ClusterMap(epoch=cmap.epoch + 1, nodes=(*cmap.nodes, node.info))
            tmp = self.cluster_file.with_name(CLUSTER_FILE + ".tmp")
            tmp.write_text(updated.to_toml())
            os.replace(tmp, self.cluster_file)
        return node.info

    # -------------------------------------------------------------- etcd

    @property
    def etcd_settings(self) -> EtcdSettings | None:
        """The ``[etcd]`` table of this cluster (None without etcd)."""
        return self._etcd_settings if self._etcd is not None else None

    def _start_etcd(self, timeout_s: float) -> None:
        from kvcache.membership.localetcd import LocalEtcd

        client_port, peer_port = free_ports(2)
        etcd = LocalEtcd(
            (self.root / "etcd").resolve(),
            client_port=client_port,
            peer_port=peer_port,
            log_file=self.root / "etcd.log",
        )
        etcd.start(timeout_s=timeout_s)
        assert etcd.proc is not None
        self._etcd_settings = etcd.settings
        self._etcd = _Node(
            NodeInfo(id=ETCD_RECORD.strip("_"), data=f"tcp://127.0.0.1:{client_port}"),
            etcd.data_dir,
            etcd.pid,
            proc=etcd.proc,
            cmd=etcd.command(),
            started=_start_time(etcd.pid),
        )

    def wait_registered(self, *, timeout_s: float = 60.0) -> None:
        """Wait until every node is a live member in etcd, or raise ClusterError."""
        from kvcache.membership.localetcd import registered_ids

        settings = self.etcd_settings
        if settings is None:
            return
        want = {n.info.id for n in self._nodes}
        deadline = time.monotonic() + timeout_s
        missing = want
        while True:
            try:
                missing = want - registered_ids(settings.endpoints[0], settings.prefix)
            except ClusterError:
                missing = want
            if not missing:
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"not registered in etcd after {timeout_s}s: {sorted(missing)}")
            time.sleep(0.05)

    def _spawn(self, node: _Node) -> None:
        assert node.cmd is not None
        log_file = open(self.root / f"{node.info.id}.log", "ab")  # noqa: SIM115 - owned by the child
        proc = subprocess.Popen(
            node.cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **DAEMON_ENV},
            start_new_session=True,
        )
        log_file.close()
        node.pid, node.proc, node.started = proc.pid, proc, _start_time(proc.pid)

    def _write_records(self) -> None:
        tmp = self.root / (PIDS_FILE + ".tmp")
        records = {n.info.id: n.record() for n in self._nodes}
        if self._etcd is not None:
            records[ETCD_RECORD] = self._etcd.record()
        tmp.write_text(json.dumps(records, indent=1))
        os.replace(tmp, self.root / PIDS_FILE)

    @classmethod
    def attach(cls, root: str | Path) -> LocalCluster:
        """A handle on a cluster started earlier (by another process) under ``root``."""
        self = cls(root)
        try:
            cmap = ClusterMap.load(self.cluster_file)
            records = json.loads((self.root / PIDS_FILE).read_text())
            if not isinstance(records, dict):
                raise ValueError("not a JSON object")
        except (ConfigError, OSError, ValueError) as exc:
            raise ClusterError(f"no local cluster under {self.root}: {exc}") from None
        self._nodes = []
        for n in cmap.nodes:
            rec = records.get(n.id, {})
            if not isinstance(rec, dict):
                rec = {}
            cmd = rec.get("cmd")
            self._nodes.append(
                _Node(
                    n,
                    self.root / n.id,
                    _record_int(rec, "pid", self.root),
                    cmd=cmd if isinstance(cmd, list) else None,
                    started=_record_int(rec, "started", self.root),
                )
            )
        rec = records.get(ETCD_RECORD)
        if isinstance(rec, dict) and isinstance(rec.get("cmd"), list):
            _static, etcd = read_cluster_file(self.cluster_file)
            self._etcd = _Node(
                NodeInfo(id=ETCD_RECORD.strip("_"), data="tcp://127.0.0.1:1"),
                self.root / "etcd",
                _record_int(rec, "pid", self.root),
                cmd=rec["cmd"],
                started=_record_int(rec, "started", self.root),
            )
            self._etcd_settings = etcd
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
            attached = LocalCluster.attach(self.root)
        except ClusterError:
            return []
        nodes = [*attached._nodes, *([attached._etcd] if attached._etcd else [])]
        return [n.pid for n in nodes if _ours(n)]

    def stop(self, *, timeout_s: float = 15.0) -> None:
        """SIGTERM every daemon (SIGCONT first, in case one is paused), then SIGKILL stragglers.

        Only processes that are still the daemons this cluster started are
        signalled: same pid, same start time, same command line. A pid that
        was reused by another program is left alone (and reported).
        """
        mine = []
        for node in self._nodes:
            if node.proc is None and not _ours(node):
                if node.pid > 0 and _alive(node.pid):
                    log.warning(
                        "%s: pid %d is no longer our daemon (reused); not signalling it",
                        node.info.id,
                        node.pid,
                    )
                continue
            mine.append(node)
        for node in mine:
            _signal(node.pid, signal.SIGCONT)
            _signal(node.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for node in mine:
            while _alive(node.pid, node.proc) and time.monotonic() < deadline:
                time.sleep(0.02)
            if _alive(node.pid, node.proc):
                log.warning("%s did not stop on SIGTERM; killing it", node.info.id)
                _signal(node.pid, signal.SIGKILL)
                _reap(node)
        etcd, self._etcd = self._etcd, None
        if etcd is not None and (etcd.proc is not None or _ours(etcd)):
            _signal(etcd.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while _alive(etcd.pid, etcd.proc) and time.monotonic() < deadline:
                time.sleep(0.02)
            if _alive(etcd.pid, etcd.proc):
                _signal(etcd.pid, signal.SIGKILL)
            _reap(etcd)
        (self.root / PIDS_FILE).unlink(missing_ok=True)

    # -------------------------------------------------------------- faults

    def kill(self, index: int) -> None:
        """SIGKILL node ``index`` (as a crash would)."""
        node = self._nodes[index]
        _signal(node.pid, signal.SIGKILL)
        _reap(node)

    def terminate(self, index: int, *, timeout_s: float = 15.0) -> None:
        """SIGTERM node ``index`` and wait for it to exit (a graceful stop, as for an upgrade)."""
        node = self._nodes[index]
        _signal(node.pid, signal.SIGTERM)
        if node.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=timeout_s)
        else:  # a node of a cluster started by another process: no handle to wait on
            deadline = time.monotonic() + timeout_s
            while _alive(node.pid, node.proc) and time.monotonic() < deadline:
                time.sleep(0.02)
        if _alive(node.pid, node.proc):
            _signal(node.pid, signal.SIGKILL)
        _reap(node)

    def pause(self, index: int) -> None:
        """SIGSTOP node ``index``: it keeps its connections but answers nothing."""
        _signal(self._nodes[index].pid, signal.SIGSTOP)

    def resume(self, index: int) -> None:
        """SIGCONT a paused node."""
        _signal(self._nodes[index].pid, signal.SIGCONT)

    def restart(self, index: int, *, timeout_s: float = 30.0) -> None:
        """Start node ``index`` again with the command line it had (addresses, data
        directory, capacity, credentials and every extra flag)."""
        node = self._nodes[index]
        if _alive(node.pid, node.proc) and (node.proc is not None or _ours(node)):
            raise ClusterError(f"{node.info.id} is still running")
        if node.cmd is None:
            raise ClusterError(f"no recorded command line for {node.info.id}; restart by hand")
        self._spawn(node)
        self._write_records()
        self.wait_healthy(timeout_s=timeout_s, indices=[index])

    # -------------------------------------------------------------- status

    def node_stats(self) -> list[dict[str, Any]]:
        """Each node's /stats JSON, or an error entry."""
        out: list[dict[str, Any]] = []
        for node in self._nodes:
            try:
                with urllib.request.urlopen(f"{node.info.admin}/stats", timeout=2) as resp:
                    stats = json.loads(resp.read())
                if not isinstance(stats, dict):
                    raise ValueError(f"/stats answered {type(stats).__name__}, not an object")
                out.append({"node": node.info.id, "up": True, **stats})
            except (urllib.error.URLError, OSError, ValueError) as exc:
                out.append({"node": node.info.id, "up": False, "error": str(exc)})
        return out

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _record_int(rec: dict[str, Any], name: str, root: Path) -> int:
    """A process record's integer field (pid, start time), or ClusterError naming the file."""
    value = rec.get(name, 0) or 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise ClusterError(
            f"the local cluster's process records under {root} are damaged: {name} is "
            f"{value!r}; stop what runs there by hand and remove the directory"
        )
    return value


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


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (0 when unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            # The command name may contain spaces: fields follow its closing parenthesis.
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def _ours(node: _Node) -> bool:
    """Whether ``node.pid`` is still the daemon we started: start time and command line match."""
    if node.pid <= 0 or not _alive(node.pid):
        return False
    if node.started and _start_time(node.pid) != node.started:
        return False
    try:
        with open(f"/proc/{node.pid}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
    except OSError:
        return False
    text = [a.decode(errors="replace") for a in argv if a]
    if node.cmd is not None:
        return text == node.cmd
    return "kvcache.cli" in text and "server" in text and node.info.id in text


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
