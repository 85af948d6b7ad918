"""Hold Python's cyclic garbage collector off while data-path calls run.

A load or store allocates container objects by the thousand (request sections,
memoryviews, reply records), so the collector runs a pass every few hundred of
them, holding the GIL and stalling the transport's I/O threads; in an inference
worker, whose heap holds torch and the engine, its older-generation passes walk
all of that too. Measured on the 2-core VM (112 KiB blocks, torch imported, as
in a worker): the collector took about 40 % of a store's client CPU; with it
held off, 1.65 → 1.05 CPU-s/GB and 0.46 → 0.65 GB/s.

Garbage is deferred, not kept: reference counting frees almost everything as
usual, and only reference cycles wait. Pauses are counted across threads: the
collector is switched off when the first call starts (if it was on) and back on
when the last one ends, and while calls keep overlapping, a full collection
still runs every ``MAX_PAUSE_S``. A collector the host switched off itself
stays off. Process-wide, like :mod:`kvcache.memtune`; the client config's
``pause_gc`` turns it off.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["MAX_PAUSE_S", "gc_paused"]

#: Longest the collector stays off while calls keep overlapping, in seconds.
MAX_PAUSE_S = 10.0


class _PauseState:
    """How many calls hold the collector off, and whether this module switched it off."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.paused_by_us = False
        self.since = 0.0


_state = _PauseState()


@contextmanager
def gc_paused(
    enabled: bool = True, *, clock: Callable[[], float] = time.monotonic
) -> Iterator[None]:
    """Run the body with the cyclic collector off (see the module docstring)."""
    if not enabled:
        yield
        return
    state = _state
    with state.lock:
        if state.active == 0 and gc.isenabled():
            gc.disable()
            state.paused_by_us = True
            state.since = clock()
        state.active += 1
    try:
        yield
    finally:
        collect = False
        with state.lock:
            state.active -= 1
            if state.paused_by_us:
                if state.active == 0:
                    state.paused_by_us = False
                    gc.enable()
                elif clock() - state.since >= MAX_PAUSE_S:
                    state.since = clock()
                    collect = True
        if collect:
            gc.collect()
