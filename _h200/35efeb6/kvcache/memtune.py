"""Keep large, short-lived buffers out of mmap: a process-wide glibc malloc setting.

Every batch allocates multi-megabyte buffers (zmq message bodies, stripe
arrays) and frees them a moment later. glibc serves such sizes with fresh
``mmap`` calls and returns them with ``munmap``, so every batch pays page
faults and kernel zeroing for every byte it moves — measured here as more
system time than the whole data path. Raising the mmap threshold (and the trim
threshold, so the heap is not shrunk after each batch) lets the same pages be
reused. Called once by the client and by the storage daemon; a no-op where the
C library is not glibc. Memory freed stays with the process up to the trim
threshold (512 MiB by default).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

__all__ = ["tune_malloc"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_done = False


def tune_malloc(
    *,
    mmap_threshold: int = 64 << 20,
    trim_threshold: int = 512 << 20,
    top_pad: int = 64 << 20,
) -> bool:
    """Apply the settings once per process; returns whether they were applied."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, mmap_threshold),
            (_M_TRIM_THRESHOLD, trim_threshold),
            (_M_TOP_PAD, top_pad),
        )
    )
    _done = ok
    log.debug("malloc tuning %s", "applied" if ok else "refused")
    return ok
