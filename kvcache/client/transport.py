"""One zmq DEALER socket per storage node, owned by the client's event loop.

``NodeChannel.request`` sends one batched request and awaits the reply with the
same request id. Replies are read by one task per socket and handed to the
waiting future; a reply that arrives after its request gave up is dropped.
A node that cannot be reached or does not answer in time raises a ``NodeError``;
the channel then drops its socket (and everything queued on it) and reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq
import zmq.asyncio

from kvcache.cluster import NodeInfo
from kvcache.errors import FormatError, KVCacheError, NodeError, NodeTimeoutError
from kvcache.wire import Frame, Header, Limits, Message, Status, decode, encode

__all__ = ["NodeChannel", "RemoteStatusError"]

log = logging.getLogger(__name__)

#: How long a send waits for a connection to come up before the node counts as unreachable.
_CONNECT_GRACE_MS = 250


class RemoteStatusError(NodeError):
    """The node answered the whole request with an error status."""

    def __init__(self, message: str, *, node: str, status: Status) -> None:
        super().__init__(message, node=node)
        self.status = status


class NodeChannel:
    """Request/reply with one node over a DEALER socket."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        node: NodeInfo,
        *,
        limits: Limits,
        token: bytes | None,
    ) -> None:
        self.node = node
        self._ctx = ctx
        self._limits = limits
        self._token = token
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._socket: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None

    def _open(self) -> zmq.asyncio.Socket:
        if self._socket is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.SNDHWM, 1000)
            sock.setsockopt(zmq.RCVHWM, 1000)
            sock.setsockopt(zmq.MAXMSGSIZE, self._limits.max_frame_bytes)
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            sock.connect(self.node.data)
            self._socket = sock
            self._reader = asyncio.get_running_loop().create_task(
                self._read(sock), name=f"kvcache-reader-{self.node.id}"
            )
        return self._socket

    async def request(
        self,
        header: Header,
        items: npt.NDArray[np.void] | None,
        data: Frame | None,
        *,
        timeout: float,
    ) -> Message:
        """Send one request and return its reply; raise NodeError / NodeTimeoutError."""
        sock = self._open()
        rid = next(self._ids)
        header = Header(
            op=header.op,
            request_id=rid,
            count=header.count,
            flags=header.flags,
            traffic_class=header.traffic_class,
        )
        frames = encode(header, items, data, token=self._token)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await self._send(sock, frames)
            reply = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise NodeTimeoutError(
                f"node {self.node.id} did not answer {header.op.name} within {timeout:.3f}s",
                node=self.node.id,
            ) from None
        finally:
            self._pending.pop(rid, None)
        if reply.header.status != Status.OK:
            raise RemoteStatusError(
                f"node {self.node.id} refused {header.op.name}: "
                f"{reply.header.status.name}: {reply.error_text()}",
                node=self.node.id,
                status=reply.header.status,
            )
        return reply

    async def _send(self, sock: zmq.asyncio.Socket, frames: list[Frame]) -> None:
        try:
            await sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            pass
        poll: Any = sock.poll  # pyzmq's stubs type the async poll as the sync one
        ready = int(await poll(timeout=_CONNECT_GRACE_MS, flags=zmq.POLLOUT))
        if not ready & zmq.POLLOUT:
            raise NodeError(
                f"node {self.node.id} at {self.node.data} is not reachable", node=self.node.id
            )
        try:
            await sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:
            raise NodeError(
                f"sending to node {self.node.id} failed: {exc}", node=self.node.id
            ) from None

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                raw: list[Any] = await sock.recv_multipart(copy=False)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                msg = decode([f.buffer for f in raw], limits=self._limits, token=self._token)
            except (FormatError, KVCacheError) as exc:
                log.warning("dropping malformed reply from node %s: %s", self.node.id, exc)
                continue
            fut = self._pending.get(msg.header.request_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def reset(self) -> None:
        """Drop the socket and everything queued on it; the next request reconnects."""
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(NodeError(f"node {self.node.id} reset", node=self.node.id))
                fut.exception()  # mark retrieved: its requester may already have given up
        self._pending.clear()

    async def aclose(self) -> None:
        """Close the socket and stop the reader."""
        reader = self._reader
        self.reset()
        if reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await reader
