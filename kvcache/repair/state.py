"""The repairer's resumable state: where each tenant's pass stands, in a small JSON file.

``{"version": 1, "tenants": {name: {"cursor": hex key, "done": bool, "passes": n}}}``.
``cursor`` is the first key not yet repaired in the pass under way: a run that
stops (SIGTERM, ``--limit``, a crash) starts there next time instead of from
the beginning. Written atomically (temporary file, then rename) after every
batch.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvcache.errors import ConfigError

__all__ = ["RepairState", "TenantState"]

log = logging.getLogger(__name__)

VERSION = 1


@dataclass(slots=True)
class TenantState:
    """One tenant's pass: the next key to repair, and whether the pass finished."""

    cursor: bytes = bytes(16)
    done: bool = False
    passes: int = 0


@dataclass(slots=True)
class RepairState:
    """Every tenant's :class:`TenantState`, kept in ``path`` (None: in memory only)."""

    path: Path | None = None
    tenants: dict[str, TenantState] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path | None) -> RepairState:
        """The state in ``path`` (a fresh one if the file does not exist yet)."""
        state = cls(path)
        if path is None or not path.exists():
            return state
        try:
            raw = json.loads(path.read_text())
            if raw.get("version") != VERSION:
                raise ValueError(f"version {raw.get('version')!r}, this build reads {VERSION}")
            for name, entry in raw["tenants"].items():
                cursor = bytes.fromhex(entry["cursor"])
                if len(cursor) != 16:
                    raise ValueError(f"cursor of tenant {name!r} is not 16 bytes")
                state.tenants[name] = TenantState(
                    cursor, bool(entry["done"]), int(entry.get("passes", 0))
                )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(
                f"repair state file {path} is unreadable ({exc}); delete it to start over"
            ) from None
        return state

    def tenant(self, name: str) -> TenantState:
        """The state of ``name``'s pass (created empty)."""
        return self.tenants.setdefault(name, TenantState())

    def save(self) -> None:
        """Write the state (atomically); a no-op without a path."""
        if self.path is None:
            return
        body = {
            "version": VERSION,
            "tenants": {
                name: {"cursor": t.cursor.hex(), "done": t.done, "passes": t.passes}
                for name, t in sorted(self.tenants.items())
            },
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(body, indent=1))
            os.replace(tmp, self.path)
        except OSError as exc:
            raise ConfigError(f"cannot write repair state file {self.path}: {exc}") from None
