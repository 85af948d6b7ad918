"""The write path's bytes, without I/O: payloads → shard records → per-node PUT sections.

Each shard is laid out once, as the record a daemon stores (header, then
body), in one array of the whole batch: data rows are copied in from the
caller's payloads (one copy per block), into records laid out node by node,
parity is computed straight into the records' parity bodies by
:meth:`kvcache.erasure.Codec.encode_rows`, and headers come from
:func:`kvcache.shard.build_headers`, the one vectorised home of the header
layout. A node's PUT is then one slice of the records, sent with one
``sendmsg``: the payload bytes are copied once, and there is no Python object
per shard on the hot path (measured on 2 cores: per-shard views cost more
than the copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from kvcache.erasure import Codec
from kvcache.errors import ConfigError
from kvcache.keys import BlockKey
from kvcache.shard import HEADER_BYTES, HEADER_DTYPE, build_headers, new_stripe_id, shard_len_for
from kvcache.wire import Op, make_items

__all__ = ["EncodedBatch", "as_payload_rows", "encode_batch"]

Payloads = Sequence[Any] | npt.NDArray[np.uint8]


def as_payload_rows(payloads: Payloads, payload_len: int) -> list[npt.NDArray[np.uint8]]:
    """Each payload as a flat, contiguous uint8 array of exactly ``payload_len`` bytes.

    Raises ConfigError (before any I/O) for a payload of another size, dtype or layout.
    """
    if isinstance(payloads, np.ndarray):
        if payloads.ndim != 2 or payloads.dtype != np.uint8 or not payloads.flags.c_contiguous:
            raise ConfigError(
                "payloads as an array must be a C-contiguous uint8 array of shape "
                f"(blocks, {payload_len}); got {payloads.dtype} {payloads.shape}"
            )
        if payloads.shape[1] != payload_len:
            raise ConfigError(
                f"payload rows are {payloads.shape[1]} bytes, the layout needs {payload_len}"
            )
        return list(payloads)
    rows = []
    for b, payload in enumerate(payloads):
        try:
            view = memoryview(payload)
        except TypeError:
            raise ConfigError(
                f"payload {b} is a {type(payload).__name__}, not a bytes-like object or array"
            ) from None
        if not view.contiguous:
            raise ConfigError(f"payload {b} is not contiguous in memory")
        if view.nbytes != payload_len:
            raise ConfigError(f"payload {b} is {view.nbytes} bytes, the layout needs {payload_len}")
        rows.append(np.frombuffer(view.cast("B"), np.uint8))
    return rows


@dataclass(slots=True)
class EncodedBatch:
    """A batch of encoded blocks: every shard's record (header and body), ready to be sent.

    ``records`` holds the records in node order (see :func:`encode_batch`), so the
    shards of one node are consecutive rows and its PUT section is a slice.
    """

    keys: list[BlockKey]
    stripe_ids: npt.NDArray[np.uint64]
    #: (blocks * n, HEADER_BYTES + shard_len): shard i of block b is records[position[b, i]].
    records: npt.NDArray[np.uint8]
    position: npt.NDArray[np.int64]
    shard_len: int

    @property
    def headers(self) -> npt.NDArray[np.void]:
        """(blocks, n) shard headers, one HEADER_DTYPE record each."""
        raw = np.ascontiguousarray(self.records[self.position, :HEADER_BYTES])
        return raw.view(HEADER_DTYPE).reshape(self.position.shape)

    def node_sections(
        self, blocks: npt.NDArray[np.int64], indices: npt.NDArray[np.int64], expect: Any = 0
    ) -> tuple[npt.NDArray[np.void], list[memoryview]]:
        """PUT items and the data section for the shards (blocks[j], indices[j]) of one node:
        a slice of the records when they are that node's rows (always, for the holders the
        batch was laid out for), else a gathered copy."""
        items = make_items(Op.PUT, len(blocks), reply=False)
        key_words = np.frombuffer(b"".join(self.keys), "V16")
        items["key"] = key_words[blocks] if len(blocks) else b""
        items["index"] = indices
        items["length"] = HEADER_BYTES + self.shard_len
        items["expect"] = expect
        rows = self.position[blocks, indices]
        if len(rows) and rows[-1] - rows[0] == len(rows) - 1 and (np.diff(rows) == 1).all():
            section = self.records[int(rows[0]) : int(rows[-1]) + 1]
        else:
            section = self.records[rows]
        return items, [section.reshape(-1).data]


def encode_batch(
    codec: Codec,
    keys: Sequence[BlockKey],
    rows: Sequence[npt.NDArray[np.uint8]],
    *,
    payload_len: int,
    traffic_class: str,
    now_ms: int,
    ttl_ms: int = 0,
    holders: npt.NDArray[np.int64] | None = None,
) -> EncodedBatch:
    """Encode blocks whose payloads are ``rows`` (see :func:`as_payload_rows`).

    With ``holders`` (the node of each shard, (blocks, n)) the records are laid out
    node by node, each node's shards in block order: what each node is sent is then
    one slice, and the payload bytes are copied exactly once.
    """
    k, n = codec.params.k, codec.params.n
    blocks = len(keys)
    length = shard_len_for(payload_len, k)
    size = HEADER_BYTES + length
    flat = np.arange(blocks * n, dtype=np.int64)
    if holders is not None:
        flat[np.argsort(holders.reshape(-1), kind="stable")] = np.arange(blocks * n)
    position = flat.reshape(blocks, n)
    records = np.empty((blocks * n, size), np.uint8)
    bodies = records[:, HEADER_BYTES:]
    inside = payload_len // length  # data rows wholly inside the payload
    tail = payload_len - inside * length
    for b, row in enumerate(rows):  # one copy per block (per shard would cost far more)
        bodies[position[b, :inside]] = row[: inside * length].reshape(inside, length)
        if tail:
            bodies[position[b, inside], :tail] = row[inside * length :]
    # Padding: the rest of the row that crosses the payload's end, and rows past it.
    if tail:
        bodies[position[:, inside], tail:] = 0
    past = position[:, inside + (1 if tail else 0) : k].reshape(-1)
    if len(past):
        bodies[past] = 0
    offsets = position.astype(np.uint64) * np.uint64(size) + np.uint64(HEADER_BYTES)
    addresses: npt.NDArray[np.uint64] = np.uint64(records.ctypes.data) + offsets
    codec.encode_rows(addresses, length, keepalive=records)
    digest128 = xxhash.xxh3_128_digest
    payload_hashes = np.empty(blocks, "V16")
    for b, row in enumerate(rows):
        payload_hashes[b] = digest128(row.data)
    digest64 = xxhash.xxh3_64_intdigest
    view = records.reshape(-1).data
    shard_hashes = np.fromiter(
        (digest64(view[o : o + length]) for o in offsets.reshape(-1).tolist()),
        np.uint64,
        blocks * n,
    ).reshape(blocks, n)
    stripe_ids = np.array([new_stripe_id() for _ in range(blocks)], np.uint64)
    headers = build_headers(
        keys=np.frombuffer(b"".join(keys), "V16") if blocks else np.zeros(0, "V16"),
        stripe_ids=stripe_ids,
        k=k,
        m=n - k,
        payload_len=payload_len,
        payload_hashes=payload_hashes,
        shard_hashes=shard_hashes,
        traffic_class=traffic_class,
        created_ms=now_ms,
        expiry_ms=now_ms + ttl_ms,
    )
    records[position.reshape(-1), :HEADER_BYTES] = headers.view(np.uint8).reshape(
        blocks * n, HEADER_BYTES
    )
    return EncodedBatch(
        keys=list(keys),
        stripe_ids=stripe_ids,
        records=records,
        position=position,
        shard_len=length,
    )
