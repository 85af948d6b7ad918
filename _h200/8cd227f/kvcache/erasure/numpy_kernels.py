"""Byte-parallel GF(2^8) kernels on numpy arrays: multiply by α, and sums built from it.

numpy has no table lookup that runs at memory speed (``np.take`` on a 256-entry
table manages ~1.5 GB/s here), but multiplying every byte by the generator α = 2
is four whole-array ufuncs that each run at tens of GB/s in cache::

    mask = acc >> 7          # arithmetic shift of int8: 0xff where the top bit is set
    mask &= 0x1d             # x^8 = x^4 + x^3 + x^2 + 1 (mod 0x11d)
    acc += acc               # shift left by one; int8 addition wraps, dropping bit 7
    acc ^= mask

Every product is built from that step by Horner's scheme:

* :func:`weighted_sum` computes ``XOR_s c_s · x_s`` for arbitrary constants by
  bit-slicing them: for bit b from 7 down to 0, ``acc = α·acc`` and XOR in the rows
  whose constant has bit b set — 7 multiplications by α plus one XOR per set bit;
* :func:`parity2` computes reedsolo's two m = 2 parities in ~6 ufuncs per data row.

All arrays are **int8** views of the same shape (views of a uint8 stripe array via
``stripes.view(np.int8)``; strided is fine): int8 gives the arithmetic shift for
free and wraps on addition, and XOR/AND do not care about sign. The accumulators
(``acc``, ``aux``) and ``mask`` should be contiguous scratch buffers: ufuncs over
strided operands run ~40 % slower, so the kernels touch strided stripe rows once
per input row and once per output row and do everything else in scratch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["Planes", "bit_planes", "mul_alpha", "parity2", "weighted_sum", "xor_sum"]

Rows = npt.NDArray[np.int8]
Planes = tuple[tuple[int, ...], ...]
"""Per bit of a vector of constants (highest first): the positions whose constant has it."""

_REDUCE = np.int8(0x1D)  # x^8 mod 0x11d
_SEVEN = np.int8(7)
# Ufuncs below pass ``out`` positionally and take prebuilt scalars: it saves ~15 % of the
# per-call overhead, which matters for small tiles.


def mul_alpha(acc: Rows, mask: Rows) -> None:
    """Multiply every byte of ``acc`` by α = 2 in GF(2^8), in place (``mask`` is clobbered)."""
    np.right_shift(acc, _SEVEN, mask)
    np.bitwise_and(mask, _REDUCE, mask)
    np.add(acc, acc, acc)
    np.bitwise_xor(acc, mask, acc)


def bit_planes(coeffs: Sequence[int]) -> Planes:
    """Split constants into bit planes for :func:`weighted_sum` (leading empty planes dropped)."""
    planes = [tuple(s for s, c in enumerate(coeffs) if (c >> bit) & 1) for bit in range(7, -1, -1)]
    while planes and not planes[0]:
        planes.pop(0)
    return tuple(planes)


def weighted_sum(out: Rows, sources: Sequence[Rows], planes: Planes, acc: Rows, mask: Rows) -> None:
    """``out = XOR_s c_s · sources[s]``, the constants c given as :func:`bit_planes`.

    ``Σ_s c_s x_s = Σ_b α^b · (XOR of the x_s whose c_s has bit b)``, evaluated from
    the top bit down in ``acc`` and copied to ``out`` at the end.
    """
    if not planes:
        out.fill(0)
        return
    first = planes[0]
    if len(first) >= 2:
        np.bitwise_xor(sources[first[0]], sources[first[1]], acc)
        rest = first[2:]
    else:
        np.copyto(acc, sources[first[0]])
        rest = first[1:]
    for s in rest:
        np.bitwise_xor(acc, sources[s], acc)
    for plane in planes[1:]:
        mul_alpha(acc, mask)
        for s in plane:
            np.bitwise_xor(acc, sources[s], acc)
    np.copyto(out, acc)


def xor_sum(out: Rows, rows: Sequence[Rows], acc: Rows) -> None:
    """``out = XOR of rows`` (at least one row), accumulated in ``acc``."""
    if len(rows) == 1:
        np.copyto(out, rows[0])
        return
    if len(rows) == 2:
        np.bitwise_xor(rows[0], rows[1], out)
        return
    np.bitwise_xor(rows[0], rows[1], acc)
    for row in rows[2:-1]:
        np.bitwise_xor(acc, row, acc)
    np.bitwise_xor(acc, rows[-1], out)


def parity2(data: Sequence[Rows], p0: Rows, p1: Rows, acc: Rows, aux: Rows, mask: Rows) -> None:
    """The two parity rows of reedsolo's m = 2 code, in ~6 ufuncs per data row.

    The codeword ``c(x) = Σ_j d_j x^(k+1-j) + p0·x + p1`` has the roots 1 and α, so
    ``p0 + p1 = S`` (the XOR of the data) and ``(1 + α)·p0 = α²·H + S`` with
    ``H = Σ_j α^(k-1-j) d_j``. Dividing by 1 + α sums a geometric series:
    ``p0 = Σ_j d_j (1 + α + … + α^(k-j)) = Σ_{i=0..k} α^i · D_min(k-i, k-1)``, where
    ``D_j = d_0 ⊕ … ⊕ d_j`` are prefix XORs. One Horner pass keeps the running prefix
    XOR in ``aux`` and the Horner sum in ``acc``; then ``p0 = acc`` and
    ``p1 = acc ⊕ D_(k-1)``.
    """
    if len(data) == 1:
        np.copyto(aux, data[0])
    else:
        np.bitwise_xor(data[0], data[1], aux)
    np.copyto(acc, data[0])
    for j in range(1, len(data)):
        if j > 1:
            np.bitwise_xor(aux, data[j], aux)
        mul_alpha(acc, mask)
        np.bitwise_xor(acc, aux, acc)
    mul_alpha(acc, mask)
    np.bitwise_xor(acc, aux, acc)
    np.copyto(p0, acc)
    np.bitwise_xor(acc, aux, p1)
