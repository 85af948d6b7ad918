"""What a daemon's write path pays the kernel for, on this machine: the page cache's first touch.

The same 256 MiB (``--mib``) written, read and sent eight ways, in one run, in this order, CPU-seconds per GB of
this process (``getrusage``: the kernel's copies are system time):

- ``write, fresh pages``: ``pwrite`` into a new file (a segment's append; the kernel
  allocates a page-cache page per 4 KiB and copies into it);
- ``write, cached pages``: the same file written again (the pages exist);
- ``write, O_DIRECT``: a new file opened ``O_DIRECT`` (no page cache at all);
- ``read, after O_DIRECT``: that file read back with ``pread`` before anything was freed
  (its page-cache pages are new to the guest: the first touch moves to the first read);
- ``write, after anonymous memory touched and freed``: a new file, right after as many
  bytes of anonymous memory were touched and unmapped (the guest does not get them back
  cheaply);
- ``write, pages an unlink just freed``: a new file, right after the files above were
  unlinked (their page-cache pages are reused);
- ``write, a kept file after an idle`` / ``write, pages an unlink freed before an idle``:
  a file renamed aside and rewritten in place after ``--idle-s`` seconds (a daemon's
  spare segment file), against a new file written after another was unlinked and the same
  idle (what a daemon that unlinks dropped segments pays). A VM whose balloon reports
  free pages hands what the guest freed back to the host within seconds, so the second
  pays the first touch again;
- ``sendfile, cold`` / ``warm``: the O_DIRECT file sent over a loopback TCP connection with
  ``sendfile`` in 680 KB pieces (a 59-shard GET reply), first while it is not in the page
  cache (dropped with ``POSIX_FADV_DONTNEED``, after the unlinks: into reused pages) and
  then again; the receiving thread's copy is in the figure (both ends are this process).

Ratios against ``write, cached pages``. On a VM whose memory the host backs lazily (the
project's 2-core VM) the first touch of a page costs several times a copy: that is what a
daemon's PUT pays for every byte it appends (docs/benchmarks.md, eighth pass of issue 17).
Writes into the directory of ``--dir`` (default: the current one; not a tmpfs, where
O_DIRECT fails). Kept out of CI.

Usage: python bench/page_cache.py [--mib N] [--dir DIR] [--idle-s S] [--json PATH]
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import socket
import tempfile
import threading
import time
from pathlib import Path

from _common import commit, machine, print_table, write_json

CHUNK = 4 << 20
REPLY = 11_520 * 59


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(fn: object, nbytes: int) -> tuple[float, float]:
    """(GB/s, CPU-s/GB) of fn() moving nbytes."""
    c, t = _cpu(), time.perf_counter()
    fn()  # type: ignore[operator]
    dt, dc = time.perf_counter() - t, _cpu() - c
    return nbytes / dt / 1e9, dc / (nbytes / 1e9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--dir", type=Path, default=Path.cwd())
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    total = args.mib << 20
    buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(CHUNK))
    work = Path(tempfile.mkdtemp(prefix="kvcache-pagecache-", dir=args.dir))
    results: dict[str, tuple[float, float]] = {}

    def write(path: Path, flags: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
        try:
            for off in range(0, total, CHUNK):
                os.pwrite(fd, buf, off)
        finally:
            os.close(fd)

    def read(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            for off in range(0, total, CHUNK):
                os.pread(fd, CHUNK, off)
        finally:
            os.close(fd)

    def touch_anonymous() -> None:
        anon = mmap.mmap(-1, total)
        for off in range(0, total, mmap.PAGESIZE):
            anon[off] = 1
        anon.close()

    fresh = work / "fresh.bin"
    results["write, fresh pages"] = _timed(lambda: write(fresh, 0), total)
    results["write, cached pages"] = _timed(lambda: write(fresh, 0), total)
    direct = work / "direct.bin"
    results["write, O_DIRECT"] = _timed(lambda: write(direct, os.O_DIRECT), total)
    # Nothing freed yet: the read fills page-cache pages the guest has not touched.
    results["read, after O_DIRECT"] = _timed(lambda: read(direct), total)
    touch_anonymous()
    anon = work / "anon.bin"
    results["write, after anonymous memory touched and freed"] = _timed(
        lambda: write(anon, 0), total
    )
    fresh.unlink()
    anon.unlink()
    reuse = work / "reuse.bin"
    results["write, pages an unlink just freed"] = _timed(lambda: write(reuse, 0), total)
    kept = work / "kept.spare"
    os.replace(reuse, kept)  # kept aside, as a daemon keeps a dropped segment's file
    write(work / "gone.bin", 0)
    (work / "gone.bin").unlink()  # freed, as a daemon that unlinks drops it
    time.sleep(args.idle_s)
    results["write, a kept file after an idle"] = _timed(lambda: write(kept, 0), total)
    after_idle = work / "after-idle.bin"
    results["write, pages an unlink freed before an idle"] = _timed(
        lambda: write(after_idle, 0), total
    )
    kept.unlink()
    after_idle.unlink()
    fd = os.open(direct, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the sends below start cold
    os.close(fd)

    server = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()

    def drain() -> None:
        into = bytearray(1 << 20)
        while receiver.recv_into(into):
            pass

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()

    def send() -> None:
        fd = os.open(direct, os.O_RDONLY)
        try:
            off = 0
            while off < total:
                off += os.sendfile(sender.fileno(), fd, off, min(REPLY, total - off))
        finally:
            os.close(fd)

    results["sendfile, cold"] = _timed(send, total)
    results["sendfile, warm"] = _timed(send, total)
    sender.close()
    reader.join(10)
    receiver.close()
    server.close()
    direct.unlink()
    work.rmdir()
    base = results["write, cached pages"][1]
    print(f"page cache costs — commit {commit()}, {machine()}, {args.mib} MiB in {args.dir}")
    print_table(
        "CPU-seconds per GB of this process (kernel copies included)",
        ["case", "GB/s", "CPU-s/GB", "÷ write, cached pages"],
        [[k, f"{g:.2f}", f"{c:.3f}", f"{c / base:.2f}x"] for k, (g, c) in results.items()],
    )
    figures = {"commit": commit(), "machine": machine(), "mib": args.mib, "idle_s": args.idle_s}
    for k, (g, c) in results.items():
        key = k.replace(", ", "_").replace(" ", "_").replace("O_DIRECT", "odirect").lower()
        figures[f"{key}_gbps"], figures[f"{key}_cpu_s_per_gb"] = g, c
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
