"""The write path's bytes, without I/O: payloads → shards and headers → per-node PUT sections.

Zero copy where it can be: a block's data shards are slices of the caller's
payload buffer (only rows that cross the payload's end are copied, padded
with zeros, into a small scratch), parity is computed into its own array by
:meth:`kvcache.erasure.Codec.encode_rows` reading the rows where they are,
and a node's PUT is a list of (address, length) segments (``header, body,
header, body, ...``, :class:`kvcache.native.Segments`) that the transport
sends with one gather call. With ISA-L and the native library, the parity and the
hashes are computed in one native call per batch that works block by block
(:func:`kvcache.native.encode_hashed`), so each block's bytes come from memory once;
otherwise in one batched call each (:mod:`kvcache.native`), not one call per shard. Headers come from
:func:`kvcache.shard.build_headers`, the one vectorised home of the header
layout.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache import native
from kvcache.erasure import Codec
from kvcache.errors import ConfigError
from kvcache.keys import BlockKey
from kvcache.shard import HEADER_BYTES, build_headers, new_stripe_id, shard_len_for
from kvcache.wire import Op, make_items

__all__ = ["EncodedBatch", "as_payload_rows", "encode_batch"]

Payloads = Sequence[Any] | npt.NDArray[np.uint8]


def as_payload_rows(
    payloads: Payloads, payload_len: int
) -> list[npt.NDArray[np.uint8]] | npt.NDArray[np.uint8]:
    """Each payload as a flat, contiguous uint8 array of exactly ``payload_len`` bytes: the
    caller's (blocks, payload_len) array itself, or a list of rows.

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
        return payloads
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
    """A batch of encoded blocks: every shard's header and body, ready to be sent."""

    keys: list[BlockKey]
    stripe_ids: npt.NDArray[np.uint64]
    #: (blocks, n) shard headers, one HEADER_DTYPE record each.
    headers: npt.NDArray[np.void]
    #: addresses[b, i]: where the shard_len bytes of shard i of block b are.
    addresses: npt.NDArray[np.uint64]
    shard_len: int
    #: Arrays the addresses point into (kept alive with the batch).
    keepalive: list[Any]
    #: The keys as one array of 16-byte records (made by the first :meth:`sections`).
    key_words: npt.NDArray[np.void] | None = None

    def body(self, b: int, i: int) -> bytes:
        """A copy of shard ``i`` of block ``b`` (tests and diagnostics)."""
        return ctypes.string_at(int(self.addresses[b, i]), self.shard_len)

    def sections(
        self,
        parts: Sequence[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]],
        expect: npt.NDArray[np.uint64] | None = None,
    ) -> list[tuple[npt.NDArray[np.void], native.Segments]]:
        """Each node's PUT: its items, and its data section as segments for one gather
        send (per shard (blocks[j], indices[j]) its header, then its body). ``parts`` are
        the nodes' (blocks, indices), ``expect`` the (blocks, n) stripes a PUT may replace
        (None: none). All nodes' items are one array and their segment tables one buffer,
        built with a few whole-array steps, and each node gets its slices: a store to a
        large cluster sends each node a few shards, so per-node steps, not bytes, decide
        its cost there."""
        if not parts:
            return []
        counts = np.fromiter((len(b) for b, _ in parts), np.int64, len(parts))
        blocks = np.concatenate([b for b, _ in parts]).astype(np.int64, copy=False)
        indices = np.concatenate([i for _, i in parts]).astype(np.int64, copy=False)
        total = len(blocks)
        items = make_items(Op.PUT, total, reply=False)
        if self.key_words is None:
            self.key_words = np.frombuffer(b"".join(self.keys), "V16")
        items["key"] = self.key_words[blocks] if total else b""
        items["index"] = indices
        items["length"] = HEADER_BYTES + self.shard_len
        items["expect"] = expect[blocks, indices] if total and expect is not None else 0
        # Each node's table: 2c addresses, 2c lengths (header, body per shard), 3 words of
        # send state (zero); one buffer holds them all, node after node.
        words = 4 * counts + 3
        table_at = np.zeros(len(parts), np.int64)
        np.cumsum(words[:-1], out=table_at[1:])
        tables = np.zeros(int(words.sum()), np.uint64)
        starts = np.cumsum(counts) - counts  # each node's first shard in ``blocks``
        first = np.repeat(np.arange(len(parts)), counts)
        addr_at = table_at[first] + 2 * (np.arange(total) - starts[first])
        len_at = addr_at + 2 * counts[first]
        cell = blocks.astype(np.uint64) * np.uint64(self.headers.shape[1]) + indices.astype(
            np.uint64
        )
        tables[addr_at] = np.uint64(native.addresses_of(self.headers)) + cell * np.uint64(
            HEADER_BYTES
        )
        tables[addr_at + 1] = self.addresses.reshape(-1)[cell.astype(np.int64)]
        tables[len_at] = HEADER_BYTES
        tables[len_at + 1] = self.shard_len
        base = native.addresses_of(tables)
        size = HEADER_BYTES + self.shard_len
        out = []
        for c, at, start in zip(counts.tolist(), table_at.tolist(), starts.tolist(), strict=True):
            table = tables[at : at + 4 * c + 3]
            out.append(
                (
                    items[start : start + c],
                    native.Segments(
                        table, 2 * c, 2 * c, (self, tables), at=base + 8 * at, nbytes=c * size
                    ),
                )
            )
        return out


def encode_batch(
    codec: Codec,
    keys: Sequence[BlockKey],
    rows: Sequence[npt.NDArray[np.uint8]] | npt.NDArray[np.uint8],
    *,
    payload_len: int,
    traffic_class: str,
    now_ms: int,
    ttl_ms: int = 0,
) -> EncodedBatch:
    """Encode blocks whose payloads are ``rows``: a list of rows, or one 2-D array of
    C-contiguous rows (see :func:`as_payload_rows`)."""
    k, n = codec.params.k, codec.params.n
    blocks = len(keys)
    length = shard_len_for(payload_len, k)
    inside = payload_len // length  # data rows wholly inside the payload
    copied = k - inside  # rows that cross (or lie past) the payload's end
    tail = payload_len - inside * length
    scratch = np.zeros((blocks, max(copied, 1), length), np.uint8)
    parity = np.empty((blocks, n - k, length), np.uint8)
    addresses = np.empty((blocks, n), np.uint64)
    scratch_base = scratch.ctypes.data
    parity_base = parity.ctypes.data
    if isinstance(rows, np.ndarray):  # one (blocks, payload_len) array: no per-block work
        bases = np.uint64(rows.ctypes.data if blocks else 0) + np.arange(
            blocks, dtype=np.uint64
        ) * np.uint64(rows.strides[0] if blocks else 0)
        if copied and blocks:
            scratch.reshape(blocks, -1)[:, :tail] = rows[:, inside * length :]
    else:
        bases = np.empty(blocks, np.uint64)
        for b, row in enumerate(rows):
            bases[b] = row.ctypes.data
            if copied:
                scratch[b].reshape(-1)[:tail] = row[inside * length :]
    addresses[:, :inside] = bases[:, None] + np.arange(inside, dtype=np.uint64) * np.uint64(length)
    if copied:
        addresses[:, inside:k] = np.uint64(scratch_base) + (
            np.arange(blocks, dtype=np.uint64)[:, None] * np.uint64(copied)
            + np.arange(copied, dtype=np.uint64)
        ) * np.uint64(length)
    addresses[:, k:] = (
        parity_base
        + (np.arange(blocks, dtype=np.uint64)[:, None] * (n - k) + np.arange(n - k)) * length
    )
    job = codec.encode_job() if native.AVAILABLE else None
    if job is not None:  # block by block, each block's bytes read from memory once
        payload_hashes, shard_hashes = native.encode_hashed(
            job, k, addresses, length, bases, payload_len
        )
    else:
        payload_hashes = native.xxh3_128_many(bases, np.uint64(payload_len))
        codec.encode_rows(addresses, length, keepalive=(rows, scratch, parity))
        shard_hashes = native.xxh3_64_many(addresses, np.uint64(length))
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
    return EncodedBatch(
        keys=list(keys),
        stripe_ids=stripe_ids,
        headers=headers,
        addresses=addresses,
        shard_len=length,
        keepalive=[rows, scratch, parity],
    )
