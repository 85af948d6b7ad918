"""etcd I/O for membership: thin, over ``aetcd`` (asyncio, etcd v3 API).

Everything here moves bytes to and from etcd; what they mean is decided in
:mod:`kvcache.membership.model`. One :class:`EtcdStore` wraps one ``aetcd``
client and fails over between the configured endpoints. Failures surface as
:class:`~kvcache.errors.ClusterError` naming the endpoint.

Blocking callers (CLIs, ``ClusterMap.load``) use :func:`run_sync`, which runs a
coroutine on a fresh event loop in a thread of its own, so it also works from
code that already runs an event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aetcd

from kvcache.cluster import ClusterMap, EtcdSettings
from kvcache.errors import ClusterError, ConfigError, KVCacheError
from kvcache.membership.model import (
    MemberRecord,
    Registration,
    build_map,
    parse_members,
    parse_registrations,
)

__all__ = ["EtcdStore", "Snapshot", "fetch_map", "run_sync"]

log = logging.getLogger(__name__)

T = TypeVar("T")
_EPOCH = "epoch"
_MEMBERS = "members/"
_LIVE = "live/"
#: Attempts of an epoch-bumping transaction that lost a race before giving up.
_TXN_ATTEMPTS = 20


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything under a cluster's prefix at one etcd revision."""

    revision: int
    epoch: int
    members: dict[str, MemberRecord]
    live: dict[str, Registration]

    @property
    def cluster(self) -> ClusterMap:
        """The map (ConfigError when no node has joined)."""
        return build_map(self.members, self.live, self.epoch)[0]

    @property
    def live_ids(self) -> frozenset[str]:
        """Members that are live at their recorded address."""
        return build_map(self.members, self.live, self.epoch)[1]


class EtcdStore:
    """Membership records of one kvcache cluster in etcd (see the module docstring)."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self.prefix = settings.prefix.rstrip("/") + "/"
        self._endpoints = settings.host_ports()
        self._current = 0
        self._client: Any = None

    @property
    def endpoint(self) -> str:
        """The endpoint in use."""
        host, port = self._endpoints[self._current]
        return f"{host}:{port}"

    def key(self, name: str) -> bytes:
        """The etcd key of ``name`` under this cluster's prefix."""
        return (self.prefix + name).encode()

    async def _connected(self) -> Any:
        if self._client is None:
            host, port = self._endpoints[self._current]
            self._client = aetcd.Client(host=host, port=port, timeout=self.settings.timeout_s)
        return self._client

    async def call(self, what: str, fn: Callable[[Any], Awaitable[T]]) -> T:
        """Run ``fn(client)``, trying each endpoint once; ClusterError when all fail."""
        errors = []
        for _ in range(len(self._endpoints)):
            client = await self._connected()
            try:
                return await asyncio.wait_for(fn(client), self.settings.timeout_s)
            except (aetcd.exceptions.ClientError, TimeoutError, OSError) as exc:
                errors.append(f"{self.endpoint}: {type(exc).__name__}: {exc}")
                await self.close()
                self._current = (self._current + 1) % len(self._endpoints)
        raise ClusterError(f"etcd {what} failed: {'; '.join(errors)}")

    async def close(self) -> None:
        """Close the connection (the next call reconnects)."""
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.close()
            except Exception as exc:  # closing a broken channel: nothing left to do
                log.debug("closing the etcd client: %s", exc)

    # -------------------------------------------------------------- reads

    async def snapshot(self) -> Snapshot:
        """Epoch, members and live registrations at one revision."""
        prefix = self.prefix.encode()
        result = await self.call("range read", lambda c: c.get_prefix(prefix))
        members: dict[str, bytes] = {}
        live: dict[str, bytes] = {}
        epoch = 0
        for kv in result:
            name = bytes(kv.key)[len(prefix) :].decode(errors="replace")
            if name == _EPOCH:
                try:
                    epoch = int(bytes(kv.value))
                except ValueError:
                    log.error("etcd key %s%s is not an integer", self.prefix, _EPOCH)
            elif name.startswith(_MEMBERS):
                members[name[len(_MEMBERS) :]] = bytes(kv.value)
            elif name.startswith(_LIVE):
                live[name[len(_LIVE) :]] = bytes(kv.value)
        return Snapshot(
            revision=int(result.header.revision),
            epoch=epoch,
            members=parse_members(members),
            live=parse_registrations(live),
        )

    async def watch(self, start_revision: int, on_event: Callable[[], None]) -> None:
        """Call ``on_event`` for every change under the prefix from ``start_revision`` on;
        returns (or raises ClusterError) when the watch ends."""
        prefix = self.prefix.encode()
        client = await self._connected()
        try:
            watch = await client.watch_prefix(prefix, start_revision=start_revision)
            async for _event in watch:
                on_event()
        except (aetcd.exceptions.ClientError, OSError) as exc:
            await self.close()
            raise ClusterError(f"etcd watch on {self.endpoint} ended: {exc}") from exc

    # -------------------------------------------------------------- writes

    async def change_member(
        self,
        node_id: str,
        decide: Callable[[Mapping[str, MemberRecord]], MemberRecord | bool | None],
    ) -> tuple[bool, int]:
        """Apply ``decide(members)`` to ``node_id`` in one transaction with an epoch bump.

        ``decide`` returns the node's new record, None to delete it, or False for
        "no change". The transaction only commits if the epoch did not move since
        the members were read; otherwise it is decided again. Returns (changed,
        epoch after).
        """
        key = self.key(_MEMBERS + node_id)
        epoch_key = self.key(_EPOCH)
        for _ in range(_TXN_ATTEMPTS):
            snap = await self.snapshot()
            outcome = decide(snap.members)
            if outcome is False:
                return False, snap.epoch

            async def commit(c: Any, snap: Snapshot = snap, outcome: Any = outcome) -> bool:
                t = c.transactions
                if snap.epoch:
                    guard = t.value(epoch_key) == str(snap.epoch).encode()
                else:
                    guard = t.version(epoch_key) == 0
                write = t.delete(key) if outcome is None else t.put(key, outcome.to_json())
                ok, _ = await c.transaction(
                    compare=[guard],
                    success=[t.put(epoch_key, str(snap.epoch + 1).encode()), write],
                    failure=[],
                )
                return bool(ok)

            if await self.call("transaction", commit):
                return True, snap.epoch + 1
        raise ClusterError(f"could not change member {node_id}: the map kept changing")

    async def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        lease = await self.call("lease grant", lambda c: c.lease(ttl_s))
        return int(lease.id)

    async def put_live(self, reg: Registration, lease_id: int) -> None:
        """Publish ``reg`` under the lease."""
        key = self.key(_LIVE + reg.id)
        await self.call("put", lambda c: c.put(key, reg.to_json(), lease=lease_id))

    async def live(self, node_id: str) -> Registration | None:
        """The registration published under ``node_id`` now (None: none, or unreadable)."""
        key = self.key(_LIVE + node_id)
        got = await self.call("get", lambda c: c.get(key))
        if got is None:
            return None
        return parse_registrations({node_id: bytes(got.value)}).get(node_id)

    async def refresh(self, lease_id: int) -> int:
        """Renew the lease; its remaining TTL (0 or less: it had expired)."""
        reply = await self.call("lease keep-alive", lambda c: c.refresh_lease(lease_id))
        return int(reply.TTL) if reply is not None else 0

    async def revoke(self, lease_id: int) -> None:
        """End the lease now (its keys go at once)."""
        await self.call("lease revoke", lambda c: c.revoke_lease(lease_id))

    async def delete_live(self, node_id: str) -> None:
        """Remove a registration (whoever holds its lease)."""
        key = self.key(_LIVE + node_id)
        await self.call("delete", lambda c: c.delete(key))


def close_loop(loop: asyncio.AbstractEventLoop, store: EtcdStore) -> None:
    """Close ``store``'s channel, let every task left on ``loop`` finish its cancellation,
    then close the loop (gRPC complains of tasks destroyed while pending otherwise)."""
    loop.run_until_complete(store.close())
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


def run_sync(fn: Callable[[], Coroutine[Any, Any, T]], *, timeout_s: float = 60.0) -> T:
    """Run the coroutine ``fn()`` on a fresh event loop in its own thread; its result."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(fn())
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name="kvcache-etcd-sync", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ClusterError(f"etcd call did not finish within {timeout_s} s")
    if "error" in box:
        error = box["error"]
        if isinstance(error, KVCacheError):
            raise error
        raise ClusterError(f"etcd call failed: {type(error).__name__}: {error}") from error
    value: T = box["value"]
    return value


def fetch_map(settings: EtcdSettings) -> Snapshot:
    """One snapshot of the cluster's membership (blocking); ClusterError if none joined."""

    async def read() -> Snapshot:
        store = EtcdStore(settings)
        try:
            return await store.snapshot()
        finally:
            await store.close()

    snap = run_sync(read, timeout_s=settings.timeout_s * 3 + 5)
    try:
        snap.cluster  # noqa: B018 - validates that a node joined
    except ConfigError as exc:
        raise ClusterError(f"etcd prefix {settings.prefix}: {exc}") from None
    return snap
