"""Client processes loading one stored prompt together: ``engine_gpu.py --scaling``.

Parent side, :func:`run_together`: starts N copies of this file at once. Each reads its spec
(JSON) on stdin, connects, loads the prompt once to warm up, prints ``READY`` and blocks
reading a "go" pipe that all N share. When every worker is ready the parent closes the
pipe's write end, so all of them see end-of-file at the same moment (a barrier, not a
sleep) and load the prompt again and again for ``seconds``, recording each load's start,
end and bytes on ``CLOCK_MONOTONIC`` (one clock for the whole host).

The aggregate GB/s counts only the *common interval*, from the last worker's first start to
the first worker's last end, when all N were loading: bytes of the loads inside it, a load
that straddles an edge counted in proportion to its overlap, divided by its length
(:func:`common_rate`).

CPU: each worker measures its own process (``getrusage(RUSAGE_SELF)``: all its threads) and
its client's I/O processes (``/proc/<pid>/stat`` utime + stime), from the barrier to its last
load; ``client_cores_busy`` is the workers' CPU-seconds together divided by the wall seconds
from the first start to the last end.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: (start, end, bytes) of one load, start and end on CLOCK_MONOTONIC.
Load = tuple[float, float, int]


def now() -> float:
    """Seconds on CLOCK_MONOTONIC: the same clock in every process of the host."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def process_cpu(pids: Sequence[int]) -> float:
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


def self_cpu() -> float:
    """User + system seconds of this process, all its threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def common_rate(workers: Sequence[Sequence[Load]]) -> tuple[float, float, float]:
    """(bytes per second, interval start, interval end) over the common interval.

    The interval runs from the latest first start to the earliest last end among the
    workers; a load overlapping an edge contributes its bytes times the fraction of its
    duration inside. Raises ValueError when the workers never all ran at once.
    """
    if not workers or any(not loads for loads in workers):
        raise ValueError("every worker needs at least one load")
    lo = max(loads[0][0] for loads in workers)
    hi = min(loads[-1][1] for loads in workers)
    if hi <= lo:
        raise ValueError(f"the workers never ran together (interval {lo:.3f}..{hi:.3f})")
    moved = 0.0
    for loads in workers:
        for start, end, nbytes in loads:
            inside = min(end, hi) - max(start, lo)
            if inside > 0:
                moved += nbytes * inside / (end - start)
    return moved / (hi - lo), lo, hi


def run_together(
    spec: dict[str, Any], processes: int, *, timeout_s: float = 300.0
) -> dict[str, Any]:
    """Start ``processes`` workers at once, release them together, and sum them up.

    ``spec``: client_file, namespace {model, revision}, layout {tokens_per_block,
    bytes_per_token, layers_in_block}, tokens (list), seconds, overrides (ClientConfig
    fields). Returns processes, gbps (common interval), interval_s, start_spread_s (how far
    apart the workers' first loads began), cpu_s_per_gb, client_cores_busy, loads.
    """
    go_read, go_write = os.pipe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        payload = json.dumps(spec).encode()
        for _ in range(processes):
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), str(go_read)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(go_read,), env=env,
            )  # fmt: skip
            assert proc.stdin is not None
            proc.stdin.write(payload)
            proc.stdin.close()
            procs.append(proc)
        os.close(go_read)
        go_read = -1
        for proc in procs:
            assert proc.stdout is not None
            while (line := proc.stdout.readline()).strip() != b"READY":
                if not line:
                    raise RuntimeError(f"a load worker failed to start (exit {proc.wait(30)})")
        os.close(go_write)  # every worker's read of the pipe returns end-of-file now
        go_write = -1
        results = []
        for proc in procs:
            assert proc.stdout is not None
            out = proc.stdout.read()
            if proc.wait(timeout_s) != 0:
                raise RuntimeError(f"a load worker exited with {proc.returncode}")
            results.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for fd in (go_read, go_write):
            if fd >= 0:
                os.close(fd)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    loads = [[(float(a), float(b), int(n)) for a, b, n in r["loads"]] for r in results]
    rate, lo, hi = common_rate(loads)
    moved = sum(n for worker in loads for _, _, n in worker)
    cpu = sum(float(r["cpu_s"]) for r in results)
    first = min(w[0][0] for w in loads)
    last = max(w[-1][1] for w in loads)
    return {
        "processes": processes,
        "gbps": rate / 1e9,
        "interval_s": hi - lo,
        "start_spread_s": max(w[0][0] for w in loads) - first,
        "cpu_s_per_gb": cpu / (moved / 1e9),
        "client_cores_busy": cpu / (last - first),
        "loads": sum(len(w) for w in loads),
    }


def worker(go_fd: int) -> None:
    """One client process: warm up, say READY, wait for the go pipe to close, load."""
    import numpy as np

    from kvcache.client import Client, ClientConfig
    from kvcache.keys import Namespace
    from kvcache.layout import DType, KVLayout

    spec = json.loads(sys.stdin.buffer.read())
    layout = KVLayout(dtype=DType.BFLOAT16, **spec["layout"])
    space = Namespace(layout=layout, **spec["namespace"])
    tokens = np.array(spec["tokens"], np.uint32)
    config = ClientConfig.load(spec["client_file"], overrides=spec.get("overrides", {}))
    with Client(config) as client:
        match = client.match_prefix(space, tokens)
        want = match.hit_blocks * layout.payload_bytes
        if match.hit_blocks == 0:
            raise SystemExit("load worker: the prompt is not stored")
        out = client.alloc_buffer(match.hit_blocks, layout.payload_bytes)
        client.load(space, match, out=out)
        print("READY", flush=True)
        while os.read(go_fd, 1):
            pass
        cpu0, started = self_cpu() + process_cpu(client.io_pids), now()
        deadline = started + float(spec["seconds"])
        loads: list[Load] = []
        while not loads or loads[-1][1] < deadline:
            t0 = now()
            got = client.load(space, client.match_prefix(space, tokens), out=out).bytes_loaded
            loads.append((t0, now(), got))
            if got != want:
                raise SystemExit(f"load worker: loaded {got} of {want} bytes")
        cpu = self_cpu() + process_cpu(client.io_pids) - cpu0
    print(json.dumps({"loads": loads, "cpu_s": cpu}), flush=True)


if __name__ == "__main__":
    worker(int(sys.argv[1]))
