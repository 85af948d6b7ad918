"""Arithmetic in GF(2^8) and the small matrices of the stripe code (pure, no I/O).

The field and the code are pinned to what ``reedsolo.RSCodec(nsym=m)`` does with
its defaults, because reedsolo is our reference implementation:

* field polynomial ``x^8 + x^4 + x^3 + x^2 + 1`` (:data:`PRIM` = 0x11d), which is
  also the polynomial ISA-L's ``gf_mul`` uses, so ISA-L can evaluate our matrices;
* generator element α = 2 (:data:`GENERATOR`) and first consecutive root
  α^0 (:data:`FCR` = 0): the generator polynomial is ``Π_{i<m} (x - α^i)``;
* a codeword is the message followed by the remainder of ``msg(x)·x^m`` divided by
  the generator polynomial, highest-degree coefficient first.

Everything here is computed from those definitions; ``tests/test_erasure.py``
derives the same matrices from reedsolo itself (by encoding unit vectors) and
checks they are equal, so a slip here cannot go unnoticed. The matrices are
tiny (at most 255 × 255) and built once per erasure pattern, so plain Python
loops are fast enough; the byte-crunching lives in the codec backends.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvcache.errors import ErasureError

__all__ = [
    "EXP",
    "FCR",
    "GENERATOR",
    "LOG",
    "MAX_SHARDS",
    "PRIM",
    "decode_matrix",
    "generator_matrix",
    "gf_div",
    "gf_inv",
    "gf_mul",
    "gf_pow",
    "mat_inv",
    "mat_mul",
    "parity_matrix",
]

PRIM = 0x11D
"""The field polynomial x^8 + x^4 + x^3 + x^2 + 1 (reedsolo's and ISA-L's default)."""
GENERATOR = 2
"""The primitive element α used to build the generator polynomial (reedsolo default)."""
FCR = 0
"""First consecutive root: the generator polynomial's roots are α^FCR .. α^(FCR+m-1)."""
MAX_SHARDS = 255
"""A codeword over GF(2^8) has at most 2^8 - 1 symbols, so k + m <= 255."""

Matrix = npt.NDArray[np.uint8]


def _build_tables() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return (exp, log): exp has 510 entries so exp[log a + log b] needs no modulo."""
    exp = [0] * 510
    log = [0] * 256
    x = 1
    for i in range(255):
        exp[i] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= PRIM
    for i in range(255, 510):
        exp[i] = exp[i - 255]
    return tuple(exp), tuple(log)


EXP, LOG = _build_tables()
"""Antilog and log tables of GF(2^8) for generator 2 (LOG[0] is meaningless)."""


def gf_mul(a: int, b: int) -> int:
    """Product of two field elements."""
    if a == 0 or b == 0:
        return 0
    return EXP[LOG[a] + LOG[b]]


def gf_inv(a: int) -> int:
    """Multiplicative inverse; 0 has none and raises :class:`ZeroDivisionError`."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return EXP[255 - LOG[a]]


def gf_div(a: int, b: int) -> int:
    """Quotient a / b of two field elements (b != 0)."""
    return gf_mul(a, gf_inv(b))


def gf_pow(a: int, e: int) -> int:
    """a raised to the integer power e (e may be negative for a != 0)."""
    if a == 0:
        return 1 if e == 0 else 0
    return EXP[(LOG[a] * e) % 255]


def _check_km(k: int, m: int) -> None:
    if k < 1 or m < 0 or k + m > MAX_SHARDS:
        raise ErasureError(f"need k >= 1, m >= 0 and k + m <= {MAX_SHARDS}; got k={k}, m={m}")


def _generator_poly(m: int) -> list[int]:
    """Coefficients of Π_{i<m} (x - α^(i+FCR)), highest degree first (monic)."""
    g = [1]
    for i in range(m):
        root = gf_pow(GENERATOR, i + FCR)
        nxt = [0] * (len(g) + 1)
        for j, c in enumerate(g):
            nxt[j] ^= c
            nxt[j + 1] ^= gf_mul(c, root)
        g = nxt
    return g


@functools.cache
def _parity_rows(k: int, m: int) -> tuple[tuple[int, ...], ...]:
    """P as nested tuples: P[j][i] is the weight of data symbol j in parity symbol i."""
    _check_km(k, m)
    gen = _generator_poly(m)
    rows = []
    for j in range(k):
        # Systematic encoding of the unit vector e_j: the remainder of e_j(x)·x^m
        # divided by the generator, computed by synthetic division (as reedsolo does).
        buf = [0] * (k + m)
        buf[j] = 1
        for i in range(k):
            coef = buf[i]
            if coef:
                for t in range(1, len(gen)):
                    buf[i + t] ^= gf_mul(gen[t], coef)
        rows.append(tuple(buf[k:]))
    return tuple(rows)


def parity_matrix(k: int, m: int) -> Matrix:
    """The k × m matrix P with ``parity[i] = XOR_j P[j, i] · data[j]`` (a fresh copy)."""
    return np.array(_parity_rows(k, m), dtype=np.uint8).reshape(k, m)


def generator_matrix(k: int, m: int) -> Matrix:
    """The n × k matrix G mapping the k data symbols to all n = k + m shard symbols.

    Rows 0..k-1 are the identity (the code is systematic); row k + i is column i of
    :func:`parity_matrix`.
    """
    g = np.zeros((k + m, k), dtype=np.uint8)
    g[:k] = np.eye(k, dtype=np.uint8)
    g[k:] = parity_matrix(k, m).T
    return g


_EXP_NP = np.array(EXP, dtype=np.uint8)
_LOG_NP = np.array(LOG, dtype=np.intp)


def _mul_arrays(a: npt.NDArray[np.uint8], b: npt.NDArray[np.uint8]) -> Matrix:
    """Element-wise product of two broadcastable uint8 arrays over GF(2^8)."""
    prod = _EXP_NP[_LOG_NP[a] + _LOG_NP[b]]
    return np.where((a == 0) | (b == 0), np.uint8(0), prod).astype(np.uint8)


def mat_mul(a: Matrix, b: Matrix) -> Matrix:
    """Matrix product over GF(2^8) of (r × s) and (s × t) uint8 matrices."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ErasureError(f"cannot multiply matrices of shapes {a.shape} and {b.shape}")
    if a.shape[1] == 0:
        return np.zeros((a.shape[0], b.shape[1]), dtype=np.uint8)
    terms = _mul_arrays(a[:, :, None], b[None, :, :])
    out: Matrix = np.bitwise_xor.reduce(terms, axis=1).astype(np.uint8)
    return out


def mat_inv(a: Matrix) -> Matrix:
    """Inverse of a square matrix over GF(2^8) by Gauss–Jordan elimination.

    Raises :class:`ErasureError` if the matrix is singular; for the shard rows of an
    MDS code that cannot happen, so it signals a bug rather than bad luck.
    """
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ErasureError(f"cannot invert a non-square matrix of shape {a.shape}")
    size = a.shape[0]
    # Work on [A | I] and reduce the left half to the identity, one column at a time.
    work = np.concatenate([a.astype(np.uint8), np.eye(size, dtype=np.uint8)], axis=1)
    for col in range(size):
        nonzero = np.flatnonzero(work[col:, col])
        if nonzero.size == 0:
            raise ErasureError("matrix is singular over GF(2^8); the shard choice is not decodable")
        pivot = col + int(nonzero[0])
        if pivot != col:
            work[[col, pivot]] = work[[pivot, col]]
        scale = np.full(1, gf_inv(int(work[col, col])), dtype=np.uint8)
        work[col] = _mul_arrays(work[col], scale)
        factors = work[:, col].copy()
        factors[col] = 0
        work ^= _mul_arrays(factors[:, None], work[col][None, :])
    return np.ascontiguousarray(work[:, size:])


@functools.lru_cache(maxsize=1024)
def _decode_rows(
    k: int, m: int, sources: tuple[int, ...], targets: tuple[int, ...]
) -> tuple[tuple[int, ...], ...]:
    gen = generator_matrix(k, m)
    inverse = mat_inv(gen[list(sources)])
    rows = mat_mul(gen[list(targets)], inverse)
    return tuple(tuple(int(v) for v in row) for row in rows.tolist())


def decode_matrix(k: int, m: int, sources: Sequence[int], targets: Sequence[int]) -> Matrix:
    """The len(targets) × k matrix D with ``shard[t] = XOR_s D[t, s] · shard[sources[s]]``.

    ``sources`` are k distinct shard indices that are known; ``targets`` are the
    shard indices (data or parity) to rebuild from them. D is ``G[targets] ·
    G[sources]^-1``: the inverse maps the known shards back to the data, G maps the
    data to any shard. Results are cached per (k, m, sources, targets).
    """
    _check_km(k, m)
    src = tuple(int(s) for s in sources)
    tgt = tuple(int(t) for t in targets)
    n = k + m
    if len(src) != k or len(set(src)) != k or any(not 0 <= s < n for s in src):
        raise ErasureError(f"need {k} distinct source shards in [0, {n}); got {list(src)}")
    if any(not 0 <= t < n for t in tgt):
        raise ErasureError(f"target shards must lie in [0, {n}); got {list(tgt)}")
    return np.array(_decode_rows(k, m, src, tgt), dtype=np.uint8).reshape(len(tgt), k)
