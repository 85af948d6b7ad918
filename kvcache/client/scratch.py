"""Scratch memory a load lands its parity shards in, kept from one load to the next.

A hedged load asks k + 1 holders for every block: k data shards land in the caller's
buffer, the (k+1)-th in a parity scratch of the load's own (``LoadAssembly.parity``), sized
for every block of the call (m shards each, for a degraded load). A fresh array of that
size per call is a fresh ``mmap`` once it passes glibc's mmap threshold (64 MiB with
:mod:`kvcache.memtune`: 160 blocks of 2 MiB, or 2,900 of DeepSeek V4.1's 112 KiB), and the
kernel faults in and zeroes every page a shard lands in, on every load. Measured on the
2-core VM (Llama-3-8B blocks, 256 a call): 13.6 % of the client's CPU went to zeroing those
pages. This cache hands the same pages to the next load instead.

What it keeps is bounded by ``limit_bytes`` (``ClientConfig.scratch_cache_bytes``): a
buffer given back past that is dropped, smallest first, and a buffer asked for past it is
allocated as before and never kept. A buffer is handed to one holder at a time: taken,
it is out of the cache until given back, so concurrent loads never share one.
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt

from kvcache.errors import ArgumentError

__all__ = ["ScratchCache"]

#: Sizes are rounded up to this (a transparent huge page), so a slightly larger call can
#: reuse what a slightly smaller one left.
GRAIN = 2 << 20


class ScratchCache:
    """A bounded free list of byte buffers, shared by the calls of one client process."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ArgumentError(f"limit_bytes must be >= 0, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self._free: list[npt.NDArray[np.uint8]] = []  # by size, smallest first
        self._lock = threading.Lock()
        #: Buffers handed out from the cache / allocated anew (for tests and stats).
        self.reused = 0
        self.allocated = 0

    @property
    def cached_bytes(self) -> int:
        """Bytes in buffers waiting in the cache."""
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def take(self, nbytes: int) -> tuple[npt.NDArray[np.uint8], bool]:
        """A 1-D uint8 buffer of at least ``nbytes`` bytes that no one else holds (its
        contents are whatever it held last), and whether it came from the cache."""
        if nbytes < 0:
            raise ArgumentError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    self.reused += 1
                    return self._free.pop(i), True
            self.allocated += 1
        size = -(-max(nbytes, 1) // GRAIN) * GRAIN if nbytes <= self.limit_bytes else nbytes
        return np.empty(size, np.uint8), False

    def give(self, buf: npt.NDArray[np.uint8]) -> None:
        """Hand ``buf`` (from :meth:`take`) back; the caller must not touch it again."""
        if buf.nbytes > self.limit_bytes:
            return
        with self._lock:
            if any(b is buf for b in self._free):
                raise ArgumentError("buffer given back twice")
            self._free.append(buf)
            self._free.sort(key=lambda b: b.nbytes)
            total = sum(b.nbytes for b in self._free)
            while total > self.limit_bytes:
                total -= self._free.pop(0).nbytes
