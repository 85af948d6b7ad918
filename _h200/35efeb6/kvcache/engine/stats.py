"""Counters an engine adapter writes for tools and tests: one JSON file per process."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["StatsFile"]

log = logging.getLogger(__name__)


class StatsFile:
    """Writes counters to ``{dir}/kvcache-{role}-{pid}.json`` when they change (atomically)."""

    def __init__(self, directory: Path | None, role: str, pid: int) -> None:
        self.path = None if directory is None else Path(directory) / f"kvcache-{role}-{pid}.json"
        self._last: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def write(self, snapshot: dict[str, Any], *, force: bool = False) -> None:
        """Write ``snapshot`` unless it equals the last one written (``force``: always)."""
        if self.path is None:
            return
        with self._lock:
            if snapshot == self._last and not force:
                return
            self._last = snapshot
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_suffix(".tmp")
                tmp.write_text(json.dumps(snapshot, sort_keys=True))
                os.replace(tmp, self.path)
            except OSError as exc:
                log.warning("kvcache: cannot write stats to %s: %s", self.path, exc)
