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
import errno
import itertools
import logging
import multiprocessing.connection
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvcache.client.config import ClientConfig
from kvcache.client.plan import MatchResult
from kvcache.client.pool_messages import (
    Close,
    Counters,
    CountersRequest,
    Failed,
    Loaded,
    LoadRequest,
    Ready,
    RequestReply,
    Started,
    Stored,
    StoreRequest,
    WorkerReply,
    WorkerRequest,
)
from kvcache.client.storing import StoreResult
from kvcache.errors import ArgumentError, ClosedError, ClusterError
from kvcache.keys import BlockKey

__all__ = ["ClientPool", "SharedBuffer"]

log = logging.getLogger(__name__)

OnReady = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class SharedBuffer:
    """A block buffer in POSIX shared memory: its name, and the array over it."""

    name: str
    array: npt.NDArray[np.uint8]


#: How long a worker has to say it started (a cold interpreter importing numpy and the client).
_START_TIMEOUT_S = 60.0


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
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        #: Requests posted and not yet answered: id -> (the call's reply queue, worker).
        self._waiting: dict[int, tuple[queue.SimpleQueue[RequestReply], int]] = {}
        #: Shared buffers by name; alloc, region and release run on callers' threads (and
        #: in finalizers), so the dict is changed and walked under its lock.
        self._buffers: dict[str, shared_memory.SharedMemory] = {}
        self._buffers_lock = threading.Lock()
        self._closed = False
        #: The process that started the workers: a forked child shares its sockets and
        #: shared memory, and must neither post on them nor free them (ClosedError there).
        self._pid = os.getpid()
        #: Per worker, when it last said something or was given work while idle.
        self._heard: list[float] = []
        #: A worker that says nothing this long while a request waits on it is taken for
        #: hung (stopped): killed, its requests fail as a dead worker's do. A worker with a
        #: request sends a heartbeat every quarter of it (pool_worker), however long the
        #: request takes (a store of many chunks says nothing else until it is done).
        self._stall_s = max(config.io_stall_s, 5 * config.timeout_s)
        #: Why the pool takes no more work (a worker died), or None: the client then moves
        #: the bytes in its own process (Client falls back), and nothing waits on the pool.
        self.broken: str | None = None
        try:
            self._start_workers(processes)
        except BaseException:
            self.close()
            raise
        self._dispatcher = threading.Thread(target=self._dispatch, name="kvcache-pool", daemon=True)
        self._dispatcher.start()
        self._next_worker = itertools.count()

    def _start_workers(self, processes: int) -> None:
        """Start ``processes`` workers and wait for each to say it started (ClusterError
        when one does not: it failed to start, died, or did not answer in time)."""
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
            self._conns.append(conn)
            self._procs.append(proc)
            self._heard.append(time.monotonic())
            try:
                conn.send((self.config, max(self.config.io_stall_s, 5 * self.config.timeout_s)))
            except OSError as exc:
                raise ClusterError(
                    f"an I/O worker (pid {proc.pid}) hung up at start: {exc}"
                ) from None
        deadline = time.monotonic() + _START_TIMEOUT_S
        for conn, proc in zip(self._conns, self._procs, strict=True):
            try:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise ClusterError(
                        f"an I/O worker (pid {proc.pid}) did not start within "
                        f"{_START_TIMEOUT_S:.0f} s"
                    )
                reply = conn.recv()
            except (EOFError, OSError) as exc:
                raise ClusterError(
                    f"an I/O worker (pid {proc.pid}) failed to start: it exited or hung up "
                    f"({exc or type(exc).__name__}; exit status {proc.poll()})"
                ) from None
            if not isinstance(reply, Started) or reply.error:
                why = reply.error if isinstance(reply, Started) else repr(reply)
                raise ClusterError(f"an I/O worker failed to start: {why}")

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
        """A (rows, row_bytes) uint8 array in shared memory the workers can write into.

        Its pages are allocated now: a tmpfs that cannot hold it is an error here, not a
        SIGBUS when a row is first written. The mapping lives as long as the array (or a
        view of it) does, after :meth:`close` too; its name is removed when the array goes
        or at :meth:`close`, whichever comes first."""
        self._check_owner()
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
        try:
            shm = shared_memory.SharedMemory(create=True, size=size)
        except (OSError, ValueError) as exc:
            raise ArgumentError(f"cannot allocate a shared buffer of {size} bytes: {exc}") from None
        try:
            # Several buffers that each fit the free space can together exceed it: the
            # statvfs check above cannot see what is promised and not yet touched.
            os.posix_fallocate(shm._fd, 0, size)  # type: ignore[attr-defined]
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                pass  # a file system without allocation: the statvfs check is all there is
            else:
                shm.close()
                shm.unlink()
                raise ClusterError(
                    f"/dev/shm cannot hold a buffer of {size} bytes ({exc.strerror}): enlarge "
                    "/dev/shm, free buffers, or use io_processes = 0"
                ) from None
        with self._buffers_lock:
            self._buffers[shm.name] = shm
        array: npt.NDArray[np.uint8] = np.ndarray((rows, row_bytes), np.uint8, buffer=shm.buf)
        weakref.finalize(array, _release, self._buffers, self._buffers_lock, shm, self._pid)
        return SharedBuffer(shm.name, array)

    def region(self, array: npt.NDArray[np.uint8]) -> _Region | None:
        """The shared buffer ``array`` lies in (it may be a slice of one), or None."""
        start = array.ctypes.data
        with self._buffers_lock:
            buffers = list(self._buffers.items())
        for name, shm in buffers:
            if shm.buf is None:  # released meanwhile
                continue
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
        nodes: tuple[tuple[str, str], ...] = (),
    ) -> int:
        """Load ``match``'s hit blocks into the shared rows at ``region``; the verified prefix.

        ``nodes`` are (id, data address) of the nodes ``match.holders`` indexes (this
        process's transport): a worker maps them onto its own transport's indices,
        which can differ after map changes."""
        total = match.hit_blocks
        ranges = self._ranges(total, chunk_blocks)
        requests: dict[int, tuple[int, int]] = {}
        replies: queue.SimpleQueue[RequestReply] = queue.SimpleQueue()
        posting_error: BaseException | None = None
        for start, stop in ranges:
            request_id = next(self._ids)
            requests[request_id] = (start, stop)
            try:
                self._post(
                    request_id,
                    replies,
                    LoadRequest(
                        request_id=request_id,
                        keys=b"".join(match.keys[start:stop]),
                        stripes=match.stripe[start:stop],
                        holders=match.holders[start:stop],
                        tokens_per_block=match.tokens_per_block,
                        payload_len=payload_len,
                        traffic_class=traffic_class,
                        buffer=region.name,
                        offset=region.offset + start * payload_len,
                        nodes=nodes,
                    ),
                )
            except (ClosedError, ClusterError) as exc:
                # Ranges already posted are written into the caller's buffer: their answers
                # are waited for below before this is raised.
                del requests[request_id]
                posting_error = exc
                break
        good: dict[int, int] = {}
        # Workers finish their ranges in any order; ``on_ready`` hears of the verified
        # prefix only, in order (blocks past a range that came up short are never reported).
        ready = np.zeros(max((stop for _, stop in requests.values()), default=0), bool)
        front = 0
        # A callback that raises does not end the call while workers still write into the
        # caller's buffer (a caller reusing it then made them drop healthy stripes): the
        # error is raised once every range has answered.
        callback_error: BaseException | None = None
        try:
            while len(good) < len(requests):
                message = self._next_reply(replies)
                if message.request_id in good:
                    continue  # answered already (a worker's reply, then a failure of all)
                start, stop = requests[message.request_id]
                if isinstance(message, Ready):
                    ready[start + message.first : start + message.stop] = True
                    if (
                        on_ready is not None
                        and callback_error is None
                        and ready[front:].any()
                        and ready[front]
                    ):
                        gap = np.flatnonzero(~ready[front:])
                        end = len(ready) if not len(gap) else front + int(gap[0])
                        try:
                            on_ready(front, end)
                        except BaseException as exc:  # re-raised below, once all answered
                            callback_error = exc
                        front = end
                elif isinstance(message, Loaded):
                    good[message.request_id] = message.blocks
                else:
                    log.warning("an I/O worker's load failed: %s", _why(message))
                    good[message.request_id] = 0
        finally:
            for request_id in requests:
                self._waiting.pop(request_id, None)
        if posting_error is not None:
            raise posting_error
        if callback_error is not None:
            raise callback_error
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
        replies: queue.SimpleQueue[RequestReply] = queue.SimpleQueue()
        requests: dict[int, tuple[int, int]] = {}
        posting_error: BaseException | None = None
        for start, stop in ranges:
            request_id = next(self._ids)
            requests[request_id] = (start, stop)
            try:
                self._post(
                    request_id,
                    replies,
                    StoreRequest(
                        request_id=request_id,
                        keys=b"".join(keys[start:stop]),
                        payload_len=payload_len,
                        traffic_class=traffic_class,
                        buffer=region.name,
                        offset=region.offset + start * payload_len,
                    ),
                )
            except (ClosedError, ClusterError) as exc:
                # Ranges already posted read the caller's buffer: waited for below.
                del requests[request_id]
                posting_error = exc
                break
        written = touched = 0
        failed: list[int] = []
        answered: set[int] = set()
        try:
            while len(answered) < len(requests):
                message = self._next_reply(replies)
                if message.request_id in answered:
                    continue  # answered already (a worker's reply, then a failure of all)
                answered.add(message.request_id)
                start, stop = requests[message.request_id]
                if isinstance(message, Stored):
                    written += message.written
                    touched += message.touched
                    failed += [first_block + start + b for b in message.failed_blocks]
                else:
                    log.warning("an I/O worker's store failed: %s", _why(message))
                    failed += list(range(first_block + start, first_block + stop))
        finally:
            for request_id in requests:
                self._waiting.pop(request_id, None)
        if posting_error is not None:
            raise posting_error
        return StoreResult(written, touched, len(failed), tuple(sorted(failed)))

    def counters(self) -> dict[str, int]:
        """The workers' client counters, summed."""
        replies: queue.SimpleQueue[RequestReply] = queue.SimpleQueue()
        total: dict[str, int] = {}
        ids = []
        for worker in range(self.size):
            request_id = next(self._ids)
            ids.append(request_id)
            self._post(request_id, replies, CountersRequest(request_id=request_id), worker=worker)
        answered: set[int] = set()
        while len(answered) < len(ids):
            message = self._next_reply(replies)
            if message.request_id in answered:
                continue
            answered.add(message.request_id)
            if isinstance(message, Counters):
                for name, n in message.counters.items():
                    total[name] = total.get(name, 0) + n
        for request_id in ids:
            self._waiting.pop(request_id, None)
        return total

    def close(self) -> None:
        """Stop the workers and remove the shared buffers' names (idempotent). Arrays the
        caller still holds stay mapped until they go (unmapping them under the caller was
        a crash, or writes landing in a later buffer mapped at the same address)."""
        if not self._conns and not self._procs:
            return
        self._closed = True
        if os.getpid() != self._pid:
            # A forked child's copy: the workers and the buffers are the parent's.
            self._conns, self._procs = [], []
            return
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(Close())
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # The workers are gone (nothing writes into a caller's buffer any more): a call
        # still waiting returns what was verified before (it waited forever before).
        self._fail_waiting("the client was closed")
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._procs = []
        with self._buffers_lock:
            buffers = list(self._buffers.values())
            self._buffers.clear()
        for shm in buffers:
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()

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
        replies: queue.SimpleQueue[RequestReply],
        message: WorkerRequest,
        *,
        worker: int | None = None,
    ) -> None:
        self._check_owner()
        if self._closed:
            raise ClosedError("the client was closed: its I/O pool takes no work")
        if self.broken is not None:
            raise ClusterError(f"the client's I/O pool takes no work: {self.broken}")
        index = next(self._next_worker) % self.size if worker is None else worker
        if all(w != index for _, w in list(self._waiting.values())):  # others post and pop
            self._heard[index] = time.monotonic()  # idle until now: its clock starts here
        self._waiting[request_id] = (replies, index)
        try:
            with self._send_lock:
                self._conns[index].send(message)
        except OSError as exc:
            # The worker is gone: this request fails (the call's other requests, on the
            # workers that are alive, finish as they would), and so does what it had.
            self._worker_gone(index, f"I/O worker {self._procs[index].pid} is gone ({exc})")

    def _check_owner(self) -> None:
        if os.getpid() != self._pid:
            raise ClosedError(
                f"this client's I/O pool belongs to process {self._pid}: a forked child must "
                "open a Client of its own (the workers and buffers are the parent's)"
            )

    def _next_reply(self, replies: queue.SimpleQueue[RequestReply]) -> RequestReply:
        """The next reply for a call, never waiting forever: a dead worker's requests are
        failed when it goes (_worker_gone), a hung one is killed (_kill_stalled), and
        close() fails what still waits once the workers are gone; this is the guard should
        the dispatcher stop otherwise."""
        while True:
            try:
                return replies.get(timeout=0.5)
            except queue.Empty:
                if not (self._closed or self._dispatcher.is_alive()) and replies.empty():
                    raise ClusterError(
                        f"the client's I/O pool stopped: {self.broken or 'its dispatcher ended'}"
                    ) from None
                self._kill_stalled(time.monotonic())

    def _kill_stalled(self, now: float) -> None:
        """Kill the workers that said nothing for ``_stall_s`` while requests wait on them:
        the dispatcher then sees them gone, and their requests fail."""
        busy = {worker for _, worker in list(self._waiting.values())}
        for index in busy:
            proc = self._procs[index] if index < len(self._procs) else None
            if proc is None or proc.poll() is not None or now - self._heard[index] < self._stall_s:
                continue
            log.error(
                "I/O worker %d said nothing for %.0f s with requests waiting: killing it",
                proc.pid,
                now - self._heard[index],
            )
            with contextlib.suppress(OSError):
                proc.kill()

    def _worker_gone(self, index: int, why: str) -> None:
        """Worker ``index`` died: its requests fail, the others' go on to the end (a call
        returns only once nothing writes into its buffers any more), and the pool takes no
        new work (the client moves the bytes itself from then on)."""
        if self.broken is None and not self._closed:
            self.broken = why
            log.error("the client's I/O pool stops: %s; loads and stores run in this process", why)
        for request_id, (replies, worker) in list(self._waiting.items()):
            if worker == index:
                replies.put(Failed(request_id=request_id, error=why))

    def _fail_waiting(self, why: str) -> None:
        for request_id, (replies, _worker) in list(self._waiting.items()):
            replies.put(Failed(request_id=request_id, error=why))

    def _dispatch(self) -> None:
        """Route every worker message to the queue of the request it belongs to, until every
        worker is gone (closing included: what they answer meanwhile still counts)."""
        conns = list(self._conns)  # close() empties the pool's list
        live = list(conns)
        while live:
            try:
                ready = multiprocessing.connection.wait(live, timeout=0.5)
            except OSError:
                return  # close() closed the connections: the workers are gone
            for conn in ready:
                assert isinstance(conn, multiprocessing.connection.Connection)
                try:
                    message: WorkerReply = conn.recv()
                except (EOFError, OSError):
                    live.remove(conn)
                    index = conns.index(conn)
                    self._worker_gone(index, f"I/O worker {self._procs[index].pid} died")
                    continue
                self._heard[conns.index(conn)] = time.monotonic()
                if isinstance(message, Started):
                    continue
                target = self._waiting.get(message.request_id)
                if target is not None:
                    target[0].put(message)


def _release(
    buffers: dict[str, shared_memory.SharedMemory],
    lock: threading.Lock,
    shm: shared_memory.SharedMemory,
    owner: int,
) -> None:
    """A buffer's array is gone: unmap it and remove its name (the workers then drop their
    own mappings of it). In a forked child, whose exit runs this too, nothing: the buffer
    is the parent's."""
    if os.getpid() != owner:
        return
    with lock:
        buffers.pop(shm.name, None)
    with contextlib.suppress(BufferError):
        shm.close()
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()


def _why(message: RequestReply) -> str:
    return message.error if isinstance(message, Failed) else repr(message)
