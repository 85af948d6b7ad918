"""Pure write-path logic: payloads → encoded stripes → per-node PUT records."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from kvcache.erasure import Codec
from kvcache.errors import ConfigError
from kvcache.keys import BlockKey
from kvcache.shard import (
    HEADER_BYTES,
    HEADER_DTYPE,
    MAGIC,
    VERSION,
    fill_header_checks,
    new_stripe_id,
    shard_len_for,
)
from kvcache.wire import Op, make_items

__all__ = ["build_node_records", "encode_stripes"]


def encode_stripes(
    codec: Codec,
    keys: Sequence[BlockKey],
    payloads: Sequence[Any],
    *,
    payload_len: int,
    traffic_class: str,
    now_ms: int,
    ttl_ms: int = 0,
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint64], npt.NDArray[np.uint8]]:
    """Encode blocks into stripes and their shard headers.

    Returns the stripes (blocks, n, L), each block's fresh stripe id, and the
    packed headers (blocks, n, HEADER_BYTES).
    """
    k, n = codec.params.k, codec.params.n
    blocks = len(keys)
    shard_len = shard_len_for(payload_len, k)
    stripes = np.empty((blocks, n, shard_len), np.uint8)
    flat = stripes.reshape(blocks, n * shard_len)
    flat[:, payload_len : k * shard_len] = 0
    payload_hashes = np.empty(blocks, "V16")
    digest128 = xxhash.xxh3_128_digest
    for b, payload in enumerate(payloads):
        src = np.frombuffer(payload, np.uint8) if not isinstance(payload, np.ndarray) else payload
        if src.nbytes != payload_len:
            raise ConfigError(f"payload {b} is {src.nbytes} bytes, the layout needs {payload_len}")
        flat[b, :payload_len] = src.reshape(-1).view(np.uint8)
        payload_hashes[b] = digest128(flat[b, :payload_len].data)
    codec.encode(stripes)
    stripe_ids = np.array([new_stripe_id() for _ in range(blocks)], np.uint64)
    headers = np.zeros((blocks, n), HEADER_DTYPE)
    headers["magic"] = MAGIC
    headers["version"] = VERSION
    headers["header_len"] = HEADER_BYTES
    headers["k"] = k
    headers["m"] = n - k
    headers["shard_index"] = np.arange(n)[None, :]
    name = traffic_class.encode("ascii")
    headers["class_len"] = len(name)
    headers["payload_len"] = payload_len
    headers["shard_len"] = shard_len
    headers["stripe_id"] = stripe_ids[:, None]
    headers["block_key"] = np.frombuffer(b"".join(keys), "V16")[:, None] if blocks else b""
    headers["payload_hash"] = payload_hashes[:, None]
    headers["created_ms"] = now_ms
    headers["expiry_ms"] = now_ms + ttl_ms
    headers["traffic_class"] = name
    digest64 = xxhash.xxh3_64_intdigest
    shard_hash = headers["shard_hash"]
    for b in range(blocks):
        for i in range(n):
            shard_hash[b, i] = digest64(stripes[b, i].data)
    flat_headers = headers.reshape(-1)
    fill_header_checks(flat_headers)
    return stripes, stripe_ids, flat_headers.view(np.uint8).reshape(blocks, n, HEADER_BYTES)


def build_node_records(
    keys: Sequence[BlockKey],
    blocks: npt.NDArray[np.intp],
    indices: npt.NDArray[np.intp],
    stripes: npt.NDArray[np.uint8],
    headers: npt.NDArray[np.uint8],
) -> tuple[npt.NDArray[np.void], npt.NDArray[np.uint8]]:
    """PUT items and the data frame (``header || body`` records) for one node's shards."""
    shard_len = stripes.shape[2]
    count = len(blocks)
    frame = np.empty((count, HEADER_BYTES + shard_len), np.uint8)
    frame[:, :HEADER_BYTES] = headers[blocks, indices]
    frame[:, HEADER_BYTES:] = stripes[blocks, indices]
    items = make_items(Op.PUT, count, reply=False)
    items["key"] = np.frombuffer(b"".join(keys), "V16")[blocks] if count else b""
    items["index"] = indices
    items["length"] = HEADER_BYTES + shard_len
    return items, frame
