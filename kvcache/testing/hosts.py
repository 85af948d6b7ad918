"""Simulated hosts on one machine: a network namespace per host, or a loopback address per host.

Tests and benchmarks that need several *hosts* (failure domains that fail
together, addresses of their own) model them here:

* **Namespaces** (root, or CAP_NET_ADMIN): one ``ip netns`` per host, each
  with ``lo`` up and one end of a veth pair; the other ends hang on a bridge
  in the root namespace that carries a private /24 (``10.213.X.0/24``, the
  first X no interface or route of this machine uses). The bridge holds
  ``.1``; host ``h`` holds ``.(10 + h)``. A process in the root namespace (the
  test's client) reaches every host; :meth:`HostNet.partition` takes a host's
  link down, so its peers see a host that stopped answering (no resets).
* **Loopback** (no namespaces): host ``h`` is the address ``127.0.0.(10 + h)``.
  Processes are then not isolated; a partition cannot be modelled.
  :attr:`HostNet.note` says which one a run got, so a test can report it.

Names carry the creating process's pid: ``kvh-<pid>-<seq>-h<h>`` for
namespaces, ``kvh<pid base 36><seq>b`` / ``...v<h>`` for links, so parallel runs do
not clash and :func:`cleanup_stale` can remove what a killed run left behind
(namespaces and links whose pid is no longer alive). :meth:`HostNet.close`
removes everything a run made and is safe to call twice.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import itertools
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvcache.errors import ArgumentError, ClusterError

__all__ = ["HostNet", "HostNetMode", "cleanup_stale"]

log = logging.getLogger(__name__)

#: Prefix of every namespace and link this module makes.
PREFIX = "kvh"
#: Third octet candidates of the private subnet ``10.213.X.0/24``.
_SUBNET_BASE = "10.213"
_NS_RE = re.compile(rf"{PREFIX}-(\d+)-\d+-h\d+\Z")
_LINK_RE = re.compile(rf"{PREFIX}([0-9a-z]{{5}})[0-9a-z][bv]\d*\Z")
_IP_TIMEOUT_S = 10.0
_seq = itertools.count()
_PR_SET_PDEATHSIG = 1


class HostNetMode(enum.Enum):
    """How hosts are modelled."""

    NETNS = "netns"
    LOOPBACK = "loopback"


def _base36(value: int, width: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while value:
        value, rem = divmod(value, 36)
        out = digits[rem] + out
    return out.rjust(width, "0")[-width:]


def _ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS``; ClusterError with its stderr when it fails and ``check``."""
    try:
        done = subprocess.run(
            ["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError(f"`ip {' '.join(args)}` failed: {exc}") from None
    if check and done.returncode != 0:
        raise ClusterError(
            f"`ip {' '.join(args)}` exited with {done.returncode}: {done.stderr.strip()}"
        )
    return done.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL me when my parent dies (Linux only; else nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def cleanup_stale() -> list[str]:
    """Delete namespaces and links of this module whose creating process is gone.

    Processes still inside a stale namespace are left alone (they are not this
    process's); the namespace's name goes, and the kernel frees it when they
    exit. Returns the names removed. Does nothing without ``ip``.
    """
    if shutil.which("ip") is None:
        return []
    removed: list[str] = []
    with contextlib.suppress(ClusterError):
        for line in _ip("netns", "list").splitlines():
            name = line.split()[0] if line.split() else ""
            match = _NS_RE.match(name)
            if match and not _pid_alive(int(match.group(1))):
                _ip("netns", "del", name, check=False)
                removed.append(name)
    with contextlib.suppress(ClusterError):
        for line in _ip("-o", "link", "show").splitlines():
            parts = line.split(":")
            if len(parts) < 2:
                continue
            name = parts[1].strip().split("@")[0]
            match = _LINK_RE.match(name)
            if match and not _pid_alive(int(match.group(1), 36)):
                _ip("link", "del", name, check=False)
                removed.append(name)
    if removed:
        log.info("removed stale host-network objects: %s", ", ".join(removed))
    return removed


class HostNet:
    """``hosts`` simulated hosts (see the module docstring); use as a context manager.

    ``mode`` None tries namespaces and falls back to loopback addresses when they
    cannot be made (the environment variable ``KVCACHE_TEST_HOSTS=loopback`` forces
    the fallback, ``netns`` forbids it).
    """

    def __init__(self, hosts: int, *, mode: HostNetMode | None = None) -> None:
        if not 1 <= hosts <= 200:
            raise ArgumentError(f"hosts must lie in 1..200, got {hosts}")
        self.hosts = hosts
        self.pid = os.getpid()
        seq = next(_seq)
        self.tag = f"{PREFIX}-{self.pid}-{seq}"
        self._link_tag = f"{PREFIX}{_base36(self.pid, 5)}{_base36(seq, 1)}"
        self.bridge = f"{self._link_tag}b"
        self.namespaces = [f"{self.tag}-h{h}" for h in range(hosts)]
        self._made: list[tuple[str, str]] = []  # ("netns" | "link", name), in creation order
        self._addresses: list[str] = []
        #: The hosts' subnet (CIDR).
        self.subnet = ""
        #: One line saying how hosts are modelled in this run (tests print it).
        self.note = ""
        forced = os.environ.get("KVCACHE_TEST_HOSTS", "").strip().lower()
        if mode is None and forced:
            try:
                mode = HostNetMode(forced)
            except ValueError:
                raise ArgumentError(
                    f"KVCACHE_TEST_HOSTS must be netns or loopback, got {forced!r}"
                ) from None
        self.mode = self._setup(mode)

    # -------------------------------------------------------------- setup / teardown

    def _setup(self, mode: HostNetMode | None) -> HostNetMode:
        if mode is HostNetMode.LOOPBACK:
            self._loopback("loopback addresses requested")
            return HostNetMode.LOOPBACK
        try:
            self._make_namespaces()
        except ClusterError as exc:
            self.close()
            if mode is HostNetMode.NETNS:
                raise
            self._loopback(str(exc))
            return HostNetMode.LOOPBACK
        self.note = (
            f"network namespaces {self.namespaces[0]}..h{self.hosts - 1} on bridge "
            f"{self.bridge} ({self.subnet})"
        )
        log.info("%s", self.note)
        return HostNetMode.NETNS

    def _loopback(self, why: str) -> None:
        self._addresses = [f"127.0.0.{10 + h}" for h in range(self.hosts)]
        self.subnet = "127.0.0.0/8"
        self.note = f"namespaces unavailable: loopback addresses, one per host ({why})"
        log.warning("%s", self.note)

    def _make_namespaces(self) -> None:
        if shutil.which("ip") is None:
            raise ClusterError("no `ip` command (install iproute2)")
        cleanup_stale()
        third = self._free_subnet()
        self.subnet = f"{_SUBNET_BASE}.{third}.0/24"
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("addr", "add", f"{_SUBNET_BASE}.{third}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h, ns in enumerate(self.namespaces):
            address = f"{_SUBNET_BASE}.{third}.{10 + h}"
            outer, inner = self.veth(h), f"{self._link_tag}i{h}"
            _ip("netns", "add", ns)
            self._made.append(("netns", ns))
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._made.append(("link", outer))
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            self._addresses.append(address)
        # `ip netns exec` also needs mount namespaces and sysfs: prove it works here.
        _ip("netns", "exec", self.namespaces[0], "ip", "-o", "addr", "show", "lo")

    def _free_subnet(self) -> int:
        used = _ip("-o", "-4", "addr", "show") + _ip("-4", "route", "show")
        taken = {int(m) for m in re.findall(rf"\b{re.escape(_SUBNET_BASE)}\.(\d+)\.", used)}
        start = self.pid % 250
        for offset in range(250):
            third = 1 + (start + offset) % 250
            if third not in taken:
                return third
        raise ClusterError(f"every {_SUBNET_BASE}.X.0/24 subnet is in use on this machine")

    def close(self) -> None:
        """Remove every namespace and link this object made (idempotent)."""
        while self._made:
            kind, name = self._made.pop()
            if kind == "netns":
                _ip("netns", "del", name, check=False)
            else:
                _ip("link", "del", name, check=False)

    def __enter__(self) -> HostNet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- use

    def address(self, host: int) -> str:
        """Host ``host``'s IPv4 address."""
        self._check(host)
        return self._addresses[host]

    def veth(self, host: int) -> str:
        """The root-namespace end of host ``host``'s link (namespaces only)."""
        return f"{self._link_tag}v{host}"

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside host ``host`` (prefixed with ``ip netns exec NS``)."""
        self._check(host)
        if self.mode is HostNetMode.NETNS:
            # `ip netns exec` execs the command in place: the child's pid is the command's.
            return ["ip", "netns", "exec", self.namespaces[host], *argv]
        return list(argv)

    def spawn(
        self,
        host: int,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        die_with_parent: bool = True,
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside host ``host`` in a session of its own, output to ``log_path``.

        With ``die_with_parent`` the child gets SIGKILL when this process dies (Linux
        ``PR_SET_PDEATHSIG``), so a killed test run leaves no daemons behind.
        """
        with open(log_path, "ab") as out:
            return subprocess.Popen(
                self.command(host, argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
                preexec_fn=_die_with_parent if die_with_parent else None,
            )

    def partition(self, host: int) -> bool:
        """Cut host ``host`` off the network (its link down); False where that cannot be modelled."""
        self._check(host)
        if self.mode is not HostNetMode.NETNS:
            return False
        _ip("link", "set", self.veth(host), "down")
        return True

    def heal(self, host: int) -> None:
        """Undo :meth:`partition`."""
        self._check(host)
        if self.mode is HostNetMode.NETNS:
            _ip("link", "set", self.veth(host), "up")

    def _check(self, host: int) -> None:
        if not 0 <= host < len(self._addresses):
            raise ArgumentError(f"host must lie in 0..{len(self._addresses) - 1}, got {host}")
