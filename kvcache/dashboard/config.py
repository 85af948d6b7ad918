"""``DashboardConfig``: what ``kvcache dashboard`` is told, frozen and validated when built.

Layers, later winning: defaults, the ``[dashboard]`` table of ``--config``,
``KVCACHE_DASHBOARD_<FIELD>`` environment variables, flags. The admin token is
read from the credentials file (by default ``credentials.toml`` beside the
cluster file) unless given as ``token`` (env ``KVCACHE_DASHBOARD_TOKEN``, or
``KVCACHE_ADMIN_TOKEN`` as the retention CLI reads it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcache.config import build_config, env_overrides, load_toml
from kvcache.credentials import Credentials
from kvcache.errors import ConfigError
from kvcache.server.config import parse_admin_listen

__all__ = ["DashboardConfig", "load_dashboard_config"]

ENV_PREFIX = "KVCACHE_DASHBOARD"


@dataclass(frozen=True, slots=True, kw_only=True)
class DashboardConfig:
    """Settings of a stand-alone status page server."""

    #: The cluster map whose nodes the page polls (read again at every poll).
    cluster_file: Path = Path("kvcache-local/cluster.toml")
    #: host:port to serve on. Port 0 picks a free port (printed at start).
    listen: str = "127.0.0.1:7490"
    #: Where the admin token is read; empty: ``credentials.toml`` beside the cluster file.
    credentials_file: Path | None = None
    #: The admin token itself, instead of a credentials file.
    token: str | None = field(default=None, repr=False)
    #: Serve the page without a token. Refused unless set: the page is closed by default.
    no_auth: bool = False
    #: How often an open page asks for fresh data (seconds).
    refresh_s: float = 2.0
    #: How long a node has to answer ``/stats`` before it shows as unreachable.
    timeout_s: float = 1.0

    def __post_init__(self) -> None:
        try:
            parse_admin_listen(self.listen)
        except ConfigError:
            raise ConfigError(f"listen must be host:port, got {self.listen!r}") from None
        for name in ("refresh_s", "timeout_s"):
            if not 0 < getattr(self, name) <= 86_400:  # inf made every page request a 500
                raise ConfigError(
                    f"{name} must be > 0 s and at most a day, got {getattr(self, name)}"
                )
        if self.token is not None and len(self.token) < 16:
            raise ConfigError("token must be the cluster's admin token (16 characters or more)")

    def admin_token(self) -> str | None:
        """The token the page requires: None only with ``no_auth``. Raises ConfigError when
        none is configured and ``no_auth`` is not set."""
        if self.no_auth:
            return None
        if self.token:
            return self.token
        path = self.credentials_file or self.cluster_file.parent / "credentials.toml"
        if not path.exists():
            raise ConfigError(
                f"the status page needs the admin token, and {path} does not exist: pass "
                "--credentials FILE or --token (env KVCACHE_ADMIN_TOKEN), or --no-auth to "
                "serve it open"
            )
        token = Credentials.load(path).admin_token
        if token is None:
            raise ConfigError(f"{path} holds no admin_token: add one, or pass --no-auth")
        return token


#: Top-level tables a config file shared between the components may hold.
_SHARED_TABLES = frozenset({"dashboard", "server", "retention", "client", "swa"})


def load_dashboard_config(
    path: str | Path | None = None,
    *,
    flags: Mapping[str, Any] | None = None,
    environ: bool = True,
) -> DashboardConfig:
    """The config from TOML ``[dashboard]`` < environment < flags (None flags ignored).

    The file may be shared with other components, so their tables are let be; any other table
    (a misspelled ``[dashbord]``) is an error rather than a dashboard quietly on defaults.
    """
    raw = load_toml(path) if path is not None else {}
    unknown = sorted(set(raw) - _SHARED_TABLES)
    if unknown:
        raise ConfigError(
            f"{path}: unknown table(s) {unknown}; the dashboard reads [dashboard] "
            f"(a shared file may also hold {', '.join(sorted(_SHARED_TABLES - {'dashboard'}))})"
        )
    table = raw.get("dashboard", {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"{path}: [dashboard] must be a table")
    env: dict[str, Any] = {}
    if environ:
        if os.environ.get("KVCACHE_ADMIN_TOKEN"):
            env["token"] = os.environ["KVCACHE_ADMIN_TOKEN"]
        env.update(env_overrides(DashboardConfig, ENV_PREFIX))
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    named = ((str(path), table), ("environment", env), ("flags", given))
    sources = ", ".join(name for name, layer in named if layer) or "defaults"
    return build_config(DashboardConfig, table, env, given, source=sources)
