"""What the client and its I/O worker processes say to each other (kvcache.client.pool).

One frozen record per message, sent over a local socket pair (pickled: they live
only as long as the two processes, nothing of them is persisted). A request
names its ``request_id``; every reply to it carries the same id, so the parent
routes each reply to the call waiting for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = [
    "Close",
    "Counters",
    "CountersRequest",
    "Failed",
    "LoadRequest",
    "Loaded",
    "Ready",
    "RequestReply",
    "Started",
    "StoreRequest",
    "Stored",
    "WorkerReply",
    "WorkerRequest",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadRequest:
    """Load blocks ``keys`` (16 bytes each, concatenated) into rows of shared buffer
    ``buffer`` from byte ``offset`` on; ``holders`` index the parent's ``nodes``."""

    request_id: int
    keys: bytes
    stripes: npt.NDArray[np.uint64]
    holders: npt.NDArray[np.int64]
    tokens_per_block: int
    payload_len: int
    traffic_class: str
    buffer: str
    offset: int
    nodes: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreRequest:
    """Store one payload per key from rows of shared buffer ``buffer`` at ``offset``."""

    request_id: int
    keys: bytes
    payload_len: int
    traffic_class: str
    buffer: str
    offset: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CountersRequest:
    """Send the worker's client counters."""

    request_id: int


@dataclass(frozen=True, slots=True)
class Close:
    """Stop the worker."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Started:
    """The worker's client is up (``error`` empty), or could not start."""

    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready:
    """Blocks [first, stop) of a load's range are verified and in place."""

    request_id: int
    first: int
    stop: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Loaded:
    """A load is over: its range's first ``blocks`` blocks are good."""

    request_id: int
    blocks: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Stored:
    """A store is over; ``failed_blocks`` are positions within its range."""

    request_id: int
    written: int
    touched: int
    failed_blocks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Counters:
    """The worker's client counters."""

    request_id: int
    counters: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Failed:
    """A request failed in the worker (or the worker died under it)."""

    request_id: int
    error: str


WorkerRequest = LoadRequest | StoreRequest | CountersRequest | Close
#: A reply to one request (routed by its ``request_id``).
RequestReply = Ready | Loaded | Stored | Counters | Failed
WorkerReply = Started | RequestReply
