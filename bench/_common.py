"""Shared bits of the benchmark scripts: argument parsing, timing, tables, JSON output."""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def time_calls(
    owner: Any,
    name: str,
    label: str,
    spent: collections.Counter[str],
    calls: collections.Counter[str] | None = None,
) -> None:
    """Wrap ``owner.name`` (a function of a class or module) so that each call adds the
    thread CPU it took (ns) to ``spent[label]`` and one to ``calls[label]``: where a
    phase's CPU goes (nested phases overlap; the wrapper costs about a microsecond)."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] += time.thread_time_ns() - start
            if calls is not None:
                calls[label] += 1

    setattr(owner, name, timed)


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every bench script takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a short run (at most about 60 s)")
    p.add_argument("--json", type=Path, help="write every printed figure as a flat JSON object")
    return p


def best_of(fn: Callable[[], Any], repeat: int) -> float:
    """Fastest of ``repeat`` timed calls, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def machine() -> str:
    """CPU model and core count, for the record."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def commit() -> str:
    """The git commit the benchmark ran on (with +dirty if the tree has changes).

    ``KVCACHE_COMMIT`` overrides it, for machines that get a copy of the tree without .git.
    """
    if os.environ.get("KVCACHE_COMMIT"):
        return os.environ["KVCACHE_COMMIT"]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], capture_output=True, text=True
        ).stdout
        return sha + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def processes_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` (all their threads) have used, from
    /proc/PID/stat; raises OSError for a process that is gone."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        # The command name may contain spaces: the fields follow its closing parenthesis.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """A markdown table."""
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def write_json(path: Path | None, figures: dict[str, Any]) -> None:
    """Write the flat figures object if asked."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")


def _touch(gib: float) -> float:
    import numpy as np

    start = time.perf_counter()
    block = np.ones(int(gib * 2**30), np.uint8)
    spent = time.perf_counter() - start
    del block
    return spent / gib


def warm_host(gib: float) -> str:
    """Touch ``gib`` GiB of this host's memory once, one process a core, and free it.

    A host in service has used its RAM before. A VM that has just booted backs its RAM
    lazily, and the first touch of a page costs several times a later one (about 2.8
    CPU-s/GiB against 0.3 on the 2-core VM): benchmarks that fill the page cache, as a
    daemon's fresh PUTs do, would measure that instead of the store. Returns what it cost,
    for the run's output.

    It helps little on a VM whose balloon reports free pages to its host, as the 2-core
    VM's does now: memory the guest frees goes back seconds later (``bench/page_cache.py``:
    a new file written 2 s after an unlink cost 1.12x a write into cached pages, 10 s
    after it 21x, as a first touch), so what a benchmark does not use within seconds is
    cold again. What a daemon keeps (its spare segment files, docs/server.md) stays warm;
    what it frees does not."""
    if gib <= 0:
        return "host memory not warmed"
    spent, per_gib = warm_host_cost(gib)
    return (
        f"host memory warmed: {gib:g} GiB touched in {spent:.1f} s ({per_gib:.2f} s/GiB a process)"
    )


def warm_host_cost(gib: float) -> tuple[float, float]:
    """:func:`warm_host`'s touch; (seconds it took, the slowest process's seconds a GiB)."""
    import multiprocessing

    workers = max(1, os.cpu_count() or 1)
    start = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        costs = pool.map(_touch, [gib / workers] * workers)
    return time.perf_counter() - start, max(costs)
