"""One I/O worker process: ``python -m kvcache.client.pool_worker FD``.

:class:`kvcache.client.pool.ClientPool` starts it with one end of a socket pair
as ``FD``, sends the client configuration, and then requests
(:mod:`kvcache.client.pool_messages`). The worker is a full client of its own;
it reads and writes the caller's rows in POSIX shared memory directly. It lives
here, apart from the pool, so that the pool never imports the client (the
client imports the pool).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import sys
import threading
from multiprocessing import shared_memory

import numpy as np
import numpy.typing as npt

from kvcache.client.client import Client
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
    Started,
    Stored,
    StoreRequest,
)
from kvcache.cluster import NodeInfo
from kvcache.keys import BlockKey

__all__ = ["worker_main"]

log = logging.getLogger(__name__)


def _own_indices(
    client: Client, nodes: tuple[tuple[str, str], ...], holders: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]:
    """``holders`` (indices into the parent's ``nodes``) as indices into this worker's
    transport (-1 stays -1)."""
    topology = client.core.topology
    mine = np.array(
        [topology.index_of(NodeInfo(id=node_id, data=data)) for node_id, data in nodes] + [-1],
        np.int64,
    )
    return mine[np.where(holders >= 0, holders, len(nodes))]


class _Buffers:
    """The parent's shared buffers, mapped on first use (the parent owns and frees them)."""

    def __init__(self) -> None:
        self._mapped: dict[str, shared_memory.SharedMemory] = {}

    def rows(self, name: str, offset: int, count: int, row_bytes: int) -> npt.NDArray[np.uint8]:
        shm = self._mapped.get(name)
        if shm is None:
            shm = shared_memory.SharedMemory(name=name)
            # The parent owns the buffer: keep Python's resource tracker from removing it.
            try:
                from multiprocessing import resource_tracker

                resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            except (ImportError, AttributeError, KeyError):
                pass
            self._mapped[name] = shm
        array: npt.NDArray[np.uint8] = np.ndarray(
            (count, row_bytes), np.uint8, buffer=shm.buf, offset=offset
        )
        return array

    def forget_released(self) -> None:
        """Unmap the buffers the parent has released (their names are gone): a worker that
        kept every buffer it ever mapped grew by each one, and ran out of descriptors."""
        for name, shm in list(self._mapped.items()):
            if not os.path.exists(f"/dev/shm/{name.lstrip('/')}"):
                del self._mapped[name]
                with contextlib.suppress(BufferError):
                    shm.close()

    def close(self) -> None:
        for shm in self._mapped.values():
            with contextlib.suppress(BufferError):
                shm.close()


def _keys(raw: bytes) -> list[BlockKey]:
    return [BlockKey(raw[i : i + 16]) for i in range(0, len(raw), 16)]


class _Channel:
    """The worker's end of the pool's socket pair: sends from the request loop, the load's
    callback and the heartbeat thread, one at a time."""

    def __init__(self, conn: multiprocessing.connection.Connection, stall_s: float) -> None:
        self.conn = conn
        self._lock = threading.Lock()
        self._busy = threading.Event()
        self._stop = threading.Event()
        self._every = max(0.05, stall_s / 4)
        threading.Thread(target=self._beat, name="kvcache-io-heartbeat", daemon=True).start()

    def send(self, message: object) -> None:
        with self._lock:
            self.conn.send(message)

    def busy(self, on: bool) -> None:
        (self._busy.set if on else self._busy.clear)()

    def close(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        """While a request runs, a heartbeat (``Started``) every quarter of the pool's stall
        time: a store of many chunks says nothing else until it is done, and the pool took
        it for a stopped worker and killed it. A stopped process sends none."""
        while not self._stop.wait(self._every):
            if self._busy.is_set():
                try:
                    self.send(Started())
                except OSError:
                    return


def worker_main(
    conn: multiprocessing.connection.Connection, config: ClientConfig, stall_s: float = 10.0
) -> None:
    """Serve the pool's requests, one at a time, until :class:`Close` or the pool is gone."""
    try:
        client = Client(config)
    except BaseException as exc:  # reported to the parent, which refuses to start
        conn.send(Started(error=repr(exc)))
        return
    conn.send(Started())
    channel = _Channel(conn, stall_s)
    buffers = _Buffers()
    try:
        while True:
            request = conn.recv()
            if isinstance(request, Close):
                return
            channel.busy(True)
            try:
                if isinstance(request, LoadRequest):
                    keys = _keys(request.keys)
                    holders = request.holders
                    if request.nodes:
                        holders = _own_indices(client, request.nodes, holders)
                    match = MatchResult(
                        keys,
                        len(keys),
                        request.tokens_per_block,
                        request.stripes,
                        holders,
                        np.full(len(keys), -1, np.int64),
                    )
                    out = buffers.rows(
                        request.buffer, request.offset, len(keys), request.payload_len
                    )

                    def ready(first: int, stop: int, request_id: int = request.request_id) -> None:
                        channel.send(Ready(request_id=request_id, first=first, stop=stop))

                    result = client.load_keys(
                        match,
                        payload_len=request.payload_len,
                        out=out,
                        traffic_class=request.traffic_class,
                        on_ready=ready,
                    )
                    channel.send(Loaded(request_id=request.request_id, blocks=result.blocks))
                elif isinstance(request, StoreRequest):
                    keys = _keys(request.keys)
                    source = buffers.rows(
                        request.buffer, request.offset, len(keys), request.payload_len
                    )
                    stored = client.store_keys(
                        keys,
                        source,
                        payload_len=request.payload_len,
                        traffic_class=request.traffic_class,
                    )
                    channel.send(
                        Stored(
                            request_id=request.request_id,
                            written=stored.written,
                            touched=stored.touched,
                            failed_blocks=tuple(stored.failed_blocks),
                        )
                    )
                elif isinstance(request, CountersRequest):
                    channel.send(Counters(request_id=request.request_id, counters=client.counters))
                else:
                    log.error("I/O worker: unknown request %r", request)
            except Exception as exc:  # one failed request must not kill the worker
                log.warning("I/O worker request failed", exc_info=True)
                channel.send(Failed(request_id=request.request_id, error=repr(exc)))
            channel.busy(False)
            buffers.forget_released()
    except (EOFError, OSError, KeyboardInterrupt):
        return
    finally:
        channel.close()
        client.close()
        buffers.close()


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    pipe = multiprocessing.connection.Connection(int(sys.argv[1]))
    config, stall_s = pipe.recv()
    worker_main(pipe, config, stall_s)
