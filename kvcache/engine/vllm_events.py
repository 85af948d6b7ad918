"""What the vLLM connector reports as vLLM KV events: stored, loaded, SWA states held. Pure.

The worker half notes each store that reached the cluster, each load that came back from it
and each sliding-window state its SWA tier holds (:class:`EngineEvents`, bounded, any
thread); vLLM asks for them after every step (``get_kv_connector_kv_cache_events``), sends
them to the scheduler half with the step's output, and the scheduler half hands them to
vLLM's own publisher (``take_events``), so subscribers of vLLM's KV events see them:

- a store or a load of blocks: ``BlockStored`` with ``medium="STORAGE"``, the kvcache
  block keys (``docs/spec/hashing.md``), their token ids, the parent block's key, the
  full-attention group's ``group_idx`` and spec kind, ``locality="REMOTE"`` (the cluster,
  not this engine), ``ownership="kvcache"`` and the request id as ``session_id`` (vLLM's
  "store or reuse report");
- an SWA state held: ``BlockStored`` with ``medium="CPU"``, ``locality="LOCAL"`` (this
  worker's RAM), the key of the block the state follows, once per sliding-window group with
  that group's ``group_idx``, ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``:
  a router sends the conversation's next turn here. The tier forgets a state after its TTL
  (about 3 minutes) without an event; the store's own stream reports the holder record's
  expiry (``docs/spec/events.md``).

This module builds plain :class:`Report` records; the connector turns them into vLLM's
classes (the only module that imports vLLM).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["EngineEvents", "GroupSpec", "Report"]

MEDIUM_STORAGE = "STORAGE"
MEDIUM_CPU = "CPU"


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """A KV cache group as events describe it: its index, kind and window (None: full)."""

    group_idx: int
    kind: str
    sliding_window: int | None = None
    block_size: int = 0


@dataclass(frozen=True, slots=True)
class Report:
    """One BlockStored event, in vLLM's fields."""

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str
    group: GroupSpec
    locality: str
    session_id: str | None


class EngineEvents:
    """Reports waiting for vLLM to take them; at most ``max_reports`` (older ones are
    dropped and counted: vLLM takes them every step, so only a stalled engine loses any)."""

    def __init__(self, *, max_reports: int = 4096) -> None:
        self._lock = threading.Lock()
        self._reports: list[Report] = []
        self._max = max_reports
        self.dropped = 0

    def _add(self, report: Report) -> None:
        with self._lock:
            if len(self._reports) >= self._max:
                self._reports.pop(0)
                self.dropped += 1
            self._reports.append(report)

    def blocks(
        self,
        keys: Sequence[bytes],
        tokens: Sequence[int] | npt.NDArray[Any],
        *,
        first_block: int,
        count: int,
        block_size: int,
        group: GroupSpec,
        skip: Sequence[int] = (),
        session_id: str | None = None,
    ) -> None:
        """Blocks ``first_block .. first_block + count - 1`` of a request (``keys``: all its
        block keys from block 0; ``skip``: block numbers that failed) are in the cluster."""
        failed = set(skip)
        run: list[int] = []
        for b in range(first_block, first_block + count):
            if b in failed:
                self._run(run, keys, tokens, block_size, group, session_id)
                run = []
            else:
                run.append(b)
        self._run(run, keys, tokens, block_size, group, session_id)

    def _run(
        self,
        run: list[int],
        keys: Sequence[bytes],
        tokens: Sequence[int] | npt.NDArray[Any],
        block_size: int,
        group: GroupSpec,
        session_id: str | None,
    ) -> None:
        if not run:
            return
        first, end = run[0], run[-1] + 1
        self._add(
            Report(
                block_hashes=tuple(bytes(k) for k in keys[first:end]),
                parent_block_hash=bytes(keys[first - 1]) if first > 0 else None,
                token_ids=tuple(np.asarray(tokens)[first * block_size : end * block_size].tolist()),
                block_size=block_size,
                medium=MEDIUM_STORAGE,
                group=group,
                locality="REMOTE",
                session_id=session_id,
            )
        )

    def state(
        self,
        key: bytes,
        parent: bytes | None,
        groups: Sequence[GroupSpec],
        *,
        session_id: str | None = None,
    ) -> None:
        """A sliding-window state following block ``key`` is held in this worker's RAM."""
        for group in groups:
            self._add(
                Report(
                    block_hashes=(bytes(key),),
                    parent_block_hash=parent,
                    token_ids=(),
                    block_size=group.block_size,
                    medium=MEDIUM_CPU,
                    group=group,
                    locality="LOCAL",
                    session_id=session_id,
                )
            )

    def take(self) -> list[Report]:
        """Every report so far, oldest first; the buffer is emptied."""
        with self._lock:
            out, self._reports = self._reports, []
        return out
