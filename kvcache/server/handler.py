"""Request handling of the data path: a parsed request in, reply sections out. No I/O.

:class:`RequestHandler` turns a tenant's :class:`~kvcache.wire.Message` into
a :class:`Reply` by calling the :class:`~kvcache.server.store.ShardStore`,
counts it in :class:`~kvcache.server.metrics.Metrics`, and never raises: bad
input gets an error reply and a counter, a store failure an UNAVAILABLE
reply. The socket loop (:mod:`kvcache.server.loop`) owns connections and
sends what this returns; tests call it directly.

Group commit: :meth:`RequestHandler.handle_puts` stores PUT requests of
several connections that arrived together in one LMDB transaction (measured:
no gain with ``sync = "periodic"``, 5-21 % less time per batch with
``sync = "commit"``, where every transaction pays an fsync).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from kvcache.credentials import TenantId
from kvcache.errors import KVCacheError, ProtocolError, StorageError
from kvcache.net_loop import FileRange, frame_nbytes
from kvcache.server.metrics import Metrics, store_errors
from kvcache.server.scrub import Scrubber
from kvcache.server.store import PutBatch, ReplyTooLargeError, ShardStore
from kvcache.server.swa_directory import SwaDirectory
from kvcache.wire import (
    FLAG_REPLY,
    LIST_INCLUSIVE,
    LIST_MAX_PAGE,
    NO_INDEX,
    Frame,
    Header,
    Message,
    Op,
    Status,
    error_reply,
    make_items,
    pack_header,
)

if TYPE_CHECKING:
    from kvcache.events.publisher import EventPublisher

__all__ = ["MAX_SHARD_INDEX", "Reply", "RequestHandler"]

#: One section of a reply: a buffer, or records sent with ``sendfile``.
Section = Frame | FileRange

log = logging.getLogger(__name__)

#: Largest valid shard index (k + m <= 255 in shard format v1).
MAX_SHARD_INDEX = 254

#: Ops whose item outcomes count as hits and misses per class, by the kind they count as.
_HIT_KINDS = {Op.GET: "get", Op.TOUCH: "touch"}
_OK = int(Status.OK)
_NOT_FOUND = int(Status.NOT_FOUND)

_COUNTED_ITEM_ERRORS = (
    (int(Status.BAD_ITEM), "bad_item"),
    (int(Status.CHECKSUM), "checksum"),
    (int(Status.WRONG_KEY), "wrong_key"),
    (int(Status.NO_SPACE), "no_space"),
    (int(Status.INTERNAL), "internal_item"),
    (int(Status.CONFLICT), "conflict"),
    (int(Status.QUOTA), "quota"),
)


@dataclass(slots=True)
class Reply:
    """Sections to send, and what to call once they are sent (ends a GET's read transaction)."""

    frames: list[Section]
    release: Callable[[], None] | None = None
    nbytes: int = field(default=0)

    def done(self) -> None:
        """The reply was sent (or the connection is gone): release what it held."""
        if self.release is not None:
            self.release()
            self.release = None


@dataclass(frozen=True, slots=True)
class Request:
    """A request of an authenticated tenant, as the loop hands it over."""

    tenant: TenantId
    message: Message
    received: float
    size: int


class RequestHandler:
    """Answers requests against one store; owned by the thread that owns the store."""

    def __init__(
        self,
        store: ShardStore,
        metrics: Metrics,
        *,
        node_id: str,
        tenant_names: dict[TenantId, str] | None = None,
        swa_directory: SwaDirectory | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.node_id = node_id
        self.tenant_names = tenant_names or {}
        #: SWA holder records (DIR_PUT, HAS_DIR), in RAM: see kvcache.server.swa_directory.
        self.swa_directory = swa_directory if swa_directory is not None else SwaDirectory()
        #: Background re-verification of stored shards (set by the daemon; None: none).
        self.scrubber: Scrubber | None = None
        #: The event stream (kvcache.events), told of every stored shard; None: off.
        self.events: EventPublisher | None = None

    # ------------------------------------------------------------------ entry points

    def handle(self, request: Request) -> Reply:
        """The reply to one request other than PUT (or a PUT on its own). Never raises."""
        if request.message.header.op is Op.PUT:
            return self.handle_puts([request])[0]
        header = request.message.header
        try:
            reply, statuses = self._dispatch(request)
        except ReplyTooLargeError as exc:
            return self.fail(header, Status.TOO_LARGE, "too_large", exc)
        except ProtocolError as exc:
            return self.fail(header, Status.BAD_REQUEST, "bad_request", exc)
        except StorageError as exc:
            log.error("request %s failed in the store: %s", _describe(header), exc)
            self.metrics.error(f"store_{exc.kind}")
            return self.fail(header, Status.UNAVAILABLE, "storage", exc)
        except Exception as exc:  # a bug must cost one reply, never the daemon
            log.exception("request %s failed", _describe(header))
            return self.fail(header, Status.UNAVAILABLE, "internal", exc)
        self._observe(request, reply, statuses)
        return reply

    def handle_puts(self, requests: Sequence[Request]) -> list[Reply]:
        """Store PUT requests (of any tenants) in one transaction; one reply each."""
        try:
            results = self.store.put_many(
                [
                    PutBatch(r.tenant, r.message.items, r.message.data, r.message.header.retain)
                    for r in requests
                ]
            )
        except (KVCacheError, OSError) as exc:
            log.error("%d PUT request(s) failed in the store: %s", len(requests), exc)
            return [
                self.fail(r.message.header, Status.UNAVAILABLE, "storage", exc) for r in requests
            ]
        except Exception as exc:  # a bug must cost the replies, never the daemon
            log.exception("%d PUT request(s) failed", len(requests))
            return [
                self.fail(r.message.header, Status.UNAVAILABLE, "internal", exc) for r in requests
            ]
        replies = []
        for request, result in zip(requests, results, strict=True):
            header = request.message.header
            if isinstance(result, ProtocolError):
                replies.append(self.fail(header, Status.BAD_REQUEST, "bad_request", result))
                continue
            reply = Reply(_frames(header, result, b""))
            self._observe(request, reply, result["status"])
            if self.events is not None:
                ok = result["status"] == Status.OK
                if ok.any():
                    self.events.stored(request.tenant, request.message.items[ok])
            replies.append(reply)
        return replies

    def fail(
        self, header: Header | None, status: Status, kind: str, exc: BaseException | str
    ) -> Reply:
        """An error reply, counted under ``kind``."""
        self.metrics.error(kind)
        log.debug("request %s refused (%s): %s", _describe(header), kind, exc)
        return Reply([*error_reply(header, status, f"{kind}: {exc}")])

    # ------------------------------------------------------------------ ops

    def _dispatch(self, request: Request) -> tuple[Reply, npt.NDArray[np.uint8] | None]:
        message, tenant = request.message, request.tenant
        op = message.header.op
        items = message.items
        cls = message.header.traffic_class
        header = message.header
        if op is Op.GET:
            bad = items["index"] > MAX_SHARD_INDEX
            if bad.any():
                result = self.store.get(tenant, items[~bad], cls, header.retain)
                full = make_items(Op.GET, len(items), reply=True)
                full["status"] = Status.BAD_ITEM
                full[~bad] = result.items
                result.items = full
            else:
                result = self.store.get(tenant, items, cls, header.retain)
            statuses = result.items["status"]
            nbytes = result.nbytes
            frames = _frames(header, result.items, b"", data_len=nbytes)
            return Reply([*frames, *result.parts], result.release, nbytes), statuses
        if op is Op.HAS:
            return Reply(_frames(header, self.store.has(tenant, items), b"")), None
        if op is Op.HAS_DIR:
            answer = self.swa_directory.lookup(tenant, items)
            has = self.store.has(tenant, items)
            return Reply(_frames(header, has, answer.tobytes())), None
        if op is Op.DIR_PUT:
            statuses = self.swa_directory.put(tenant, items)
            reply = make_items(Op.DIR_PUT, len(items), reply=True)
            reply["status"] = statuses
            return Reply(_frames(header, reply, b"")), statuses
        if op is Op.LIST:
            if len(items) != 1:
                raise ProtocolError(f"LIST takes exactly one item, got {len(items)}")
            limit = int(items["limit"][0])
            if not 1 <= limit <= LIST_MAX_PAGE:
                raise ProtocolError(f"LIST limit must be 1..{LIST_MAX_PAGE}, got {limit}")
            flags = int(items["flags"][0])
            if flags & ~LIST_INCLUSIVE:
                raise ProtocolError(f"unknown LIST flags 0x{flags:04x}")
            listed = self.store.list_shards(
                tenant,
                bytes(items["key"][0]),
                int(items["index"][0]),
                inclusive=bool(flags & LIST_INCLUSIVE),
                limit=limit,
            )
            return Reply(_frames(header, listed, b"")), None
        if op is Op.SWA_GET:
            raise ProtocolError("SWA_GET goes to the worker holding the state, not a daemon")
        if op is Op.TOUCH:
            reply = self.store.touch(tenant, items, cls, header.retain)
            return Reply(_frames(header, reply, b"")), reply["status"]
        if op is Op.DELETE:
            bad = (items["index"] > MAX_SHARD_INDEX) & (items["index"] != NO_INDEX)
            reply = make_items(Op.DELETE, len(items), reply=True)
            reply["status"] = Status.BAD_ITEM
            if (~bad).any():
                reply[~bad] = self.store.delete(tenant, items[~bad])
            return Reply(_frames(header, reply, b"")), reply["status"]
        # Op.STATS: over the data path a tenant sees the node's totals and its own usage,
        # never other tenants' names or usage (the admin /stats, for operators, shows all).
        body = json.dumps(self.stats(only_tenant=tenant)).encode()
        return Reply(_frames(header, make_items(Op.STATS, 0, reply=True), body)), None

    def _count_hits(self, kind: str, cls: str, counts: npt.NDArray[np.intp]) -> None:
        """Hits and misses by the class the policy counts them under (unnamed: ``unlabelled``)."""
        n = int(counts[_OK])
        missed = int(counts[_NOT_FOUND])
        if n or missed:
            name = self.store.policy.resolve(cls) if cls else "unlabelled"
            if n:
                self.metrics.hit(kind, name, n)
            if missed:
                self.metrics.miss(kind, name, missed)

    def _observe(
        self, request: Request, reply: Reply, statuses: npt.NDArray[np.uint8] | None
    ) -> None:
        """Metrics of one answered request: one bincount of its item statuses."""
        header = request.message.header
        counts = None if statuses is None else np.bincount(statuses, minlength=16)[:16]
        frames = reply.frames
        if reply.nbytes:  # a GET reply: header, items, then the records' nbytes
            bytes_out = frame_nbytes(frames[0]) + frame_nbytes(frames[1]) + reply.nbytes
        else:
            bytes_out = sum(frame_nbytes(f) for f in frames)
        self.metrics.observe(
            header.op,
            time.perf_counter() - request.received,
            bytes_in=request.size,
            bytes_out=bytes_out,
            counts=counts,
        )
        if counts is None or statuses is None:
            return
        kind = _HIT_KINDS.get(header.op)
        if kind is not None:
            self._count_hits(kind, header.traffic_class, counts)
        if counts[0] != len(statuses):
            for status, kind in _COUNTED_ITEM_ERRORS:
                if n := int(counts[status]):
                    self.metrics.error(kind, n)

    def stats(self, only_tenant: TenantId | None = None) -> dict[str, Any]:
        """What ``/stats`` reports; STATS (``only_tenant``) lists that tenant's usage alone."""
        snapshot = self.metrics.snapshot()
        counters = dict(self.store.counters)
        for kind, n in store_errors(counters).items():
            if n:
                snapshot["errors"][kind] = snapshot["errors"].get(kind, 0) + n
        usage = self.store.usage(self.tenant_names)
        if only_tenant is not None:
            name = self.tenant_names.get(only_tenant, only_tenant.hex())
            usage["tenants"] = {n: u for n, u in usage.get("tenants", {}).items() if n == name}
        return {
            "node_id": self.node_id,
            "lmdb_writemap": self.store.writemap,
            "usage": usage,
            "gc": {k: v for k, v in counters.items() if not k.startswith("error_")},
            "policy": self.store.policy.to_dict(),
            "swa_directory": self.swa_directory.stats(),
            **({"scrub": self.scrubber.stats()} if self.scrubber is not None else {}),
            **({"events": self.events.stats()} if self.events is not None else {}),
            **snapshot,
        }


def _frames(
    request: Header, items: npt.NDArray[np.void], data: bytes, *, data_len: int | None = None
) -> list[Section]:
    """Header and items of a reply (and ``data``); for GET the records follow as views."""
    head = pack_header(
        request.op,
        request.request_id,
        len(items),
        data_len=len(data) if data_len is None else data_len,
        flags=FLAG_REPLY,
    )
    frames: list[Section] = [head, np.ascontiguousarray(items).view(np.uint8).data]
    if data:
        frames.append(data)
    return frames


def _describe(header: Header | None) -> str:
    return "<undecodable>" if header is None else f"{header.op.name}#{header.request_id}"
