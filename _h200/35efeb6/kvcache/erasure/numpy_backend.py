"""The numpy codec: always available, vectorised over whole shards and many stripes.

Every kernel in :mod:`kvcache.erasure.numpy_kernels` is a chain of whole-array
ufuncs, each of which makes one pass over its operands. Run over a whole batch
(many MB), every pass would stream from L3 or DRAM; instead the batch is cut into
*tiles* of about :data:`TILE_BYTES` per shard row — several blocks at once when
shards are short, part of one shard row when they are long — so the dozens of
passes per tile run on contiguous scratch rows that stay in L2, and each stripe
row of the tile is read or written about once.

Shortcuts, all exact:

* m = 2 encodes with :func:`~kvcache.erasure.numpy_kernels.parity2`: ~6 ufuncs per
  data row, against ~8 for a weighted sum (one parity) plus the XOR below (the other);
* reedsolo's first root is α^0 = 1, so the XOR of all n shards of a codeword is
  zero: when the last of m rows is written (the last parity, or the last of m lost
  rows) it is the XOR of the other n - 1 rows, ~n ufuncs instead of a weighted sum.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator

import numpy as np

from kvcache.erasure import gf
from kvcache.erasure.codec import Backend, Codec, RebuildPlan, StripeArray
from kvcache.erasure.numpy_kernels import (
    Planes,
    Rows,
    bit_planes,
    parity2,
    weighted_sum,
    xor_sum,
)
from kvcache.erasure.params import ErasureParams

__all__ = ["TILE_BYTES", "NumpyCodec"]

logger = logging.getLogger(__name__)

TILE_BYTES = 1 << 18
"""Bytes per shard row in one tile. The three scratch rows of a tile (768 KiB) stay in a
1 MiB L2 while data rows stream past; halving or doubling it costs ~5-10 % (measured on a
Zen 4 EPYC), much smaller tiles lose to per-ufunc overhead (~0.3-0.8 µs a call)."""

# The XOR shortcut relies on 1 being a root of the generator polynomial.
assert gf.FCR == 0


def _tiles(blocks: int, length: int) -> Iterator[tuple[slice, slice]]:
    """Cut the (blocks, length) plane of one shard row into tiles of at most TILE_BYTES."""
    if length * 2 > TILE_BYTES:
        parts = -(-length // TILE_BYTES)
        step = -(-length // parts)
        step = min(length, -(-step // 64) * 64)
        for b in range(blocks):
            for start in range(0, length, step):
                yield slice(b, b + 1), slice(start, min(start + step, length))
    else:
        per = max(1, TILE_BYTES // length)
        for start in range(0, blocks, per):
            yield slice(start, min(start + per, blocks)), slice(0, length)


class _Workspace:
    """Contiguous int8 scratch rows (acc, aux, mask) sized for the largest tile."""

    __slots__ = ("_flat",)

    def __init__(self, blocks: int, length: int) -> None:
        bs, cs = next(_tiles(blocks, length))
        self._flat = np.empty((3, (bs.stop - bs.start) * (cs.stop - cs.start)), dtype=np.int8)

    def rows(self, shape: tuple[int, int]) -> tuple[Rows, Rows, Rows]:
        """Three contiguous arrays of ``shape`` (a tile's shape) backed by the scratch."""
        size = shape[0] * shape[1]
        acc, aux, mask = (self._flat[i, :size].reshape(shape) for i in range(3))
        return acc, aux, mask


class NumpyCodec(Codec):
    """Reed–Solomon over GF(2^8) in pure numpy (see the module docstring)."""

    backend = Backend.NUMPY

    def __init__(self, params: ErasureParams) -> None:
        super().__init__(params)
        parity = gf.parity_matrix(params.k, params.m)
        # Generic encode: weighted sums for parities 0..m-2, the XOR shortcut for the last.
        self._parity_planes = tuple(
            bit_planes([int(c) for c in parity[:, i]]) for i in range(params.m - 1)
        )
        self._rebuild_planes = functools.lru_cache(maxsize=256)(self._plan_weights)
        logger.debug("numpy erasure codec ready for %s", params)

    def _encode(self, stripes: StripeArray) -> None:
        k, m, n = self._params.k, self._params.m, self._params.n
        blocks, _, length = stripes.shape
        signed = stripes.view(np.int8)
        work = _Workspace(blocks, length)
        for bs, cs in _tiles(blocks, length):
            tile = signed[bs, :, cs]
            acc, aux, mask = work.rows((tile.shape[0], tile.shape[2]))
            rows = [tile[:, i] for i in range(n)]
            if m == 2:
                parity2(rows[:k], rows[k], rows[k + 1], acc, aux, mask)
                continue
            for i, planes in enumerate(self._parity_planes):
                weighted_sum(rows[k + i], rows[:k], planes, acc, mask)
            xor_sum(rows[n - 1], rows[: n - 1], acc)

    def _plan_weights(
        self, sources: tuple[int, ...], targets: tuple[int, ...]
    ) -> tuple[tuple[int, Planes], ...]:
        """Bit planes of the decode-matrix row of each target that needs a weighted sum."""
        k, m = self._params.k, self._params.m
        weighted = targets[:-1] if len(targets) == m else targets
        matrix = gf.decode_matrix(k, m, sources, weighted)
        return tuple(
            (t, bit_planes([int(c) for c in row])) for t, row in zip(weighted, matrix, strict=True)
        )

    def _rebuild(self, stripes: StripeArray, plan: RebuildPlan) -> None:
        n, m = self._params.n, self._params.m
        weighted = self._rebuild_planes(plan.sources, plan.targets)
        # With m targets, sources + targets cover every shard: the last target is the
        # XOR of all other rows (see module docstring).
        last = plan.targets[-1] if len(plan.targets) == m else None
        blocks, _, length = stripes.shape
        signed = stripes.view(np.int8)
        work = _Workspace(blocks, length)
        for bs, cs in _tiles(blocks, length):
            tile = signed[bs, :, cs]
            acc, _, mask = work.rows((tile.shape[0], tile.shape[2]))
            rows = [tile[:, i] for i in range(n)]
            sources = [rows[s] for s in plan.sources]
            for target, planes in weighted:
                weighted_sum(rows[target], sources, planes, acc, mask)
            if last is not None:
                xor_sum(rows[last], [rows[i] for i in range(n) if i != last], acc)
