"""Cluster credentials: one secret per tenant, an admin token, and per-tenant byte quotas.

A cluster is closed by default: every data-path connection proves it holds
its tenant's secret (:mod:`kvcache.session`), and every mutating admin call
carries the admin token. Both live in one TOML file, readable by its owner
only (mode 0600, like an ssh key)::

    admin_token = "9f2c..."           # admin HTTP: PUT/DELETE /retention, ...

    [tenants.default]
    secret = "3b1e..."                # 64 hex digits (32 random bytes)

    [tenants.search]
    secret = "a0c4..."
    quota = "200GiB"                  # shard bytes this tenant may keep per node
    class_quotas = { chat = "120GiB" } # and per traffic class within that
    pin_quota = "10GiB"               # pinned shard bytes per node (default 0: no pins)

Daemons load the whole file; a client needs only its own tenant's entry (a
file holding just that tenant, or ``secret`` in its config). ``kvcache up``
and ``kvcache server`` generate a file when none is given.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NewType

import xxhash

from kvcache.config import load_toml, parse_size
from kvcache.errors import ConfigError

__all__ = [
    "DEFAULT_TENANT",
    "TENANT_TAG",
    "Credentials",
    "TenantCredentials",
    "RESERVED_TENANT_NAMES",
    "TenantId",
    "check_tenant_name",
    "parse_secret",
    "tenant_id",
]

DEFAULT_TENANT = "default"
#: Domain tag of the 8-byte tenant id that prefixes every stored key of a tenant.
TENANT_TAG = b"kvcache:tenant:v1\x00"
SECRET_BYTES = 32
_TENANT_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}\Z")
#: Names no tenant may have: ``admin`` is the event stream's superuser (kvcache.events).
RESERVED_TENANT_NAMES = frozenset({"admin"})

TenantId = NewType("TenantId", bytes)


def check_tenant_name(name: object) -> str:
    """Return ``name`` if it is a valid tenant name, else raise ConfigError."""
    if not isinstance(name, str) or not _TENANT_RE.match(name):
        raise ConfigError(
            f"tenant name {name!r} is invalid: use 1-64 characters of a-z, 0-9, '_', '.', '-', "
            "starting with a letter or digit"
        )
    if name in RESERVED_TENANT_NAMES:
        raise ConfigError(
            f"tenant name {name!r} is reserved: the event stream's administrator logs in as "
            f"{name!r} with the admin token (a tenant of that name would read every tenant's "
            "events); choose another name"
        )
    return name


def tenant_id(name: str) -> TenantId:
    """The 8-byte id a daemon files a tenant's shards under (stable: part of the store format)."""
    return TenantId(xxhash.xxh3_64_digest(TENANT_TAG + check_tenant_name(name).encode()))


def parse_secret(raw: object, *, what: str) -> bytes:
    """A secret from its hex text; raises ConfigError naming ``what``."""
    if not isinstance(raw, str):
        raise ConfigError(f"{what}: secret must be a hex string")
    try:
        value = bytes.fromhex(raw.strip())
    except ValueError:
        raise ConfigError(f"{what}: secret is not hex") from None
    if len(value) < 16:
        raise ConfigError(f"{what}: secret must be at least 16 bytes (32 hex digits)")
    return value


def _size(value: object, what: str) -> int:
    size = parse_size(value, what=what)
    if size < 1:
        raise ConfigError(f"{what} must be positive, got {value!r}")
    return size


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantCredentials:
    """One tenant: its name, its secret, and its byte quotas on each node (None: no quota)."""

    name: str
    secret: bytes = field(repr=False)
    quota_bytes: int | None = None
    class_quotas: tuple[tuple[str, int], ...] = ()
    #: Bytes of pinned shards (retention hint ``pin``) the tenant may keep per node; 0: a
    #: pin is dropped (logged and counted), so a tenant cannot pin a node full by default.
    pin_quota_bytes: int = 0
    #: The tenant's 8-byte storage id, derived from its name once (a daemon reads it for
    #: every request: hashing the name each time was 3 % of a GET's CPU, py-spy).
    id: TenantId = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_tenant_name(self.name)
        if len(self.secret) < 16:
            raise ConfigError(f"tenant {self.name}: secret must be at least 16 bytes")
        object.__setattr__(self, "id", tenant_id(self.name))

    def class_quota(self, traffic_class: str) -> int | None:
        """The quota of one of the tenant's traffic classes, if set."""
        for name, size in self.class_quotas:
            if name == traffic_class:
                return size
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Credentials:
    """Every tenant's credentials and the admin token (see the module docstring)."""

    tenants: tuple[TenantCredentials, ...]
    admin_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ConfigError(f"duplicate tenants in credentials: {sorted(names)}")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ConfigError("admin_token must be at least 16 characters")

    def tenant(self, name: str) -> TenantCredentials | None:
        """The tenant called ``name``, or None."""
        for t in self.tenants:
            if t.name == name:
                return t
        return None

    def by_id(self) -> dict[TenantId, TenantCredentials]:
        """Tenants by storage id."""
        return {t.id: t for t in self.tenants}

    # ------------------------------------------------------------------ files

    @classmethod
    def generate(cls, tenants: tuple[str, ...] = (DEFAULT_TENANT,)) -> Credentials:
        """Fresh random secrets for ``tenants`` and a fresh admin token."""
        return cls(
            tenants=tuple(
                TenantCredentials(name=name, secret=secrets.token_bytes(SECRET_BYTES))
                for name in tenants
            ),
            admin_token=secrets.token_hex(SECRET_BYTES),
        )

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], *, source: str) -> Credentials:
        """Build from a parsed TOML document, naming the bad field on error."""
        unknown = set(raw) - {"admin_token", "tenants"}
        if unknown:
            raise ConfigError(
                f"{source}: unknown keys {sorted(unknown)}; known: admin_token, tenants"
            )
        table = raw.get("tenants", {})
        if not isinstance(table, Mapping):
            raise ConfigError(f"{source}: [tenants] must be a table of tables")
        tenants = []
        for name, entry in table.items():
            what = f"{source}: tenant {name!r}"
            if not isinstance(entry, Mapping):
                raise ConfigError(f"{what} must be a table with a secret")
            extra = set(entry) - {"secret", "quota", "class_quotas", "pin_quota"}
            if extra:
                raise ConfigError(f"{what}: unknown keys {sorted(extra)}")
            if "secret" not in entry:
                raise ConfigError(f"{what} has no secret")
            quotas = entry.get("class_quotas", {})
            if not isinstance(quotas, Mapping):
                raise ConfigError(f"{what}: class_quotas must be a table of class = size")
            tenants.append(
                TenantCredentials(
                    name=check_tenant_name(name),
                    secret=parse_secret(entry["secret"], what=what),
                    quota_bytes=(
                        None if "quota" not in entry else _size(entry["quota"], f"{what} quota")
                    ),
                    class_quotas=tuple(
                        (cls_name, _size(size, f"{what} class quota {cls_name}"))
                        for cls_name, size in sorted(quotas.items())
                    ),
                    pin_quota_bytes=(
                        0
                        if "pin_quota" not in entry
                        else _size(entry["pin_quota"], f"{what} pin_quota")
                    ),
                )
            )
        token = raw.get("admin_token")
        if token is not None and not isinstance(token, str):
            raise ConfigError(f"{source}: admin_token must be a string")
        return cls(tenants=tuple(tenants), admin_token=token)

    @classmethod
    def load(cls, path: str | Path) -> Credentials:
        """Read a credentials file, refusing one that others may read."""
        path = Path(path)
        check_private(path)
        return cls.from_mapping(load_toml(path), source=str(path))

    def to_toml(self) -> str:
        """The credentials as TOML text (what :meth:`load` reads back)."""
        lines = ["# kvcache cluster credentials: keep private (mode 0600).", ""]
        if self.admin_token is not None:
            lines += [f'admin_token = "{self.admin_token}"', ""]
        for t in self.tenants:
            lines.append(f"[tenants.{t.name}]")
            lines.append(f'secret = "{t.secret.hex()}"')
            if t.quota_bytes is not None:
                lines.append(f"quota = {t.quota_bytes}")
            if t.class_quotas:
                inner = ", ".join(f"{name} = {size}" for name, size in t.class_quotas)
                lines.append(f"class_quotas = {{ {inner} }}")
            if t.pin_quota_bytes:
                lines.append(f"pin_quota = {t.pin_quota_bytes}")
            lines.append("")
        return "\n".join(lines)

    def only(self, name: str) -> Credentials:
        """A copy holding only tenant ``name`` and no admin token (what one client gets)."""
        tenant = self.tenant(name)
        if tenant is None:
            raise ConfigError(f"no tenant {name!r} in these credentials")
        return Credentials(tenants=(tenant,))

    def write(self, path: str | Path) -> Path:
        """Write the file with mode 0600 (created private, then renamed into place)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(self.to_toml())
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except OSError as exc:
            raise ConfigError(f"cannot write credentials file {path}: {exc}") from None
        return path


def check_private(path: Path) -> None:
    """Raise ConfigError unless ``path`` exists and only its owner may read or write it."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"credentials file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read credentials file {path}: {exc}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"credentials file {path} is not a regular file")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"credentials file {path} is readable by others (mode {stat.S_IMODE(mode):04o}): "
            f"run `chmod 600 {path}`"
        )
