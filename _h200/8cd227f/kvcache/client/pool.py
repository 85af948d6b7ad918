"""An I/O pool: loads and stores spread over worker processes writing into shared memory.

One Python process moves about 3 GB/s through this client on the 16-core H200
host (0.6 CPU-seconds per GB, most of it the kernel's socket copies and the
payload hashes, the rest Python under one GIL), while N independent processes
against the same daemons scaled linearly to 23.6 GB/s at N = 8
(``docs/benchmarks.md``). So with ``io_processes = N`` a :class:`Client`
hands each load and store to N worker processes, each a full client with its
own connections, and the bytes move through shared memory:

* the caller allocates its host buffer with :meth:`ClientPool.alloc` (POSIX
  shared memory; the engine adapter pins it for DMA with ``cudaHostRegister``);
* a load's blocks are cut into N contiguous ranges, each worker loads its range
  straight into the shared buffer and reports verified ranges as it goes; the
  result is the longest verified prefix;
* a store's payloads are read by the workers from the shared buffer.

The engine process only posts requests and waits for completions, the shape of
3FS's USRBIO rings and Mooncake's per-host client; a native or RDMA transport
can replace a worker's TCP one behind the same interface. Matching, touches
and deletes stay in the calling process (they move no bulk bytes).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing.connection
import os
import queue
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache.client.config import ClientConfig
from kvcache.client.loading import LoadResult
from kvcache.client.plan import MatchResult
from kvcache.client.storing import StoreResult
from kvcache.errors import ClusterError
from kvcache.keys import BlockKey

__all__ = ["ClientPool", "SharedBuffer", "worker_main"]

log = logging.getLogger(__name__)

OnReady = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class SharedBuffer:
    """A block buffer in POSIX shared memory: its name, and the array over it."""

    name: str
    array: npt.NDArray[np.uint8]


@dataclass(frozen=True, slots=True)
class _Region:
    """Where an array of the caller lies inside a shared buffer."""

    name: str
    offset: int


class ClientPool:
    """Worker processes that load and store for a :class:`~kvcache.client.Client`."""

    def __init__(self, config: ClientConfig, processes: int) -> None:
        self.config = replace(config, io_processes=0)
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        # Plain subprocesses (not multiprocessing's spawn, which re-imports the caller's
        # __main__): `python -m kvcache.client.pool_worker FD`, over a socket pair.
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        for _ in range(processes):
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvcache.client.pool_worker", str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env=env,
            )
            theirs.close()
            conn = multiprocessing.connection.Connection(ours.detach())
            conn.send(self.config)
            self._conns.append(conn)
            self._procs.append(proc)
        for conn in self._conns:
            reply = conn.recv()
            if reply[0] != "ready":
                self.close()
                raise ClusterError(f"an I/O worker failed to start: {reply[1]}")
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, queue.SimpleQueue[tuple[Any, ...]]] = {}
        self._buffers: dict[str, shared_memory.SharedMemory] = {}
        self._closed = False
        self._dispatcher = threading.Thread(target=self._dispatch, name="kvcache-pool", daemon=True)
        self._dispatcher.start()
        self._next_worker = itertools.count()

    @property
    def pids(self) -> list[int]:
        """The workers' process ids."""
        return [proc.pid for proc in self._procs]

    @property
    def size(self) -> int:
        """Worker processes."""
        return len(self._conns)

    # -------------------------------------------------------------- buffers

    def alloc(self, rows: int, row_bytes: int) -> SharedBuffer:
        """A (rows, row_bytes) uint8 array in shared memory the workers can write into."""
        size = max(1, rows * row_bytes)
        try:
            stat = os.statvfs("/dev/shm")
            free = stat.f_bavail * stat.f_frsize
        except OSError:
            free = size
        if size > free:
            # Touching shared memory past a full tmpfs is a SIGBUS, not an error: refuse early.
            raise ClusterError(
                f"/dev/shm has {free} bytes free, a buffer of {size} bytes was asked for: "
                "enlarge /dev/shm or use io_processes = 0"
            )
        shm = shared_memory.SharedMemory(create=True, size=size)
        self._buffers[shm.name] = shm
        array: npt.NDArray[np.uint8] = np.ndarray((rows, row_bytes), np.uint8, buffer=shm.buf)
        weakref.finalize(array, _release, self._buffers, shm.name)
        return SharedBuffer(shm.name, array)

    def region(self, array: npt.NDArray[np.uint8]) -> _Region | None:
        """The shared buffer ``array`` lies in (it may be a slice of one), or None."""
        start = array.ctypes.data
        for name, shm in self._buffers.items():
            assert shm.buf is not None  # open until released
            base = np.frombuffer(shm.buf, np.uint8).ctypes.data
            if base <= start and start + array.nbytes <= base + shm.size:
                return _Region(name, start - base)
        return None

    # -------------------------------------------------------------- operations

    def load(
        self,
        match: MatchResult,
        region: _Region,
        *,
        payload_len: int,
        traffic_class: str,
        chunk_blocks: int,
        on_ready: OnReady | None,
    ) -> int:
        """Load ``match``'s hit blocks into the shared rows at ``region``; the verified prefix."""
        total = match.hit_blocks
        ranges = self._ranges(total, chunk_blocks)
        requests: dict[int, tuple[int, int]] = {}
        replies: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        for start, stop in ranges:
            request_id = next(self._ids)
            requests[request_id] = (start, stop)
            self._post(
                request_id,
                replies,
                (
                    "load",
                    request_id,
                    b"".join(match.keys[start:stop]),
                    match.stripe[start:stop],
                    match.holders[start:stop],
                    match.tokens_per_block,
                    payload_len,
                    traffic_class,
                    region.name,
                    region.offset + start * payload_len,
                ),
            )
        good: dict[int, int] = {}
        try:
            while len(good) < len(requests):
                message = replies.get()
                kind, request_id = message[0], message[1]
                start, stop = requests[request_id]
                if kind == "ready":
                    if on_ready is not None:
                        on_ready(start + message[2], start + message[3])
                elif kind == "loaded":
                    good[request_id] = message[2]
                else:  # "error"
                    log.warning("an I/O worker's load failed: %s", message[2])
                    good[request_id] = 0
        finally:
            for request_id in requests:
                self._waiting.pop(request_id, None)
        prefix = 0
        for request_id, (start, stop) in sorted(requests.items(), key=lambda r: r[1][0]):
            prefix = start + good[request_id]
            if good[request_id] < stop - start:
                break
        return prefix

    def store(
        self,
        keys: Sequence[BlockKey],
        region: _Region,
        *,
        payload_len: int,
        traffic_class: str,
        first_block: int,
        chunk_blocks: int,
    ) -> StoreResult:
        """Store one payload per key from the shared rows at ``region``."""
        ranges = self._ranges(len(keys), chunk_blocks)
        replies: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        requests: dict[int, tuple[int, int]] = {}
        for start, stop in ranges:
            request_id = next(self._ids)
            requests[request_id] = (start, stop)
            self._post(
                request_id,
                replies,
                (
                    "store",
                    request_id,
                    b"".join(keys[start:stop]),
                    payload_len,
                    traffic_class,
                    region.name,
                    region.offset + start * payload_len,
                ),
            )
        written = touched = 0
        failed: list[int] = []
        try:
            for _ in requests:
                message = replies.get()
                start, stop = requests[message[1]]
                if message[0] == "stored":
                    written += message[2]
                    touched += message[3]
                    failed += [first_block + start + b for b in message[4]]
                else:
                    log.warning("an I/O worker's store failed: %s", message[2])
                    failed += list(range(first_block + start, first_block + stop))
        finally:
            for request_id in requests:
                self._waiting.pop(request_id, None)
        return StoreResult(written, touched, len(failed), tuple(sorted(failed)))

    def counters(self) -> dict[str, int]:
        """The workers' client counters, summed."""
        replies: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        total: dict[str, int] = {}
        ids = []
        for worker in range(self.size):
            request_id = next(self._ids)
            ids.append(request_id)
            self._post(request_id, replies, ("counters", request_id), worker=worker)
        for _ in ids:
            message = replies.get()
            if message[0] == "counters":
                for name, n in message[2].items():
                    total[name] = total.get(name, 0) + n
        for request_id in ids:
            self._waiting.pop(request_id, None)
        return total

    def close(self) -> None:
        """Stop the workers and free the shared buffers (idempotent)."""
        if not self._conns:
            return
        self._closed = True
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("close",))
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        self._conns = []
        for name in list(self._buffers):
            _release(self._buffers, name)

    # -------------------------------------------------------------- internals

    def _ranges(self, total: int, chunk_blocks: int) -> list[tuple[int, int]]:
        """Contiguous ranges, one per worker, none much smaller than a chunk."""
        if total == 0:
            return []
        parts = max(1, min(self.size, -(-total // max(1, chunk_blocks))))
        cuts = np.linspace(0, total, parts + 1).round().astype(int)
        return [(int(a), int(b)) for a, b in itertools.pairwise(cuts) if b > a]

    def _post(
        self,
        request_id: int,
        replies: queue.SimpleQueue[tuple[Any, ...]],
        message: tuple[Any, ...],
        *,
        worker: int | None = None,
    ) -> None:
        if self._closed:
            raise ClusterError("the client's I/O pool is closed")
        self._waiting[request_id] = replies
        index = next(self._next_worker) % self.size if worker is None else worker
        with self._send_lock:
            self._conns[index].send(message)

    def _dispatch(self) -> None:
        """Route every worker message to the queue of the request it belongs to."""
        while not self._closed:
            try:
                ready = multiprocessing.connection.wait(self._conns, timeout=0.5)
            except OSError:
                return
            for conn in ready:
                assert isinstance(conn, multiprocessing.connection.Connection)
                try:
                    message: tuple[Any, ...] = conn.recv()
                except (EOFError, OSError):
                    if not self._closed:
                        log.error("an I/O worker died; its requests fail")
                        for replies in list(self._waiting.values()):
                            replies.put(("error", 0, "worker died"))
                    return
                target = self._waiting.get(message[1])
                if target is not None:
                    target.put(message)


def _release(buffers: dict[str, shared_memory.SharedMemory], name: str) -> None:
    shm = buffers.pop(name, None)
    if shm is None:
        return
    with contextlib.suppress(BufferError):  # views still exported: unmapped at exit
        shm.close()
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()


def worker_main(conn: multiprocessing.connection.Connection, config: ClientConfig) -> None:
    """One I/O worker: a full client serving the pool's requests, one at a time."""
    from kvcache.client.client import Client

    try:
        client = Client(config)
    except BaseException as exc:  # reported to the parent, which refuses to start
        conn.send(("failed", repr(exc)))
        return
    conn.send(("ready", 0))
    mapped: dict[str, shared_memory.SharedMemory] = {}

    def rows(name: str, offset: int, count: int, row_bytes: int) -> npt.NDArray[np.uint8]:
        shm = mapped.get(name)
        if shm is None:
            shm = shared_memory.SharedMemory(name=name)
            # The parent owns the buffer: keep Python's resource tracker from removing it.
            try:
                from multiprocessing import resource_tracker

                resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            except (ImportError, AttributeError, KeyError):
                pass
            mapped[name] = shm
        array: npt.NDArray[np.uint8] = np.ndarray(
            (count, row_bytes), np.uint8, buffer=shm.buf, offset=offset
        )
        return array

    try:
        while True:
            message = conn.recv()
            kind = message[0]
            if kind == "close":
                return
            request_id = message[1]
            try:
                if kind == "load":
                    _, _, raw_keys, stripes, holders, tpb, payload_len, cls, name, offset = message
                    keys = [BlockKey(raw_keys[i : i + 16]) for i in range(0, len(raw_keys), 16)]
                    match = MatchResult(
                        keys, len(keys), tpb, stripes, holders, np.full(len(keys), -1, np.int64)
                    )
                    out = rows(name, offset, len(keys), payload_len)

                    def ready(first: int, stop: int, request: int = request_id) -> None:
                        conn.send(("ready", request, first, stop))

                    result: LoadResult = client.load_keys(
                        match, payload_len=payload_len, out=out, traffic_class=cls, on_ready=ready
                    )
                    conn.send(("loaded", request_id, result.blocks))
                elif kind == "store":
                    _, _, raw_keys, payload_len, cls, name, offset = message
                    keys = [BlockKey(raw_keys[i : i + 16]) for i in range(0, len(raw_keys), 16)]
                    source = rows(name, offset, len(keys), payload_len)
                    stored = client.store_keys(
                        keys, source, payload_len=payload_len, traffic_class=cls
                    )
                    conn.send(
                        ("stored", request_id, stored.written, stored.touched, stored.failed_blocks)
                    )
                elif kind == "counters":
                    conn.send(("counters", request_id, client.counters))
            except Exception as exc:  # one failed request must not kill the worker
                log.warning("I/O worker request failed", exc_info=True)
                conn.send(("error", request_id, repr(exc)))
    except (EOFError, OSError, KeyboardInterrupt):
        return
    finally:
        client.close()
        for shm in mapped.values():
            with contextlib.suppress(BufferError):
                shm.close()
