"""The SWA tier's messages on the data path's wire format, without I/O.

Two exchanges, both framed by :mod:`kvcache.wire` (``docs/spec/swa.md``):

- ``SWA_GET`` (worker to worker): items name the states wanted (prefix block
  key, position, state namespace, and the holder *incarnation* the asker
  expects); the reply gives each a status, length and digest, and carries the
  states' bytes back to back in its data section.
- ``DIR_PUT`` / ``HAS_DIR`` (worker to storage daemon): holder records, built
  and read here as :class:`HolderRecord`.

Everything read from a peer is validated here and raises only
:class:`~kvcache.errors.ProtocolError`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.errors import ArgumentError, ProtocolError
from kvcache.keys import BlockKey
from kvcache.swa_local.state import DIGEST_BYTES, StateKey
from kvcache.wire import (
    DIR_ANSWER_DTYPE,
    FLAG_REPLY,
    Header,
    Op,
    Status,
    make_items,
    pack_header,
    parse_endpoint,
)

__all__ = [
    "GET_ITEM",
    "GET_REPLY_ITEM",
    "FetchAnswer",
    "GetItem",
    "HolderRecord",
    "get_reply",
    "get_request",
    "parse_answers",
    "parse_get_reply",
    "parse_get_request",
    "record_items",
]

MAX_ENDPOINT = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class HolderRecord:
    """Worker ``endpoint`` (incarnation ``incarnation``) holds state ``key`` of ``nbytes``
    bytes with ``digest``, for ``ttl_s`` more seconds."""

    key: StateKey
    endpoint: str
    incarnation: int
    nbytes: int
    digest: bytes
    ttl_s: float

    def __post_init__(self) -> None:
        try:
            parse_endpoint(self.endpoint)
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None
        if len(self.endpoint.encode("ascii", "replace")) > MAX_ENDPOINT:
            raise ArgumentError(f"endpoint longer than {MAX_ENDPOINT} bytes: {self.endpoint!r}")
        if not 0 <= self.incarnation < 2**64 or self.nbytes < 1:
            raise ArgumentError("incarnation must be a u64 and nbytes >= 1")
        if len(self.digest) != DIGEST_BYTES:
            raise ArgumentError(f"digest must be {DIGEST_BYTES} bytes")


def record_items(records: Sequence[HolderRecord]) -> npt.NDArray[np.void]:
    """DIR_PUT request items for ``records`` (``ttl_s`` 0 withdraws a record)."""
    items = make_items(Op.DIR_PUT, len(records), reply=False)
    for i, r in enumerate(records):
        row = items[i]
        row["key"] = r.key.block
        row["position"] = r.key.position
        row["ttl_ms"] = max(0, min(2**32 - 1, round(r.ttl_s * 1000)))
        row["incarnation"] = r.incarnation
        row["state_ns"] = r.key.namespace
        row["nbytes"] = r.nbytes
        row["digest"] = r.digest
        row["endpoint"] = r.endpoint.encode("ascii")
    return items


def parse_answers(
    data: memoryview | bytes, keys: Sequence[BlockKey], ordinals_to_blocks: npt.NDArray[np.int64]
) -> list[tuple[int, HolderRecord]]:
    """(block index, record) of a HAS_DIR answer's data section; a record that does not
    parse (or names another key than the one asked) raises ProtocolError.

    ``ordinals_to_blocks[j]`` is the block (index into ``keys``) that item ``j`` of the
    request asked about.
    """
    raw = memoryview(data).cast("B")
    if raw.nbytes % DIR_ANSWER_DTYPE.itemsize:
        raise ProtocolError(f"directory answer of {raw.nbytes} bytes is not whole records")
    rows = np.frombuffer(raw, DIR_ANSWER_DTYPE)
    out: list[tuple[int, HolderRecord]] = []
    for row in rows:
        ordinal = int(row["ordinal"])
        if ordinal >= len(ordinals_to_blocks):
            raise ProtocolError(f"directory answer for item {ordinal} that was not asked")
        block = int(ordinals_to_blocks[ordinal])
        rec = row["record"]
        if bytes(rec["key"]) != keys[block]:
            raise ProtocolError("directory answer names another key than the one asked")
        try:
            record = HolderRecord(
                key=StateKey(
                    namespace=bytes(rec["state_ns"]),
                    block=BlockKey(bytes(rec["key"])),
                    position=int(rec["position"]),
                ),
                endpoint=bytes(rec["endpoint"]).decode("ascii"),
                incarnation=int(rec["incarnation"]),
                nbytes=int(rec["nbytes"]),
                digest=bytes(rec["digest"]),
                ttl_s=int(rec["ttl_ms"]) / 1000,
            )
        except (ArgumentError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"malformed directory record: {exc}") from None
        out.append((block, record))
    return out


#: One SWA_GET request item, as ``wire.ITEM_DTYPES[(Op.SWA_GET, False)]`` lays it out:
#: key, position, pad, state namespace, incarnation. ``struct`` rather than numpy records:
#: a fetch asks for one state or a few, where a numpy field access costs microseconds.
GET_ITEM = struct.Struct("<16sI4x8sQ")
#: One SWA_GET reply item (``wire.ITEM_DTYPES[(Op.SWA_GET, True)]``): status, pad, length,
#: digest.
GET_REPLY_ITEM = struct.Struct("<B3xI16s")
_OK = int(Status.OK)
_STATUSES = {int(s): s for s in Status}


def get_request(request_id: int, wanted: Sequence[tuple[StateKey, int]]) -> bytes:
    """An SWA_GET request (header and items) for (state key, expected holder incarnation)
    pairs."""
    header = Header(op=Op.SWA_GET, request_id=request_id, count=len(wanted))
    pack = GET_ITEM.pack
    return header.pack() + b"".join(
        pack(key.block, key.position, key.namespace, incarnation) for key, incarnation in wanted
    )


@dataclass(frozen=True, slots=True)
class GetItem:
    """One state an SWA_GET request asks for, as read off the wire (unvalidated)."""

    block: bytes
    position: int
    namespace: bytes
    incarnation: int


def parse_get_request(items: bytes | memoryview) -> list[GetItem]:
    """The items of an SWA_GET request (whole items: the reader checked the size)."""
    return [GetItem(*fields) for fields in GET_ITEM.iter_unpack(items)]


@dataclass(frozen=True, slots=True)
class FetchAnswer:
    """One state of an SWA_GET reply: its status, and where its bytes lie in the data."""

    status: Status
    offset: int
    length: int
    digest: bytes


def get_reply(request_id: int, answers: Sequence[tuple[Status, int, bytes]]) -> bytes:
    """The header and items of the SWA_GET reply to request ``request_id`` for (status,
    length, digest) answers; the states' bytes follow it, back to back in item order."""
    pack = GET_REPLY_ITEM.pack
    items = b"".join([pack(st, n, d) for st, n, d in answers])
    data_len = sum([n for _, n, _ in answers])
    return (
        pack_header(Op.SWA_GET, request_id, len(answers), data_len=data_len, flags=FLAG_REPLY)
        + items
    )


def parse_get_reply(items: bytes | memoryview, asked: int, data_len: int) -> list[FetchAnswer]:
    """The answers of an SWA_GET reply to ``asked`` items, from its items section, checked
    against its data section's length (ProtocolError if malformed)."""
    if len(items) != asked * GET_REPLY_ITEM.size:
        raise ProtocolError(
            f"SWA_GET reply has {len(items) / GET_REPLY_ITEM.size:g} items for {asked} asked"
        )
    out = []
    offset = 0
    for status, length, digest in GET_REPLY_ITEM.iter_unpack(items):
        if status != _OK:
            if status not in _STATUSES:
                raise ProtocolError(f"unknown item status {status}")
            if length:
                raise ProtocolError("a state that is not OK carries bytes")
        out.append(FetchAnswer(_STATUSES[status], offset, length, digest))
        offset += length
    if offset != data_len:
        raise ProtocolError(f"item lengths add up to {offset}, data section is {data_len}")
    return out
