"""Peers benchmark: kvcache vs two other open-source KV-cache stores, on the same blocks.

Puts the same 112 KiB blocks (114,688 bytes each) through, one system at a time, on loopback:

- kvcache: 12 local daemons (LocalCluster, 10+2 Reed-Solomon), the client in this process;
  PUT = ``store_keys``, GET = ``load_keys`` of the stored keys into a preallocated array (one
  round trip: the keys are known, as Mooncake's and LMCache's GETs name theirs; a miss would
  end the loaded prefix, and is counted as a failure).
- Mooncake Store over TCP (``mooncake-transfer-engine-non-cuda``): ``mooncake_master`` with its
  embedded HTTP metadata server, plus a ``mooncake_client`` process that holds the memory
  segment, so the benchmark process is a pure client (``global_segment_size=0``);
  PUT = ``batch_put_from``, GET = ``batch_get_into`` (zero-copy from/into registered buffers).
- LMCache server (``lmcache``): ``python -m lmcache.v1.server 127.0.0.1 PORT cpu``, driven with
  LMCache's remote-server protocol (``lmcache.v1.protocol`` messages, as its
  ``LMCServerConnector`` sends them) on one connection, pipelined: a batch's requests are all
  sent before the replies are read. A PUT has no reply, so each PUT batch ends with an EXIST
  round trip (the server handles one connection's commands in order).

For each system: N blocks (1024; 256 with --quick) in calls of 64 blocks, best of R rounds
(5; 3 with --quick). Every round writes fresh keys (a store may skip a key it already has:
Mooncake does) and reads them back into a zeroed buffer; the bytes of every block are checked
outside the timing, and wrong bytes are reported. GB/s = N * 114,688 bytes / seconds / 1e9.

CPU-seconds per GB moved, all processes of a system together: the client's and the servers',
summed over every round's timed PUT (or GET) loop and divided by the GB those loops moved
(``<system>_cpu_s_per_gb_get`` / ``_put``, with ``_client_`` and ``_server_`` parts). The
client is the process that runs the loops, measured with ``getrusage(RUSAGE_SELF)`` (all its
threads; for kvcache also its I/O worker processes, if any, from /proc). The servers are
read from ``/proc/<pid>/stat`` (utime + stime, all threads) just before and after each timed
loop: for kvcache the 12 daemons of the LocalCluster, for Mooncake ``mooncake_master`` and
the ``mooncake_client`` that holds the segment, for LMCache its server. /proc counts in clock
ticks (10 ms), so short runs (``--quick``) carry a few ticks of error per process.

Each peer runs from its own venv (made by bench/peers_env.sh, under
~/.cache/kvcache/peers/<name>, or $KVCACHE_PEERS_DIR), never in the project's: this file
starts the peer's servers from that venv and runs itself there in worker mode (``--worker``),
which times the loops and prints its figures as JSON. A peer that cannot be installed or
started is reported in its table row; the others still run. Kept out of CI.

Usage: bash bench/peers_env.sh && .venv/bin/python bench/peers.py [--quick] [--json PATH]
[--warm-host-gb G]
(on the H200 host, with the peers' wheels carried: scripts/peers-gpu.sh, one peer a call)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

P = 114_688  # bytes per block (112 KiB)
BATCH = 64  # blocks per call
PEERS_DIR = Path(os.environ.get("KVCACHE_PEERS_DIR", Path.home() / ".cache/kvcache/peers"))
RESULT_TAG = "PEERS-RESULT "
# The mooncake_client's segment; each round's blocks are removed before the next round.
MOONCAKE_SEGMENT = "1GB"


# ---------------------------------------------------------------------------------------------
# The measurement, shared by the kvcache side (this process) and the workers (peer venvs).


def process_cpu(pids: list[int]) -> float:
    """User + system seconds of other processes (all their threads), from /proc/<pid>/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass  # gone: it counted up to its last read
    return total


class CpuMeter:
    """CPU seconds of the client (this process, plus ``client_pids``) and of the servers."""

    def __init__(self, server_pids: list[int], client_pids: list[int]) -> None:
        self.server_pids, self.client_pids = server_pids, client_pids
        self.spent = {"put_client": 0.0, "put_server": 0.0, "get_client": 0.0, "get_server": 0.0}

    def read(self) -> tuple[float, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        client = usage.ru_utime + usage.ru_stime + process_cpu(self.client_pids)
        return client, process_cpu(self.server_pids)

    def add(self, op: str, start: tuple[float, float]) -> None:
        client, server = self.read()
        self.spent[f"{op}_client"] += client - start[0]
        self.spent[f"{op}_server"] += server - start[1]


def run_rounds(
    system: Any, blocks: np.ndarray, n: int, rounds: int, server_pids: list[int]
) -> dict[str, Any]:
    """Time PUT and GET of ``n`` blocks, best of ``rounds``; check every byte outside the timing.

    ``system`` has ``out`` (an (n, P) uint8 array that GETs land in), ``begin_round(r)``
    (untimed setup: fresh keys), ``put(r, lo, hi, src)`` and ``get(r, lo, hi, out)``; these
    raise on any failed block; optionally ``client_pids`` (its other client processes).
    Round ``r`` writes ``blocks[r : r + n]``, so each round stores different bytes under
    its keys and a stale or misdirected read shows as wrong bytes. CPU of the client and
    of ``server_pids`` is summed over the timed loops of all rounds.
    """
    put_ts: list[float] = []
    get_ts: list[float] = []
    wrong = 0
    out = system.out
    meter = CpuMeter(server_pids, list(getattr(system, "client_pids", [])))
    for r in range(rounds):
        src = blocks[r : r + n]
        system.begin_round(r)
        cpu = meter.read()
        t = time.perf_counter()
        for lo in range(0, n, BATCH):
            system.put(r, lo, min(lo + BATCH, n), src)
        put_ts.append(time.perf_counter() - t)
        meter.add("put", cpu)
        out.fill(0)
        cpu = meter.read()
        t = time.perf_counter()
        for lo in range(0, n, BATCH):
            system.get(r, lo, min(lo + BATCH, n), out)
        get_ts.append(time.perf_counter() - t)
        meter.add("get", cpu)
        wrong += int(np.count_nonzero(out != src))
    total = n * P
    moved_gb = total * rounds / 1e9
    res: dict[str, Any] = {
        "get_gbps": total / min(get_ts) / 1e9,
        "put_gbps": total / min(put_ts) / 1e9,
        "get_rounds_gbps": [round(total / t / 1e9, 3) for t in get_ts],
        "put_rounds_gbps": [round(total / t / 1e9, 3) for t in put_ts],
        "wrong_bytes": wrong,
        "server_processes": len(server_pids),
    }
    for op in ("get", "put"):
        client = meter.spent[f"{op}_client"] / moved_gb
        server = meter.spent[f"{op}_server"] / moved_gb
        res[f"client_cpu_s_per_gb_{op}"] = client
        res[f"server_cpu_s_per_gb_{op}"] = server
        res[f"cpu_s_per_gb_{op}"] = client + server
    return res


# ---------------------------------------------------------------------------------------------
# kvcache: the only part that touches the kvcache API. In this process, project venv.


def bench_kvcache(blocks: np.ndarray, n: int, rounds: int, tmp: Path) -> dict[str, Any]:
    """kvcache: 12 local daemons, one in-process client, 64-block store_keys / load_keys."""
    from kvcache.client import Client, ClientConfig
    from kvcache.testing.localcluster import LocalCluster

    class Kvcache:
        def __init__(self, client: Any) -> None:
            self.client = client
            self.client_pids = list(getattr(client, "io_pids", []))
            self.out = np.empty((n, P), np.uint8)
            self.keys: list[bytes] = []

        def begin_round(self, r: int) -> None:
            self.keys = [os.urandom(16) for _ in range(n)]

        def put(self, r: int, lo: int, hi: int, src: np.ndarray) -> None:
            res = self.client.store_keys(self.keys[lo:hi], src[lo:hi], payload_len=P)
            if res.written != hi - lo:
                raise RuntimeError(f"store_keys wrote {res.written} of {hi - lo} blocks")

        def get(self, r: int, lo: int, hi: int, out: np.ndarray) -> None:
            loaded = self.client.load_keys(self.keys[lo:hi], payload_len=P, out=out[lo:hi])
            if loaded.blocks != hi - lo:
                raise RuntimeError(f"load_keys loaded {loaded.blocks} of {hi - lo} blocks")

    with LocalCluster(tmp / "kvcache").start(nodes=12, capacity="2GiB") as cluster:
        make_config = getattr(cluster, "client_config", None)
        config = make_config() if make_config else ClientConfig(cluster_file=cluster.cluster_file)
        daemons = [cluster.pid(i) for i in range(12)]
        with Client(config) as client:
            res = run_rounds(Kvcache(client), blocks, n, rounds, daemons)
    res["notes"] = "12 daemons, 10+2 RS; store_keys / load_keys (known keys), 64 blocks a call"
    return res


# ---------------------------------------------------------------------------------------------
# Workers: run with a peer's venv python (``peers.py --worker NAME --spec JSON``).


class Mooncake:
    """Mooncake Store client with no segment of its own; zero-copy batch calls."""

    def __init__(self, spec: dict[str, Any], blocks: np.ndarray) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            "127.0.0.1",  # local_hostname
            spec["metadata_server"],
            0,  # global_segment_size: the mooncake_client process holds the memory
            0,  # local_buffer_size: not needed for the *_from / *_into calls
            "tcp",
            "",  # rdma_devices
            spec["master"],
        )
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        n = spec["n"]
        self.blocks = blocks
        self.out = np.empty((n, P), np.uint8)
        for arr in (blocks, self.out):
            rc = self.store.register_buffer(arr.ctypes.data, arr.nbytes)
            if rc != 0:
                raise RuntimeError(f"register_buffer returned {rc}")
        self.keys: list[str] = []
        # The segment is mounted by mooncake_client shortly after it starts: wait for a PUT.
        deadline = time.monotonic() + 30
        while (rc := self.store.put_from("peers-warmup", blocks.ctypes.data, P)) != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no Mooncake segment to write to (put_from returned {rc})")
            time.sleep(0.2)
        self.store.remove("peers-warmup", True)

    def begin_round(self, r: int) -> None:
        if r:
            self.store.remove_all(True)  # force: the read leases (10 s) are still held
        self.keys = [f"peers-r{r}-{i}" for i in range(len(self.out))]
        self.base = self.blocks.ctypes.data + r * P

    def put(self, r: int, lo: int, hi: int, src: np.ndarray) -> None:
        ptrs = [self.base + i * P for i in range(lo, hi)]
        rcs = self.store.batch_put_from(self.keys[lo:hi], ptrs, [P] * (hi - lo))
        bad = [rc for rc in rcs if rc != 0]
        if bad:
            raise RuntimeError(f"batch_put_from: {len(bad)} of {hi - lo} failed (rc {bad[0]})")

    def get(self, r: int, lo: int, hi: int, out: np.ndarray) -> None:
        base = self.out.ctypes.data
        ptrs = [base + i * P for i in range(lo, hi)]
        sizes = self.store.batch_get_into(self.keys[lo:hi], ptrs, [P] * (hi - lo))
        bad = [s for s in sizes if s != P]
        if bad:
            raise RuntimeError(f"batch_get_into: {len(bad)} of {hi - lo} failed (got {bad[0]})")

    def close(self) -> None:
        self.store.remove_all(True)
        for arr in (self.blocks, self.out):
            self.store.unregister_buffer(arr.ctypes.data)
        self.store.close()


class LMCache:
    """LMCache's remote-server protocol on one socket, 64 requests in flight per batch."""

    def __init__(self, spec: dict[str, Any], blocks: np.ndarray) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.protocol import (
            ClientCommand,
            ClientMetaMessage,
            ServerMetaMessage,
            ServerReturnCode,
        )

        self.key_cls, self.msg, self.reply = CacheEngineKey, ClientMetaMessage, ServerMetaMessage
        self.cmd, self.ok = ClientCommand, ServerReturnCode.SUCCESS
        self.fmt, self.dtype = MemoryFormat.BINARY, torch.uint8
        self.shape, self.no_shape = torch.Size([P]), torch.Size([0, 0, 0, 0])
        self.reply_len = ServerMetaMessage.packlength()
        self.sock = socket.create_connection(("127.0.0.1", spec["port"]))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.out = np.empty((spec["n"], P), np.uint8)
        self.keys: list[Any] = []
        self.header = bytearray(self.reply_len)

    def begin_round(self, r: int) -> None:
        self.keys = [
            self.key_cls("peers", 1, 0, r * 1_000_000 + i, self.dtype) for i in range(len(self.out))
        ]

    def _request(self, command: Any, key: Any, length: int, shape: Any) -> bytes:
        return bytes(self.msg(command, key, length, self.fmt, self.dtype, shape).serialize())

    def _recv_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise RuntimeError("LMCache server closed the connection")
            got += k

    def _reply(self) -> Any:
        self._recv_into(memoryview(self.header))
        return self.reply.deserialize(bytes(self.header))

    def put(self, r: int, lo: int, hi: int, src: np.ndarray) -> None:
        for i in range(lo, hi):
            self.sock.sendall(self._request(self.cmd.PUT, self.keys[i], P, self.shape))
            self.sock.sendall(memoryview(src[i]))
        # PUT has no reply: an EXIST of the batch's last key returns once all are stored.
        self.sock.sendall(self._request(self.cmd.EXIST, self.keys[hi - 1], 0, self.no_shape))
        if self._reply().code != self.ok:
            raise RuntimeError("LMCache: the last key of a PUT batch is not stored")

    def get(self, r: int, lo: int, hi: int, out: np.ndarray) -> None:
        self.sock.sendall(
            b"".join(
                self._request(self.cmd.GET, self.keys[i], 0, self.no_shape) for i in range(lo, hi)
            )
        )
        for i in range(lo, hi):
            meta = self._reply()
            if meta.code != self.ok or meta.length != P:
                raise RuntimeError(f"LMCache GET failed: code {meta.code}, length {meta.length}")
            self._recv_into(memoryview(out[i]))

    def close(self) -> None:
        self.sock.close()


WORKERS: dict[str, type] = {"mooncake": Mooncake, "lmcache": LMCache}


def worker(name: str, spec: dict[str, Any]) -> None:
    blocks = np.fromfile(spec["blocks"], dtype=np.uint8).reshape(-1, P)
    system = WORKERS[name](spec, blocks)
    try:
        res = run_rounds(system, blocks, spec["n"], spec["rounds"], spec["server_pids"])
    finally:
        system.close()
    print(RESULT_TAG + json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------------
# The driver: starts each peer's servers from its venv, runs its worker, stops everything.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 5) -> str:
    try:
        return " / ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


class Procs:
    """Processes started here, each ended by its pid (SIGTERM, then SIGKILL) on close."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Path:
        log = self.tmp / f"{name}.log"
        with log.open("wb") as f:
            proc = subprocess.Popen(
                argv, cwd=self.tmp, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )  # fmt: skip
        self.procs.append(proc)
        return log

    def wait_port(self, port: int, log: Path, timeout_s: float = 60.0) -> None:
        proc = self.procs[-1]
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{log.stem} exited with {proc.returncode}: {tail(log)}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{log.stem} not listening on {port}: {tail(log)}") from None
                time.sleep(0.1)

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self.procs.clear()


@contextmanager
def procs(tmp: Path) -> Iterator[Procs]:
    p = Procs(tmp)
    try:
        yield p
    finally:
        p.close()


def run_worker(py: Path, name: str, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    log = tmp / f"{name}-worker.log"
    with log.open("wb") as err:
        done = subprocess.run(
            [str(py), str(Path(__file__).resolve()), "--worker", name, "--spec", json.dumps(spec)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, timeout=600,
            cwd=tmp, env={**os.environ, **spec.get("env", {})},
        )  # fmt: skip
    for line in done.stdout.decode(errors="replace").splitlines():
        if line.startswith(RESULT_TAG):
            return dict(json.loads(line[len(RESULT_TAG) :]))
    lines = [
        ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln or "error" in ln
    ]
    why = lines[-1].strip() if lines else tail(log, 2)
    raise RuntimeError(f"worker exited with {done.returncode}: {why[:300]}")


def bench_mooncake(py: Path, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    bindir = py.parent
    http, rpc, metrics, client = (free_port() for _ in range(4))
    env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    with procs(tmp) as ps:
        log = ps.start(
            "mooncake_master",
            [str(bindir / "mooncake_master"), "-enable_http_metadata_server=true",
             "-http_metadata_server_host=127.0.0.1", f"-http_metadata_server_port={http}",
             "-rpc_address=127.0.0.1", f"-rpc_port={rpc}",
             "-metrics_host=127.0.0.1", f"-metrics_port={metrics}", f"-log_dir={tmp}"],
            env,
        )  # fmt: skip
        ps.wait_port(rpc, log)
        ps.wait_port(http, log)
        metadata = f"http://127.0.0.1:{http}/metadata"
        log = ps.start(
            "mooncake_client",
            [str(bindir / "mooncake_client"), "-host=127.0.0.1", f"-port={client}",
             f"-master_server_address=127.0.0.1:{rpc}", f"-metadata_server={metadata}",
             f"-global_segment_size={MOONCAKE_SEGMENT}", "-protocol=tcp", f"-log_dir={tmp}"],
            env,
        )  # fmt: skip
        ps.wait_port(client, log)
        # mooncake_master and mooncake_client exec their binaries: the pids are the servers'.
        spec = {**spec, "metadata_server": metadata, "master": f"127.0.0.1:{rpc}", "env": env,
                "server_pids": ps.pids}  # fmt: skip
        res = run_worker(py, "mooncake", spec, tmp)
    res["notes"] = (
        f"TCP; batch_put_from / batch_get_into, 64 keys a call; segment ({MOONCAKE_SEGMENT}) in a"
        " separate mooncake_client process"
    )
    return res


def bench_lmcache(py: Path, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    port = free_port()
    with procs(tmp) as ps:
        log = ps.start("lmcache_server", [str(py), "-m", "lmcache.v1.server", "127.0.0.1",
                                          str(port), "cpu"])  # fmt: skip
        ps.wait_port(port, log, timeout_s=120)
        res = run_worker(py, "lmcache", {**spec, "port": port, "server_pids": ps.pids}, tmp)
    res["notes"] = "lmcache.v1.server (cpu); its wire protocol, 64 requests pipelined on 1 conn"
    return res


SYSTEMS = {
    "kvcache": "kvcache",
    "mooncake": "Mooncake Store",
    "lmcache": "LMCache server",
}


def guarded(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    try:
        return fn(*args)
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}"
        # A log named in the message is gone with the temp dir: keep its last line.
        for name in re.findall(r"(/\S+\.log)\b", msg):
            last = tail(Path(name), 1)
            if last:
                msg += f" [{Path(name).name}: {last[-200:]}]"
        print(f"  failed: {msg}", file=sys.stderr)
        return {"error": msg.replace("|", "/").replace("\n", " ")[:500]}


def run_all(chosen: list[str], n: int, rounds: int, tmp: Path) -> dict[str, dict[str, Any]]:
    """Each chosen system in turn, alone on the machine; a failure becomes its row's note."""
    results: dict[str, dict[str, Any]] = {}
    # Round r uses blocks[r : r + n]: the same bytes for every system (one file, read by all).
    blocks = np.random.default_rng(2024).integers(0, 256, (n + rounds - 1, P), dtype=np.uint8)
    blocks.tofile(tmp / "blocks.u8")
    spec = {"blocks": str(tmp / "blocks.u8"), "n": n, "rounds": rounds}
    for name in chosen:
        print(f"{SYSTEMS[name]}: {n} blocks, best of {rounds} ...", file=sys.stderr)
        sub = tmp / name
        sub.mkdir()
        if name == "kvcache":
            results[name] = guarded(bench_kvcache, blocks, n, rounds, sub)
            continue
        py = PEERS_DIR / name / "bin" / "python"
        if not py.exists():
            results[name] = {
                "error": f"not installed ({py} missing): run bash bench/peers_env.sh {name}"
            }
            continue
        bench = bench_mooncake if name == "mooncake" else bench_lmcache
        results[name] = guarded(bench, py, spec, sub)
    for name, res in results.items():
        if "error" not in res:
            print(
                f"  {name}: GET GB/s by round {res['get_rounds_gbps']}, "
                f"PUT GB/s by round {res['put_rounds_gbps']}",
                file=sys.stderr,
            )
    return results


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import commit, machine, parser, print_table, warm_host, write_json

    p = parser(__doc__ or "")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument(
        "--only", action="append", choices=list(SYSTEMS), help="run only these systems (repeatable)"
    )
    p.add_argument("--keep", action="store_true", help="keep the temp dir (servers' logs)")
    p.add_argument(
        "--warm-host-gb", type=float, default=0.0,
        help="touch this much host memory first (a fresh VM's first touch of a page is slow)",
    )  # fmt: skip
    args = p.parse_args()
    print(warm_host(args.warm_host_gb), flush=True)
    n = 256 if args.quick else 1024
    rounds = 3 if args.quick else 5
    tmp = Path(tempfile.mkdtemp(prefix="kvcache-peers-"))
    if args.keep:
        print(f"servers' logs and data under {tmp} (kept)", file=sys.stderr)
    try:
        results = run_all(args.only or list(SYSTEMS), n, rounds, tmp)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    figures: dict[str, Any] = {"commit": commit(), "machine": machine(), "blocks": n}
    figures.update({"block_bytes": P, "rounds": rounds, "batch": BATCH})
    base = results.get("kvcache", {})
    rows = []
    for name, res in results.items():
        if "error" in res:
            figures[f"{name}_error"] = res["error"]
            rows.append(
                [SYSTEMS[name], "-", "-", "-", "-", "-", "-", f"did not run: {res['error']}"]
            )
            continue
        cells = [SYSTEMS[name], f"{res['get_gbps']:.2f}", f"{res['put_gbps']:.2f}"]
        for op in ("get", "put"):
            figures[f"{name}_{op}_gbps"] = res[f"{op}_gbps"]
            if f"{op}_gbps" in base:
                ratio = res[f"{op}_gbps"] / base[f"{op}_gbps"]
                figures[f"{name}_{op}_vs_kvcache"] = ratio
                cells.append(f"{ratio:.2f}x")
            else:
                cells.append("-")
        for op in ("get", "put"):
            for part in ("", "client_", "server_"):
                figures[f"{name}_{part}cpu_s_per_gb_{op}"] = res[f"{part}cpu_s_per_gb_{op}"]
            cells.append(
                f"{res[f'client_cpu_s_per_gb_{op}']:.2f} + {res[f'server_cpu_s_per_gb_{op}']:.2f}"
                f" = {res[f'cpu_s_per_gb_{op}']:.2f}"
            )
        figures[f"{name}_wrong_bytes"] = res["wrong_bytes"]
        notes = res["notes"]
        for op in ("GET", "PUT"):
            by_round = res.get(f"{op.lower()}_rounds_gbps") or [1.0]
            if max(by_round) > 1.5 * min(by_round):
                notes += f"; {op} by round {min(by_round):.2f}-{max(by_round):.2f}"
        if res["wrong_bytes"]:
            notes = f"WRONG BYTES: {res['wrong_bytes']}; {notes}"
        rows.append([*cells, notes])

    print(f"KV-cache stores side by side — commit {figures['commit']}, {figures['machine']}")
    print(
        f"{n} blocks of {P} bytes ({n * P / 1e6:.0f} MB), {BATCH} blocks a call, best of {rounds}"
    )
    print_table(
        "GET / PUT throughput, same blocks, loopback (vs kvcache = this system ÷ kvcache)",
        [
            "system",
            "GET GB/s",
            "PUT GB/s",
            "GET vs kvcache",
            "PUT vs kvcache",
            "GET CPU-s/GB (client + servers)",
            "PUT CPU-s/GB (client + servers)",
            "notes",
        ],
        rows,
    )
    wrong = sum(r.get("wrong_bytes", 0) for r in results.values())
    print(f"\nwrong bytes: {wrong}")
    write_json(args.json, figures)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        w = argparse.ArgumentParser()
        w.add_argument("--worker", choices=list(WORKERS), required=True)
        w.add_argument("--spec", required=True)
        wa = w.parse_args()
        worker(wa.worker, json.loads(wa.spec))
    else:
        main()
