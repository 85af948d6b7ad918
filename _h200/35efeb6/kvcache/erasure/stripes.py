"""Building stripe arrays from payloads and reading payloads back, without copies.

A stripe array is uint8 ``(B, n, L)``; block b's data shards are rows ``0..k-1``,
which are contiguous in memory, so its zero-padded payload is simply the first
``k·L`` bytes of ``stripes[b]`` and :func:`payload_view` is a slice, not a copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvcache.erasure.codec import Codec
from kvcache.erasure.params import ErasureParams
from kvcache.errors import ErasureError

__all__ = ["Payload", "alloc_stripes", "encode_payloads", "payload_view"]

Payload = bytes | bytearray | memoryview | npt.NDArray[np.generic]

_ALIGN = 64
_GROUP_BYTES = 1 << 20  # copy then encode ~1 MiB of stripes at a time, while it is in cache


def alloc_stripes(
    params: ErasureParams, blocks: int, shard_len: int, *, zeroed: bool = True
) -> npt.NDArray[np.uint8]:
    """A ``(blocks, n, shard_len)`` stripe array whose first byte is 64-byte aligned.

    ``zeroed=False`` skips clearing it, for callers that write every byte anyway.
    """
    if blocks < 0 or shard_len < 0:
        raise ErasureError(f"blocks and shard_len must be >= 0, got {blocks} and {shard_len}")
    size = blocks * params.n * shard_len
    raw = np.zeros(size + _ALIGN, dtype=np.uint8) if zeroed else np.empty(size + _ALIGN, np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    return raw[skip : skip + size].reshape(blocks, params.n, shard_len)


def _as_bytes(payload: Payload) -> npt.NDArray[np.uint8]:
    if isinstance(payload, np.ndarray):
        return np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(payload, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise ErasureError(
            f"payload must be contiguous bytes, got {type(payload).__name__}"
        ) from exc


def encode_payloads(codec: Codec, payloads: Sequence[Payload]) -> npt.NDArray[np.uint8]:
    """Lay payloads out as stripes (zero padded to a common shard length) and encode them.

    The shard length is ``codec.params.shard_len(longest payload)``. Blocks are
    copied and encoded a group at a time (~1 MiB of stripes), so the encoder reads
    bytes the copy has just left in cache.
    """
    params = codec.params
    arrays = [_as_bytes(p) for p in payloads]
    if not arrays:
        return alloc_stripes(params, 0, 0)
    empty = [i for i, a in enumerate(arrays) if a.size == 0]
    if empty:
        raise ErasureError(f"payloads must not be empty; payload {empty[0]} is")
    length = params.shard_len(max(a.size for a in arrays))
    # Not zeroed up front: every data byte is written below (payload, then padding) and
    # encode writes every parity byte, so clearing the array first would touch it twice.
    stripes = alloc_stripes(params, len(arrays), length, zeroed=False)
    data = stripes[:, : params.k].reshape(len(arrays), -1)
    group = max(1, _GROUP_BYTES // (params.n * length))
    for start in range(0, len(arrays), group):
        stop = min(start + group, len(arrays))
        for b in range(start, stop):
            size = arrays[b].size
            data[b, :size] = arrays[b]
            data[b, size:] = 0
        codec.encode(stripes[start:stop])
    return stripes


def payload_view(
    stripes: npt.NDArray[np.uint8],
    b: int,
    payload_len: int,
    *,
    params: ErasureParams | None = None,
) -> npt.NDArray[np.uint8]:
    """Block ``b``'s payload: a zero-copy view of its first ``payload_len`` data bytes.

    Pass ``params`` to also check that the payload fits in the k data rows (without
    it, only the whole block's size bounds ``payload_len``).
    """
    if stripes.ndim != 3 or not stripes.flags.c_contiguous:
        raise ErasureError(f"stripes must be a C-contiguous (B, n, L) array, got {stripes.shape}")
    blocks, n, length = stripes.shape
    if not 0 <= b < blocks:
        raise ErasureError(f"block index {b} outside [0, {blocks})")
    rows = params.k if params is not None else n
    if params is not None and params.n != n:
        raise ErasureError(f"stripes have {n} rows but params say n={params.n}")
    if not 0 <= payload_len <= rows * length:
        raise ErasureError(f"payload_len {payload_len} outside [0, {rows * length}]")
    view: npt.NDArray[np.uint8] = stripes[b].reshape(-1)[:payload_len]
    return view
