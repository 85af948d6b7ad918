"""Loading Intel ISA-L (``libisal.so.2``) through ctypes, and checking it is the field we use.

Only two entry points are needed: ``ec_init_tables`` expands a coefficient matrix
into ISA-L's 32-byte-per-coefficient multiplication tables, and ``ec_encode_data``
computes ``out[r] = XOR_s a[r, s] · in[s]`` over GF(2^8) with SIMD nibble lookups
(AVX-512, AVX2, AVX or SSE, chosen by ISA-L at run time). Any matrix works — ISA-L
does not impose its own code — so feeding it reedsolo's matrices gives reedsolo's
bytes, provided ISA-L's field is ours. It is (``gf_mul`` reduces by 0x11d), and
:func:`load_isal` checks that on load instead of trusting it.

The library is looked up by the name in ``KVCACHE_ISAL_LIBRARY`` (default
``libisal.so.2``, Debian/Ubuntu package ``libisal2``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from kvcache.erasure import gf

__all__ = ["DEFAULT_LIBRARY", "LIBRARY_ENV", "IsalLib", "load_isal"]

logger = logging.getLogger(__name__)

DEFAULT_LIBRARY = "libisal.so.2"
LIBRARY_ENV = "KVCACHE_ISAL_LIBRARY"

InitTablesFn = Callable[[int, int, int, int], None]
"""ec_init_tables(k, rows, a*, gftbls*) with pointers as ints."""


@dataclass(frozen=True, slots=True)
class IsalLib:
    """The bound ISA-L functions."""

    path: str
    ec_init_tables: InitTablesFn
    ec_encode_data: Callable[..., None]
    """Declared without argtypes: see :meth:`encode_blocks`."""
    encode_address: int
    """The address of ``ec_encode_data``, for native loops that call it themselves
    (:func:`kvcache.native.ec_run_many`)."""

    def encode_blocks(
        self,
        length: int,
        k: int,
        outputs: int,
        tables: int,
        first: int,
        count: int,
        stride: int,
        coding_offset: int,
    ) -> None:
        """Run ``ec_encode_data`` on ``count`` blocks, one call each.

        Block i's k input row pointers are the uint64s at ``first + i·stride`` and its
        ``outputs`` output row pointers follow at ``+ coding_offset``; ``tables`` is
        the address of the ec_init_tables output. The function is declared without
        ``argtypes`` and the pointers are wrapped here, which costs ~0.35 µs a call
        against ~0.47 µs for ctypes' argtypes conversion: 64 calls per batch add up.
        ``length``, ``k`` and ``outputs`` must fit a C int.
        """
        encode = self.ec_encode_data
        pointer = ctypes.c_void_p
        table = pointer(tables)
        for data in range(first, first + count * stride, stride):
            encode(length, k, outputs, table, pointer(data), pointer(data + coding_offset))


def _bind(path: str) -> IsalLib:
    lib = ctypes.CDLL(path)
    c_int, c_void_p = ctypes.c_int, ctypes.c_void_p
    init = lib.ec_init_tables
    init.argtypes = [c_int, c_int, c_void_p, c_void_p]
    init.restype = None
    encode = lib.ec_encode_data
    encode.restype = None  # no argtypes on purpose, see IsalLib.encode_blocks
    gf_mul = lib.gf_mul
    gf_mul.argtypes = [ctypes.c_ubyte, ctypes.c_ubyte]
    gf_mul.restype = ctypes.c_ubyte
    # ISA-L must multiply in our field, or every parity byte would differ from reedsolo's.
    for a, b in ((0x80, 2), (0x53, 0xCA), (0xFF, 0xFF), (7, 0x1D)):
        if gf_mul(a, b) != gf.gf_mul(a, b):
            raise _WrongFieldError(
                f"{path}: gf_mul({a:#x}, {b:#x}) = {gf_mul(a, b):#x}, expected "
                f"{gf.gf_mul(a, b):#x} in the field 0x{gf.PRIM:x}"
            )
    address = ctypes.cast(encode, ctypes.c_void_p).value
    if not address:
        raise AttributeError(f"{path}: ec_encode_data has no address")
    return IsalLib(path=path, ec_init_tables=init, ec_encode_data=encode, encode_address=address)


class _WrongFieldError(Exception):
    """The library loaded but does not multiply in GF(2^8) mod 0x11d."""


@functools.lru_cache(maxsize=4)
def _load(path: str) -> IsalLib | None:
    try:
        lib = _bind(path)
    except (OSError, AttributeError) as exc:  # not installed, or an unexpected build
        logger.info("ISA-L not available (%s): %s", path, exc)
        return None
    except _WrongFieldError as exc:
        logger.warning("ISA-L unusable, it would not match reedsolo: %s", exc)
        return None
    logger.debug("ISA-L loaded from %s", path)
    return lib


def load_isal() -> IsalLib | None:
    """The bound library, or None if it cannot be loaded or fails its field check.

    The result is cached per library name; the name is read from
    ``KVCACHE_ISAL_LIBRARY`` on every call so tests can point it elsewhere.
    """
    return _load(os.environ.get(LIBRARY_ENV) or DEFAULT_LIBRARY)
