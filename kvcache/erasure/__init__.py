"""Systematic k + m Reed–Solomon erasure coding of KV-cache blocks over GF(2^8).

The code is bit-identical to ``reedsolo.RSCodec(nsym=m)`` applied to every byte
column of a stripe (field 0x11d, generator 2, first root α^0), so any k of the
n = k + m shards rebuild a block. Two interchangeable backends evaluate it:

* :attr:`Backend.ISAL` — Intel ISA-L's SIMD kernels through ctypes (memory speed);
* :attr:`Backend.NUMPY` — pure numpy, always available.

Typical use::

    codec = get_codec()                       # 10 + 2, ISA-L if libisal.so.2 loads
    stripes = encode_payloads(codec, blocks)  # (B, 12, L) uint8, parity filled in
    codec.reconstruct(stripes, present=[0, 1, 2, 3, 4, 5, 6, 7, 10, 11])

Modules: :mod:`.gf` (field and matrices), :mod:`.params`, :mod:`.codec`
(interface), :mod:`.numpy_kernels` / :mod:`.numpy_backend`, :mod:`.isal_lib` /
:mod:`.isal_backend`, :mod:`.factory` (backend choice) and :mod:`.stripes`
(payload helpers).
"""

from __future__ import annotations

from kvcache.erasure.codec import Backend, Codec, EncodeJob
from kvcache.erasure.factory import get_codec, isal_available
from kvcache.erasure.params import ErasureParams
from kvcache.erasure.stripes import alloc_stripes, encode_payloads, payload_view

__all__ = [
    "Backend",
    "Codec",
    "EncodeJob",
    "ErasureParams",
    "alloc_stripes",
    "encode_payloads",
    "get_codec",
    "isal_available",
    "payload_view",
]
