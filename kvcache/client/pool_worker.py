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


def worker_main(conn: multiprocessing.connection.Connection, config: ClientConfig) -> None:
    """Serve the pool's requests, one at a time, until :class:`Close` or the pool is gone."""
    try:
        client = Client(config)
    except BaseException as exc:  # reported to the parent, which refuses to start
        conn.send(Started(error=repr(exc)))
        return
    conn.send(Started())
    buffers = _Buffers()
    try:
        while True:
            request = conn.recv()
            if isinstance(request, Close):
                return
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
                        conn.send(Ready(request_id=request_id, first=first, stop=stop))

                    result = client.load_keys(
                        match,
                        payload_len=request.payload_len,
                        out=out,
                        traffic_class=request.traffic_class,
                        on_ready=ready,
                    )
                    conn.send(Loaded(request_id=request.request_id, blocks=result.blocks))
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
                    conn.send(
                        Stored(
                            request_id=request.request_id,
                            written=stored.written,
                            touched=stored.touched,
                            failed_blocks=tuple(stored.failed_blocks),
                        )
                    )
                elif isinstance(request, CountersRequest):
                    conn.send(Counters(request_id=request.request_id, counters=client.counters))
                else:
                    log.error("I/O worker: unknown request %r", request)
            except Exception as exc:  # one failed request must not kill the worker
                log.warning("I/O worker request failed", exc_info=True)
                conn.send(Failed(request_id=request.request_id, error=repr(exc)))
            buffers.forget_released()
    except (EOFError, OSError, KeyboardInterrupt):
        return
    finally:
        client.close()
        buffers.close()


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    channel = multiprocessing.connection.Connection(int(sys.argv[1]))
    worker_main(channel, channel.recv())
