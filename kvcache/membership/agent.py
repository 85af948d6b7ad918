"""A daemon's membership in etcd: register under a lease, keep it alive, leave on stop.

:class:`Registrar` runs one thread with its own event loop. It grants a lease
of ``ttl_s`` seconds, publishes the daemon's :class:`Registration` under it,
makes sure the node is a member of the map (a new node joins as ``up``; a
known one keeps the state an operator gave it and its record follows the
daemon's address), and renews the lease every ``ttl_s / 3``. If etcd cannot be
reached it keeps trying; if the lease ran out meanwhile (etcd then deleted the
registration, and clients stopped using the node) it registers again under a
new one. On a clean stop it revokes the lease, so clients stop sending to the
node at once instead of after the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from kvcache.cluster import EtcdSettings
from kvcache.errors import ClusterError
from kvcache.membership.etcd import EtcdStore, close_loop
from kvcache.membership.model import Registration, join_record

__all__ = ["Registrar"]

log = logging.getLogger(__name__)


class Registrar:
    """Keeps one daemon registered (see the module docstring)."""

    def __init__(
        self, settings: EtcdSettings, registration: Registration, *, ttl_s: int = 10
    ) -> None:
        if ttl_s < 2:
            raise ClusterError(f"lease TTL must be at least 2 s (etcd's minimum), got {ttl_s}")
        self.settings = settings
        self.registration = registration
        self.ttl_s = ttl_s
        self._store = EtcdStore(settings)
        self._loop = asyncio.new_event_loop()
        self._stopping = asyncio.Event()
        self._registered = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kvcache-registrar-{registration.id}", daemon=True
        )
        self.lease_id = 0
        #: The other daemon's registration last warned about (warned once each).
        self._waiting_for: Registration | None = None
        #: Registrations made (1 + re-registrations after a lost lease).
        self.registrations = 0
        self.last_error = ""

    def start(self, *, wait_s: float = 10.0) -> bool:
        """Start; returns whether the first registration finished within ``wait_s``."""
        self._thread.start()
        ok = self._registered.wait(wait_s)
        if not ok:
            log.warning(
                "%s: not registered in etcd %s after %.0f s (%s); still trying",
                self.registration.id,
                list(self.settings.endpoints),
                wait_s,
                self.last_error or "no answer",
            )
        return ok

    @property
    def registered(self) -> bool:
        """Whether a lease is held."""
        return self._registered.is_set()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            close_loop(self._loop, self._store)

    async def _register(self, lease: int = 0) -> None:
        """Publish the registration under ``lease`` (0: a new one) and record its address."""
        store = self._store
        if not lease:
            lease = await store.grant(self.ttl_s)
        await store.put_live(self.registration, lease)
        changed, epoch = await store.change_member(
            self.registration.id,
            lambda members: (
                join_record(members.get(self.registration.id), self.registration) or False
            ),
        )
        self.lease_id = lease
        self.registrations += 1
        self._registered.set()
        log.info(
            "%s registered in etcd (lease %x, TTL %d s)%s",
            self.registration.id,
            lease,
            self.ttl_s,
            f"; map epoch now {epoch}" if changed else "",
        )

    async def _main(self) -> None:
        every = self.ttl_s / 3.0
        while not self._stopping.is_set():
            try:
                if not self.lease_id:
                    if await self._another_holds_the_id():
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._stopping.wait(), every)
                        continue
                    await self._register()
                elif await self._store.refresh(self.lease_id) <= 0:
                    log.warning("%s: lease %x expired; registering again", *self._ids())
                    self.lease_id = 0
                    self._registered.clear()
                    continue
                else:
                    await self._check_still_ours()
                self.last_error = ""
            except ClusterError as exc:
                self.last_error = str(exc)
                log.warning("%s: etcd: %s", self.registration.id, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), every)
        if self.lease_id:
            try:
                await self._store.revoke(self.lease_id)
                log.info("%s left etcd (lease %x revoked)", *self._ids())
            except ClusterError as exc:
                log.warning("%s: could not revoke lease: %s", self.registration.id, exc)

    async def _another_holds_the_id(self) -> bool:
        """Whether another daemon's registration (another address) is live under this id:
        then this one waits for it to end rather than take the id over (two daemons given
        one node_id would otherwise take the id from each other)."""
        holder = await self._store.live(self.registration.id)
        if holder is None or holder.data == self.registration.data:
            return False  # free, or this node's own, left by a restart within the lease
        self.last_error = f"node id held by the daemon at {holder.data} (pid {holder.pid})"
        self._warn_once(
            holder,
            "%s: this node id is live at %s (pid %d, another daemon): not registering "
            "until that registration ends; give each daemon its own node_id",
        )
        return True

    def _warn_once(self, holder: Registration, message: str) -> None:
        """Log ``message`` (id, address, pid) once for each other daemon holding the id."""
        if self._waiting_for != holder:
            self._waiting_for = holder
            log.warning(message, self.registration.id, holder.data, holder.pid)

    async def _check_still_ours(self) -> None:
        """The live key must still be this daemon's: another daemon that registered the same
        id replaced it (and its lease took the key with it when it died). Publish it again
        under this lease once the id is free, with this daemon's address."""
        holder = await self._store.live(self.registration.id)
        if holder == self.registration:
            return
        if holder is not None and holder.data != self.registration.data:
            self._warn_once(
                holder,
                "%s: another daemon (%s, pid %d) registered this node id; this one is "
                "out of the map until it goes",
            )
            return
        log.warning("%s: its registration was gone or replaced; publishing it again",
                    self.registration.id)  # fmt: skip
        await self._register(self.lease_id)

    def _ids(self) -> tuple[str, int]:
        return self.registration.id, self.lease_id

    def stop(self, *, revoke: bool = True) -> None:
        """Stop renewing; revoke the lease unless ``revoke`` is False (then the node goes
        down when the lease runs out, as after a crash)."""
        if not revoke:
            self.lease_id = 0
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout=15)
