"""The data path: one zmq ROUTER socket in front of a :class:`ShardStore`.

:meth:`DataService.handle` turns request frames into reply frames with no I/O
(decode with :mod:`kvcache.wire`, call the store, encode); :meth:`DataService.serve`
is the loop that owns the sockets: it receives with a hard cap on frames per
message, answers every request (an error reply for bad input, never a crash),
and runs the store's bounded retention work between requests. Every other
thread talks to it only through :meth:`DataService.submit`.

Group commit: when a PUT arrives with more PUTs already queued behind it, the
loop takes those along (:meth:`DataService.handle_many`) and the store writes
them in one LMDB transaction, with one reply per request. Measured: no gain
with ``sync = "periodic"`` (the commit's cost is its pages, not a fixed part),
5-21 % less time per batch with ``sync = "commit"``, where every transaction
pays an fsync (groups of 2-4, docs/server.md "Performance").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import lmdb
import numpy as np
import numpy.typing as npt
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvcache.errors import AuthError, KVCacheError, ProtocolError
from kvcache.server.config import ServerConfig
from kvcache.server.metrics import Metrics, store_errors
from kvcache.server.store import ReplyTooLargeError, ShardStore
from kvcache.wire import (
    FLAG_REPLY,
    HEADER_BYTES,
    NO_INDEX,
    Frame,
    Header,
    Message,
    Op,
    Status,
    decode,
    encode,
    error_reply,
    make_items,
)

__all__ = ["MAX_FRAMES", "MAX_SHARD_INDEX", "DataService"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Frames a request may have after the ROUTER's identity frame (header, items, data, mac).
MAX_FRAMES = 4
#: Largest valid shard index (k + m <= 255 in shard format v1).
MAX_SHARD_INDEX = 254
#: Requests handled per wake-up before retention work and control calls get a turn.
_BURST = 32
#: At most this many queued PUT requests share one write transaction (group commit) ...
_GROUP_REQUESTS = 16
#: ... and at most this many bytes of them (or capacity / 8 when smaller), so a group
#: is never refused for space where the same requests one by one would have fitted.
_GROUP_BYTES = 64 << 20
#: Retention work runs at least this often, even under a steady request load.
_MAINTAIN_EVERY_S = 0.05
_IDLE_POLL_MS = 200


class DataService:
    """The zmq front end of one store; the thread that calls :meth:`serve` owns it all."""

    def __init__(
        self,
        store: ShardStore,
        config: ServerConfig,
        metrics: Metrics,
        *,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.metrics = metrics
        self.limits = config.limits
        self._token = config.token_bytes if config.data_auth else None
        self._ctx = context or zmq.Context.instance()
        self._calls: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            queue.Queue()
        )
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sock: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self.endpoint = ""
        self.serving = threading.Event()
        self._group_bytes = min(_GROUP_BYTES, store.capacity_bytes // 8)

    # ------------------------------------------------------------------ sans-I/O core

    def handle(self, frames: list[Frame]) -> list[Frame]:
        """Reply frames for one request's frames (without the ROUTER identity). Never raises."""
        return self.handle_many([frames])[0]

    def handle_many(
        self, requests: Sequence[list[Frame]], *, group_bytes: int | None = None
    ) -> list[list[Frame]]:
        """Reply frames for several requests, in order. Never raises.

        PUT requests next to each other share one write transaction (group
        commit, see :meth:`ShardStore.put_many`), up to ``group_bytes`` of
        them (default: the service's limit); anything else is handled on its
        own, after the PUTs received before it are stored.
        """
        limit = self._group_bytes if group_bytes is None else group_bytes
        replies: list[list[Frame]] = []
        group: list[_Pending] = []
        group_size = 0
        for frames in requests:
            started = time.perf_counter()
            message = self._decode(frames, replies)
            if message is None:
                continue
            request = _Pending(message, len(replies), started, _size(frames))
            if group and (message.header.op is not Op.PUT or group_size + request.size > limit):
                self._put_group(group, replies)
                group, group_size = [], 0
            if message.header.op is Op.PUT:
                group.append(request)
                group_size += request.size
                replies.append([])  # filled in by _put_group
            else:
                replies.append(self._handle_one(request))
        if group:
            self._put_group(group, replies)
        return replies

    def _decode(self, frames: list[Frame], replies: list[list[Frame]]) -> Message | None:
        """The request, or None with an error reply appended."""
        try:
            message = decode(frames, limits=self.limits, token=self._token)
            header = message.header
            if header.is_reply or header.status != Status.OK:
                raise ProtocolError("a request must not carry the reply flag or a status")
        except AuthError as exc:
            replies.append(self._fail(_peek(frames), Status.UNAUTHORIZED, "unauthorized", exc))
            return None
        except ProtocolError as exc:
            replies.append(self._fail(_peek(frames), Status.BAD_REQUEST, "bad_request", exc))
            return None
        except Exception as exc:  # a bug must cost one reply, never the daemon
            log.exception("request decoding failed")
            replies.append(self._fail(_peek(frames), Status.UNAVAILABLE, "internal", exc))
            return None
        return message

    def _handle_one(self, request: _Pending) -> list[Frame]:
        header = request.message.header
        try:
            items, data, statuses = self._dispatch(request.message)
            out = self._reply(header, items, data)
        except ReplyTooLargeError as exc:
            return self._fail(header, Status.TOO_LARGE, "too_large", exc)
        except ProtocolError as exc:
            return self._fail(header, Status.BAD_REQUEST, "bad_request", exc)
        except (KVCacheError, lmdb.Error, OSError) as exc:
            log.error("request %s failed in the store: %s", _describe(header), exc)
            return self._fail(header, Status.UNAVAILABLE, "storage", exc)
        except Exception as exc:  # a bug must cost one reply, never the daemon
            log.exception("request %s failed", _describe(header))
            return self._fail(header, Status.UNAVAILABLE, "internal", exc)
        self._observe(request, out, statuses)
        return out

    def _put_group(self, group: list[_Pending], replies: list[list[Frame]]) -> None:
        """Store consecutive PUT requests in one transaction; fill in their replies."""
        try:
            results = self.store.put_many([(r.message.items, r.message.data) for r in group])
        except (KVCacheError, lmdb.Error, OSError) as exc:
            log.error("%d PUT request(s) failed in the store: %s", len(group), exc)
            for r in group:
                replies[r.slot] = self._fail(r.message.header, Status.UNAVAILABLE, "storage", exc)
            return
        except Exception as exc:  # a bug must cost the replies, never the daemon
            log.exception("%d PUT request(s) failed", len(group))
            for r in group:
                replies[r.slot] = self._fail(r.message.header, Status.UNAVAILABLE, "internal", exc)
            return
        for request, result in zip(group, results, strict=True):
            header = request.message.header
            if isinstance(result, ProtocolError):
                replies[request.slot] = self._fail(
                    header, Status.BAD_REQUEST, "bad_request", result
                )
                continue
            out = self._reply(header, result, b"")
            self._observe(request, out, result["status"])
            replies[request.slot] = out

    def _reply(
        self, header: Header, items: npt.NDArray[np.void], data: bytes | memoryview
    ) -> list[Frame]:
        reply = Header(
            op=header.op, request_id=header.request_id, count=len(items), flags=FLAG_REPLY
        )
        return encode(reply, items, data, token=self._token)

    def _observe(
        self, request: _Pending, out: list[Frame], statuses: npt.NDArray[np.uint8] | None
    ) -> None:
        """Metrics of one answered request: one bincount of its item statuses."""
        counts = None if statuses is None else np.bincount(statuses, minlength=16)[:16]
        self.metrics.observe(
            request.message.header.op,
            time.perf_counter() - request.started,
            bytes_in=request.size,
            bytes_out=_size(out),
            counts=counts,
        )
        if counts is not None and counts[0] != len(statuses):  # type: ignore[arg-type]
            for status, kind in _COUNTED_ITEM_ERRORS:
                if n := int(counts[status]):
                    self.metrics.error(kind, n)

    def _dispatch(
        self, message: Message
    ) -> tuple[npt.NDArray[np.void], bytes | memoryview, npt.NDArray[np.uint8] | None]:
        """Every op but PUT, which :meth:`_put_group` stores."""
        op = message.header.op
        items = message.items
        cls = message.header.traffic_class
        if op is Op.GET:
            bad = items["index"] > MAX_SHARD_INDEX
            if bad.any():
                reply, data = self.store.get(items[~bad], cls)
                full = make_items(Op.GET, len(items), reply=True)
                full["status"] = Status.BAD_ITEM
                full[~bad] = reply
                self._count_hits("get", cls, full["status"])
                return full, data, full["status"]
            reply, data = self.store.get(items, cls)
            self._count_hits("get", cls, reply["status"])
            return reply, data, reply["status"]
        if op is Op.HAS:
            return self.store.has(items), b"", None
        if op is Op.TOUCH:
            reply = self.store.touch(items, cls)
            self._count_hits("touch", cls, reply["status"])
            return reply, b"", reply["status"]
        if op is Op.DELETE:
            bad = (items["index"] > MAX_SHARD_INDEX) & (items["index"] != NO_INDEX)
            reply = make_items(Op.DELETE, len(items), reply=True)
            reply["status"] = Status.BAD_ITEM
            if (~bad).any():
                reply[~bad] = self.store.delete(items[~bad])
            return reply, b"", reply["status"]
        # Op.STATS
        return make_items(Op.STATS, 0, reply=True), json.dumps(self.stats()).encode(), None

    def _count_hits(self, kind: str, cls: str, statuses: npt.NDArray[np.uint8]) -> None:
        """Hits by the class the policy counts them under (unnamed: ``unlabelled``)."""
        n = int(np.count_nonzero(statuses == Status.OK))
        if n:
            name = self.store.policy.resolve(cls) if cls else "unlabelled"
            self.metrics.hit(kind, name, n)

    def stats(self) -> dict[str, Any]:
        """What STATS and ``/stats`` report."""
        snapshot = self.metrics.snapshot()
        counters = dict(self.store.counters)
        for kind, n in store_errors(counters).items():
            if n:
                snapshot["errors"][kind] = snapshot["errors"].get(kind, 0) + n
        return {
            "node_id": self.config.node_id,
            "usage": self.store.usage(),
            "gc": {k: v for k, v in counters.items() if not k.startswith("error_")},
            "policy": self.store.policy.to_dict(),
            **snapshot,
        }

    def _fail(
        self,
        header: Header | None,
        status: Status,
        kind: str,
        exc: BaseException,
    ) -> list[Frame]:
        self.metrics.error(kind)
        log.debug("request %s refused (%s): %s", _describe(header), kind, exc)
        try:
            return error_reply(header, status, f"{kind}: {exc}", token=self._token)
        except Exception:  # pragma: no cover - a header that decoded always re-encodes
            return error_reply(None, status, kind, token=self._token)

    # ------------------------------------------------------------------ socket loop

    def bind(self) -> str:
        """Create and bind the ROUTER socket; returns the bound endpoint (port 0 resolved)."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.SNDHWM, self.config.hwm)
        sock.setsockopt(zmq.RCVHWM, self.config.hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.config.listen)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise KVCacheError(f"cannot bind data endpoint {self.config.listen}: {exc}") from None
        self._sock = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return self.endpoint

    def serve(self, stop: threading.Event) -> None:
        """Answer requests until ``stop`` is set; the request in flight is finished first."""
        if self._sock is None or self._monitor is None:
            raise RuntimeError("bind() first")
        sock, monitor = self._sock, self._monitor
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        self.serving.set()
        more_work = True
        last_maintain = 0.0
        try:
            while not stop.is_set():
                events = dict(poller.poll(0 if more_work else _IDLE_POLL_MS))
                if sock in events:
                    answered = 0
                    while answered < _BURST and not stop.is_set():
                        if not (n := self._serve_one(sock)):
                            break
                        answered += n
                if monitor in events:
                    self._drain_monitor(monitor)
                if self._wake_r in events:
                    self._drain_wake()
                self._run_calls()
                now = time.monotonic()
                if more_work or not events or now - last_maintain >= _MAINTAIN_EVERY_S:
                    last_maintain = now
                    more_work = self._maintain()
        finally:
            self.serving.clear()
            self._run_calls()
            self.close()

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the service thread between requests (how other threads reach the store)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._calls.put((fn, future))
        self.wake()
        return future

    def wake(self) -> None:
        """Interrupt the idle poll (thread- and signal-safe)."""
        # A full pipe means already woken; a closed one means shutting down.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def close(self) -> None:
        """Close the sockets (linger 0); idempotent."""
        for sock in (self._monitor, self._sock):
            if sock is not None:
                sock.close(linger=0)
        self._sock = self._monitor = None
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def _serve_one(self, sock: zmq.Socket[Any]) -> int:
        """Answer the next request, and the PUTs queued right behind a PUT (group commit).

        Returns how many requests were answered (0: none was waiting).
        """
        received = self._recv(sock)
        if received is None:
            return 0
        batch = [received]
        if _is_put(received[1]):
            budget = self._group_bytes - _size(received[1])
            while len(batch) < _GROUP_REQUESTS and budget > 0:
                more = self._recv(sock)
                if more is None:
                    break
                batch.append(more)
                if not _is_put(more[1]):
                    break
                budget -= _size(more[1])
        replies = iter(self.handle_many([frames for _, frames, dropped in batch if not dropped]))
        for identity, frames, dropped in batch:
            reply = (
                self._fail(
                    _peek(frames),
                    Status.BAD_REQUEST,
                    "bad_request",
                    ProtocolError(
                        f"message has {len(frames) + dropped} frames, at most {MAX_FRAMES}"
                    ),
                )
                if dropped
                else next(replies)
            )
            try:
                _send_reply(sock, identity, reply)
            except zmq.ZMQError as exc:  # pragma: no cover - peer gone with ROUTER_MANDATORY off
                log.debug("reply not sent: %s", exc)
        return len(batch)

    @staticmethod
    def _recv(sock: zmq.Socket[Any]) -> tuple[zmq.Frame, list[Frame], int] | None:
        """(identity, up to MAX_FRAMES frames, frames dropped beyond that) of a waiting message."""
        try:
            identity = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        frames: list[Frame] = []
        dropped = 0
        frame = identity
        while frame.more:
            frame = sock.recv(copy=False)
            if len(frames) < MAX_FRAMES:
                frames.append(frame.buffer)
            else:
                dropped += 1
        return identity, frames, dropped

    def _maintain(self) -> bool:
        try:
            return self.store.maintain()
        except (KVCacheError, lmdb.Error, OSError) as exc:
            log.error("retention work failed: %s", exc)
            self.metrics.error("gc")
            return False

    def _drain_monitor(self, monitor: zmq.Socket[Any]) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.metrics.connections += 1
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.metrics.connections = max(0, self.metrics.connections - 1)
                self.metrics.disconnects += 1

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _run_calls(self) -> None:
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)


_COUNTED_ITEM_ERRORS = (
    (int(Status.BAD_ITEM), "bad_item"),
    (int(Status.CHECKSUM), "checksum"),
    (int(Status.WRONG_KEY), "wrong_key"),
    (int(Status.NO_SPACE), "no_space"),
    (int(Status.INTERNAL), "internal_item"),
)


@dataclass(slots=True)
class _Pending:
    """A decoded request waiting for its reply: where the reply goes, when it began."""

    message: Message
    slot: int
    started: float
    size: int


def _peek(frames: list[Frame]) -> Header | None:
    """The request's header if it parses (so an error reply carries its request id)."""
    try:
        return Header.unpack(frames[0]) if frames else None
    except ProtocolError:
        return None


def _is_put(frames: list[Frame]) -> bool:
    """Whether a request's header frame names a PUT (checked properly when decoded)."""
    return bool(frames) and len(frames[0]) == HEADER_BYTES and frames[0][3] == _PUT


_PUT = int(Op.PUT)


_SNDMORE = int(zmq.SNDMORE)
#: Frames at least this large are sent without a copy (zmq keeps a reference instead).
_ZERO_COPY_BYTES = 1 << 16


def _send_reply(sock: zmq.Socket[Any], identity: zmq.Frame, frames: list[Frame]) -> None:
    """``send_multipart([identity, *frames], copy=False)`` without its per-frame Python cost.

    Small frames are copied (cheaper than a zero-copy frame's bookkeeping),
    the large data frame is handed over without a copy. Measured: GET
    throughput +14 % at window 1 against ``send_multipart``.
    """
    sock.send(identity, _SNDMORE, copy=False)
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, _SNDMORE if i < last else 0, copy=len(frame) < _ZERO_COPY_BYTES)


def _size(frames: list[Frame]) -> int:
    return sum(len(f) for f in frames)


def _describe(header: Header | None) -> str:
    return "<undecodable>" if header is None else f"{header.op.name}#{header.request_id}"
