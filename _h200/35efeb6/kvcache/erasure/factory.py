"""Choosing a backend and handing out (cached) codecs.

``get_codec(params)`` with no backend picks one: ``KVCACHE_ERASURE_BACKEND``
(``isal``, ``numpy`` or ``auto``) if set, else ISA-L when ``libisal.so.2`` loads,
else numpy. Both backends produce the same bytes, so the choice only changes
speed; it is logged once per backend so a silent fall back to numpy (~5× slower)
shows up in the logs.
"""

from __future__ import annotations

import logging
import os
import threading

from kvcache.erasure.codec import Backend, Codec
from kvcache.erasure.isal_backend import IsalCodec
from kvcache.erasure.isal_lib import DEFAULT_LIBRARY, LIBRARY_ENV, load_isal
from kvcache.erasure.numpy_backend import NumpyCodec
from kvcache.erasure.params import ErasureParams
from kvcache.errors import ConfigError, ErasureError

__all__ = ["BACKEND_ENV", "DEFAULT_PARAMS", "get_codec", "isal_available"]

logger = logging.getLogger(__name__)

BACKEND_ENV = "KVCACHE_ERASURE_BACKEND"

DEFAULT_PARAMS = ErasureParams()
"""The stripe shape of the architecture: 10 data + 2 parity shards, 64-byte aligned."""

_lock = threading.Lock()
_codecs: dict[tuple[ErasureParams, Backend, str | None], Codec] = {}
_announced: set[Backend] = set()


def isal_available() -> bool:
    """Whether the ISA-L backend can be used (``libisal.so.2`` loads and multiplies right)."""
    return load_isal() is not None


def _resolve(backend: Backend | None) -> Backend:
    if backend is None:
        choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
        if choice == "auto":
            return Backend.ISAL if isal_available() else Backend.NUMPY
        try:
            return Backend(choice)
        except ValueError:
            allowed = ", ".join([b.value for b in Backend] + ["auto"])
            raise ConfigError(f"{BACKEND_ENV}={choice!r} is not one of: {allowed}") from None
    if not isinstance(backend, Backend):
        raise ErasureError(f"backend must be a Backend or None, got {backend!r}")
    return backend


def get_codec(params: ErasureParams = DEFAULT_PARAMS, backend: Backend | None = None) -> Codec:
    """A codec for ``params`` on ``backend`` (None: pick, see the module docstring).

    Codecs are cached per (params, backend) and safe to share between threads.
    Asking for ISA-L (explicitly or through the environment) when it cannot be
    loaded raises :class:`ErasureError` rather than silently running slower.
    """
    if not isinstance(params, ErasureParams):
        raise ErasureError(f"params must be ErasureParams, got {params!r}")
    chosen = _resolve(backend)
    lib = load_isal() if chosen is Backend.ISAL else None
    if chosen is Backend.ISAL and lib is None:
        name = os.environ.get(LIBRARY_ENV) or DEFAULT_LIBRARY
        raise ErasureError(
            f"the ISA-L erasure backend was requested but {name} cannot be loaded; "
            "install it with `apt-get install libisal2`, or use Backend.NUMPY"
        )
    key = (params, chosen, lib.path if lib is not None else None)
    with _lock:
        codec = _codecs.get(key)
        if codec is None:
            codec = IsalCodec(params, lib) if lib is not None else NumpyCodec(params)
            _codecs[key] = codec
            if chosen not in _announced:
                _announced.add(chosen)
                logger.info("erasure codec backend: %s (%s)", chosen.value, params)
    return codec
