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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcache.errors import ArgumentError, ProtocolError
from kvcache.keys import BlockKey
from kvcache.swa_local.state import DIGEST_BYTES, StateKey
from kvcache.wire import (
    DIR_ANSWER_DTYPE,
    Op,
    Status,
    data_offsets,
    make_items,
    parse_endpoint,
)

__all__ = [
    "FetchAnswer",
    "HolderRecord",
    "get_items",
    "parse_answers",
    "parse_get_reply",
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


def get_items(wanted: Sequence[tuple[StateKey, int]]) -> npt.NDArray[np.void]:
    """SWA_GET request items for (state key, expected holder incarnation) pairs."""
    items = make_items(Op.SWA_GET, len(wanted), reply=False)
    for i, (key, incarnation) in enumerate(wanted):
        row = items[i]
        row["key"] = key.block
        row["position"] = key.position
        row["state_ns"] = key.namespace
        row["incarnation"] = incarnation
    return items


@dataclass(frozen=True, slots=True)
class FetchAnswer:
    """One state of an SWA_GET reply: its status, and where its bytes lie in the data."""

    status: Status
    offset: int
    length: int
    digest: bytes


def parse_get_reply(items: npt.NDArray[np.void], asked: int) -> list[FetchAnswer]:
    """The answers of an SWA_GET reply to ``asked`` items (ProtocolError if malformed)."""
    if len(items) != asked:
        raise ProtocolError(f"SWA_GET reply has {len(items)} items for {asked} asked")
    offsets = data_offsets(items).tolist()
    out = []
    for row, offset in zip(items, offsets, strict=True):
        try:
            status = Status(int(row["status"]))
        except ValueError:
            raise ProtocolError(f"unknown item status {int(row['status'])}") from None
        length = int(row["length"])
        if status is not Status.OK and length:
            raise ProtocolError("a state that is not OK carries bytes")
        out.append(FetchAnswer(status, offset, length, bytes(row["digest"])))
    return out
