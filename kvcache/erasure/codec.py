"""The codec interface shared by every backend, and the checks every call gets.

A :class:`Codec` works on *stripe arrays*: uint8, C-contiguous, shape ``(B, n, L)``
— B blocks, n = k + m shard rows of L bytes each. Row ``i`` of block ``b`` is shard
``i`` of that block; the block's zero-padded payload is ``stripes[b, :k].reshape(-1)``.
Many blocks per call let the backends amortise per-call work over the batch.

Backends implement two primitives on validated arguments (:meth:`Codec._encode`,
:meth:`Codec._rebuild`); argument checking and the choice of which shards to read
live here, once, so both backends make the same choice. That matters: rebuilding
reads exactly k *source* shards — the k lowest present indices — and any formula
over the same k sources gives the same bytes (a k-subset of an MDS code determines
the codeword), so the backends agree byte for byte even on arrays that are not
codewords at all.
"""

from __future__ import annotations

import abc
import ctypes
import enum
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
import numpy.typing as npt

from kvcache.erasure.params import ErasureParams
from kvcache.errors import ErasureError, TooManyErasuresError

__all__ = ["Backend", "Codec", "EncodeJob", "RebuildPlan", "plan_rebuild"]

StripeArray = npt.NDArray[np.uint8]


class Backend(enum.Enum):
    """Which implementation of the GF(2^8) arithmetic a codec uses."""

    ISAL = "isal"
    """Intel ISA-L (``libisal.so.2``) through ctypes: SIMD table lookups, near memory speed."""
    NUMPY = "numpy"
    """Pure numpy, vectorised over whole shards and many stripes: always available."""


@dataclass(frozen=True, slots=True)
class RebuildPlan:
    """Which k shards a rebuild reads (``sources``) and which it writes (``targets``)."""

    sources: tuple[int, ...]
    targets: tuple[int, ...]


def _indices(name: str, values: object, n: int) -> set[int]:
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ErasureError(f"{name} must be a sequence of shard indices, got {values!r}")
    out: set[int] = set()
    for value in values:
        try:
            index = operator.index(value)
        except TypeError:
            raise ErasureError(f"{name} must hold shard indices (ints), got {value!r}") from None
        if not 0 <= index < n:
            raise ErasureError(f"{name} holds shard index {index}, outside [0, {n})")
        out.add(index)
    return out


def plan_rebuild(
    params: ErasureParams, present: Sequence[int], rows: Sequence[int] | None = None
) -> RebuildPlan:
    """Check ``present``/``rows`` and choose the shards a rebuild reads and writes.

    ``sources`` are the k lowest present indices (data shards first, so the decode
    matrix is as close to the identity as it can be). ``targets`` are the requested
    rows that are not present — default: every missing data row — in ascending
    order; a requested row that is present is already valid and is left alone.
    Fewer than k distinct present shards raise :class:`TooManyErasuresError`.
    """
    have = _indices("present", present, params.n)
    if len(have) < params.k:
        raise TooManyErasuresError(
            f"only {len(have)} of {params.n} shards are present ({sorted(have)}); a stripe "
            f"needs at least k={params.k} to be rebuilt, so this block must be recomputed",
            needed=params.k,
            available=len(have),
        )
    wanted = set(range(params.k)) if rows is None else _indices("rows", rows, params.n)
    return RebuildPlan(
        sources=tuple(sorted(have)[: params.k]),
        targets=tuple(sorted(wanted - have)),
    )


def _at(address: int, length: int) -> npt.NDArray[np.uint8]:
    """A writable uint8 array over ``length`` bytes at ``address`` (memory owned elsewhere)."""
    raw = memoryview((ctypes.c_uint8 * length).from_address(address)).cast("B")
    view: npt.NDArray[np.uint8] = np.frombuffer(raw, np.uint8)
    return view


class EncodeJob(NamedTuple):
    """A codec's encode as one native function call a block, for loops that run it themselves
    between other work on the same bytes (``kvcache.native.encode_hashed``): the address of
    ISA-L's ``ec_encode_data``, of the parity tables it takes, and the parity rows it
    writes."""

    function: int
    tables: int
    outputs: int


class Codec(abc.ABC):
    """Encode and rebuild batches of k + m Reed–Solomon stripes in place.

    Parity is bit-identical to ``reedsolo.RSCodec(nsym=m)`` applied to every byte
    column of a stripe (see :mod:`kvcache.erasure.gf`). Instances are stateless
    apart from caches and safe to share between threads; get them from
    :func:`kvcache.erasure.get_codec`.
    """

    backend: ClassVar[Backend]

    def __init__(self, params: ErasureParams) -> None:
        self._params = params

    @property
    def params(self) -> ErasureParams:
        """The stripe shape this codec encodes."""
        return self._params

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._params!r})"

    def _check_stripes(self, stripes: StripeArray) -> None:
        """Raise :class:`ErasureError` unless ``stripes`` is a writable (B, n, L) uint8 array."""
        if not isinstance(stripes, np.ndarray):
            raise ErasureError(f"stripes must be a numpy array, got {type(stripes).__name__}")
        if stripes.dtype != np.uint8:
            raise ErasureError(f"stripes must have dtype uint8, got {stripes.dtype}")
        if stripes.ndim != 3 or stripes.shape[1] != self._params.n:
            raise ErasureError(
                f"stripes must have shape (B, n={self._params.n}, L), got {stripes.shape}"
            )
        if not stripes.flags.c_contiguous:
            raise ErasureError("stripes must be C-contiguous; use np.ascontiguousarray first")
        if not stripes.flags.writeable:
            raise ErasureError("stripes must be writable: the codec writes shard rows in place")

    def encode(self, stripes: StripeArray) -> None:
        """Overwrite rows k..n-1 of every block with the parity of rows 0..k-1.

        Raises :class:`ErasureError` unless ``stripes`` is a writable, C-contiguous
        uint8 array of shape (B, n, L); B = 0 or L = 0 is a no-op.
        """
        self._check_stripes(stripes)
        if stripes.shape[0] and stripes.shape[2]:
            self._encode(stripes)

    def encode_rows(
        self, rows: npt.NDArray[np.uint64], length: int, keepalive: object = None
    ) -> None:
        """Parity of blocks whose shard rows live anywhere in memory, without gathering them.

        ``rows[b]`` holds the addresses of block b's k data rows, then of its m
        parity rows to write, each ``length`` bytes (shape (B, n), uint64). The
        caller keeps the memory alive (``keepalive`` is only documentation of
        that). The client encodes a caller's payload buffer in place this way:
        data shards are slices of it, only rows that cross its end are copied.
        This default gathers the rows into a stripe array (the numpy backend);
        ISA-L reads and writes them where they are.
        """
        blocks = rows.shape[0]
        if rows.ndim != 2 or rows.shape[1] != self._params.n:
            raise ErasureError(f"rows must have shape (B, n={self._params.n}), got {rows.shape}")
        if not blocks or not length:
            return
        k, n = self._params.k, self._params.n
        stripes = np.empty((blocks, n, length), np.uint8)
        for b in range(blocks):
            for i in range(k):
                stripes[b, i] = _at(int(rows[b, i]), length)
        self._encode(stripes)
        for b in range(blocks):
            for i in range(k, n):
                _at(int(rows[b, i]), length)[:] = stripes[b, i]

    def encode_job(self) -> EncodeJob | None:
        """The encode as a native call (see :class:`EncodeJob`), or None where the backend
        has none (numpy): callers then use :meth:`encode_rows`."""
        return None

    def reconstruct(
        self,
        stripes: StripeArray,
        present: Sequence[int],
        *,
        rows: Sequence[int] | None = None,
        blocks: Sequence[int] | None = None,
    ) -> None:
        """Rewrite in place the shard rows that are lost, from k rows that are present.

        ``present`` lists the shard indices valid in every block of the batch (at
        least k of them). ``rows`` lists the shard indices to rebuild (default: the
        missing data rows 0..k-1); rows that are present are left as they are, and if
        no requested row is missing this returns without any field arithmetic.

        Raises :class:`TooManyErasuresError` if fewer than k distinct shards are
        present (even when nothing needs rebuilding: the stripe is broken either way),
        and :class:`ErasureError` for an index outside [0, n) or a malformed array.

        ``blocks``, if given, limits the work to those blocks of ``stripes`` (the
        erasure pattern is theirs); the others are left untouched. A reader uses it
        to rebuild the few blocks that lost a shard inside one large batch array.
        """
        self._check_stripes(stripes)
        plan = plan_rebuild(self._params, present, rows)
        if not (plan.targets and stripes.shape[0] and stripes.shape[2]):
            return
        if blocks is None:
            self._rebuild(stripes, plan)
            return
        chosen = np.asarray(blocks, dtype=np.int64)
        if chosen.ndim != 1 or (
            chosen.size and (int(chosen.min()) < 0 or int(chosen.max()) >= stripes.shape[0])
        ):
            raise ErasureError(f"blocks must be indices into the {stripes.shape[0]} blocks")
        if chosen.size:
            self._rebuild_blocks(stripes, plan, chosen)

    def reconstruct_rows(
        self,
        rows: npt.NDArray[np.uint64],
        length: int,
        present: Sequence[int],
        *,
        targets: Sequence[int] | None = None,
        keepalive: object = None,
    ) -> tuple[int, ...]:
        """Rebuild shard rows that live anywhere in memory, without gathering the stripe.

        ``rows[b, i]`` is the address of shard row i of block b (shape (B, n), uint64;
        ``length`` bytes each): the rows in ``present`` are read, the missing rows of
        ``targets`` (default: the missing data rows) are written; other entries are not
        used. Returns the rows written. Raises as :meth:`reconstruct`. A load rebuilds
        the data shards a dead node held this way, straight into the caller's buffer.
        This default gathers the rows into a stripe array (the numpy backend); ISA-L
        reads and writes them where they are.
        """
        if rows.ndim != 2 or rows.shape[1] != self._params.n:
            raise ErasureError(f"rows must have shape (B, n={self._params.n}), got {rows.shape}")
        plan = plan_rebuild(self._params, present, targets)
        if not (plan.targets and rows.shape[0] and length):
            return plan.targets
        self._rebuild_rows(rows, length, plan)
        return plan.targets

    def reconstruct_rows_many(
        self,
        rows: npt.NDArray[np.uint64],
        length: int,
        present: npt.NDArray[np.bool_],
    ) -> npt.NDArray[np.bool_]:
        """:meth:`reconstruct_rows` for a batch whose blocks lost different shards.

        ``present[b, i]`` says whether row i of block b holds its shard. Each block's
        missing data rows are rebuilt from its k lowest present rows; a block with fewer
        than k present rows is left alone. Returns (B, n): the rows written. A degraded
        load calls this once per batch: with two of twelve nodes dead, a 64-block batch
        holds about 40 erasure patterns, and a call per pattern cost more than the
        decoding. This default runs :meth:`reconstruct_rows` once per pattern.
        """
        self._check_many(rows, present)
        written = np.zeros(present.shape, bool)
        if not length:
            return written
        patterns: dict[bytes, list[int]] = {}
        for b, row in enumerate(present):
            patterns.setdefault(row.tobytes(), []).append(b)
        for mask, blocks in patterns.items():
            have = np.flatnonzero(np.frombuffer(mask, bool)).tolist()
            if len(have) < self._params.k:
                continue
            targets = self.reconstruct_rows(rows[blocks], length, have)
            if targets:
                written[np.ix_(blocks, targets)] = True
        return written

    def _check_many(self, rows: npt.NDArray[np.uint64], present: npt.NDArray[np.bool_]) -> None:
        n = self._params.n
        if rows.ndim != 2 or rows.shape[1] != n:
            raise ErasureError(f"rows must have shape (B, n={n}), got {rows.shape}")
        if present.shape != rows.shape or present.dtype != np.bool_:
            raise ErasureError(
                f"present must be a bool array of the rows' shape {rows.shape}, got "
                f"{present.dtype} {present.shape}"
            )

    def _rebuild_rows(self, rows: npt.NDArray[np.uint64], length: int, plan: RebuildPlan) -> None:
        """Backend hook of :meth:`reconstruct_rows`: by default on a gathered copy."""
        blocks = rows.shape[0]
        stripes = np.zeros((blocks, self._params.n, length), np.uint8)
        for b in range(blocks):
            for i in plan.sources:
                stripes[b, i] = _at(int(rows[b, i]), length)
        self._rebuild(stripes, plan)
        for b in range(blocks):
            for i in plan.targets:
                _at(int(rows[b, i]), length)[:] = stripes[b, i]

    def _rebuild_blocks(
        self, stripes: StripeArray, plan: RebuildPlan, blocks: npt.NDArray[np.int64]
    ) -> None:
        """Backend hook: rebuild only ``blocks``; by default on a gathered copy."""
        sub = stripes[blocks]
        self._rebuild(sub, plan)
        targets = list(plan.targets)
        stripes[blocks[:, None], np.array(targets)[None, :]] = sub[:, targets]

    @abc.abstractmethod
    def _encode(self, stripes: StripeArray) -> None:
        """Backend primitive: parity of a validated, non-empty stripe array."""

    @abc.abstractmethod
    def _rebuild(self, stripes: StripeArray, plan: RebuildPlan) -> None:
        """Backend primitive: write ``plan.targets`` from exactly ``plan.sources``."""
