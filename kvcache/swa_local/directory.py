"""The directory of SWA holders, seen from a worker: register records, read them back.

Where records live: on the first ``replicas`` rendezvous holders of the block
key the state follows (the same placement that puts the block's shards), in
the storage daemons' RAM (``kvcache.server.swa_directory``). With the
default 3, one dead daemon (or two) loses none of them. Why there: a request
already sends that key to those nodes to match its prompt, so the lookup
rides on the match (``HAS_DIR`` instead of ``HAS``) and costs no round trip.

A record carries the holder's endpoint and *incarnation* (a random id per
worker start), the state's size and digest, and its remaining life. A dead
worker's records end in a refused connection; a restarted worker's in
NOT_FOUND (its incarnation differs); either way a clean miss.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from kvcache.client import Client, MatchResult
from kvcache.client.driver import Pump, PumpedExchange
from kvcache.errors import ProtocolError
from kvcache.keys import BlockKey, Namespace, block_keys
from kvcache.swa_local.protocol import HolderRecord, parse_answers, record_items
from kvcache.wire import Op, Status

__all__ = ["Directory", "Holders"]

log = logging.getLogger(__name__)

#: Holder records per block index of a match.
Holders = dict[int, list[HolderRecord]]


class Directory:
    """Publishes and looks up holder records through a kvcache client's cluster."""

    def __init__(self, client: Client, *, replicas: int = 3) -> None:
        self._client = client
        self._replicas = replicas
        self.counters: dict[str, int] = dict.fromkeys(
            ("published", "publish_failures", "lookups", "records_seen", "bad_answers"), 0
        )

    # ------------------------------------------------------------------ writes

    def publish(self, records: Sequence[HolderRecord], *, timeout_s: float | None = None) -> int:
        """Register ``records`` (``ttl_s`` 0 withdraws); how many reached at least one node."""
        if not records:
            return 0
        core = self._client.core
        rows = core.placement.holders([r.key.block for r in records])[:, : self._replicas]
        items = record_items(records)
        pump = Pump(core.transport, core.health, core.clock)
        accepted = np.zeros(len(records), bool)
        asked: dict[int, np.ndarray] = {}
        for ticket, node in enumerate(np.unique(rows), 1):
            which = np.nonzero((rows == node).any(axis=1))[0]
            asked[ticket] = which
            pump.submit(PumpedExchange(pump, ticket, int(node), Op.DIR_PUT, items[which]))
        deadline = core.clock() + (timeout_s if timeout_s is not None else core.config.timeout_s)
        while pump.outstanding and core.clock() < deadline:
            for event in pump.wait(deadline):
                if event.reply is None:
                    continue
                statuses = event.reply.items["status"]
                which = asked[event.ticket]
                if len(statuses) == len(which):
                    accepted[which[statuses == Status.OK]] = True
        pump.abandon(core.config.timeout_s)
        ok = int(accepted.sum())
        self.counters["published"] += ok
        self.counters["publish_failures"] += len(records) - ok
        return ok

    # ------------------------------------------------------------------ reads

    def lookup(self, namespace: Namespace, tokens: Sequence[int]) -> tuple[MatchResult, Holders]:
        """Match ``tokens``' blocks and read their holder records in the same round trip."""
        keys = block_keys(namespace, tokens)
        return self.lookup_keys(keys, tokens_per_block=namespace.tokens_per_block)

    def lookup_keys(
        self, keys: list[BlockKey], *, tokens_per_block: int = 1
    ) -> tuple[MatchResult, Holders]:
        """:meth:`lookup` for block keys computed by the caller."""
        match, answers = self._client.match_with_directory(keys, tokens_per_block=tokens_per_block)
        self.counters["lookups"] += 1
        holders: Holders = {}
        seen: set[tuple[int, bytes, int, str, int]] = set()
        for blocks, data in answers:
            try:
                parsed = parse_answers(data, keys, blocks)
            except ProtocolError as exc:
                self.counters["bad_answers"] += 1
                log.warning("a node sent a malformed SWA directory answer: %s", exc)
                continue
            for block, record in parsed:
                key = record.key
                ident = (block, key.namespace, key.position, record.endpoint, record.incarnation)
                if ident in seen:  # the same record from another replica (a worker's states
                    continue  # at two positions after one block are two records)
                seen.add(ident)
                holders.setdefault(block, []).append(record)
                self.counters["records_seen"] += 1
        for records in holders.values():
            records.sort(key=lambda r: -r.ttl_s)
        return match, holders
