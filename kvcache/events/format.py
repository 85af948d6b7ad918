"""The event stream's wire format: vLLM's KV events (msgspec), topics, sequence framing.

A storage daemon's events are vLLM's own (``vllm/distributed/kv_events.py``, vLLM 0.32):
an :class:`EventBatch` (msgpack, ``array_like``: ``[ts, events, data_parallel_rank]``)
whose events are tagged maps (``{"type": "BlockStored", ...}``), so any subscriber
written for vLLM's publisher decodes them with vLLM's own ``KVEventBatch``. What only
kvcache knows rides in extra fields named ``kvcache_*``: msgspec ignores unknown map
fields when it decodes a struct (an unknown *tag* would fail the whole batch, which is
why kvcache adds no event types of its own). ``docs/spec/events.md`` is the normative
description; this module is its reference implementation, with no I/O.

Framing, as vLLM's ``ZmqEventPublisher``: on the PUB socket a message is
``[topic, seq (8 bytes, big-endian), payload]``; each tenant's topic
(:func:`topic_of`) has a sequence of its own, from 0, one per batch. Replay (ROUTER)
answers ``[topic, seq, payload]`` for each kept batch from the asked sequence on and
ends with ``[b"", END_SEQ, b""]``, or with ``[topic, RESYNC_SEQ, b""]`` when the asked
sequence is no longer kept: the subscriber cannot catch up and must resync.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "CAUSES",
    "END_SEQ",
    "MEDIUM_STORAGE",
    "MEDIUM_SWA",
    "RESYNC_SEQ",
    "TOPIC_PREFIX",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "decode_batch",
    "encode_batch",
    "pack_seq",
    "tenant_of_topic",
    "topic_of",
    "unpack_seq",
]

#: Where the blocks are: vLLM's ``MEDIUM_STORAGE``. Store events carry it.
MEDIUM_STORAGE = "STORAGE"
#: SWA holder records (a worker's RAM holds a sequence's window state; docs/spec/swa.md).
MEDIUM_SWA = "SWA"
#: Why a daemon removed shards (``kvcache_cause`` of BlockRemoved), as the removal counters
#: (kvcache.server.removals) name them; ``withdrawn`` is an SWA record its worker took back.
CAUSES = ("expired", "evicted", "quota", "deleted", "withdrawn")
#: Every topic starts with this; then the tenant name and a ``/``.
TOPIC_PREFIX = b"kvcache/"
#: Replay's end marker (vLLM's ``ZmqEventPublisher.END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Replay's "cannot catch up" marker: the asked sequence is older than what is kept.
RESYNC_SEQ = (-2).to_bytes(8, "big", signed=True)


class KVEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: tagged maps, the tag being the class name (vLLM's KVCacheEvent)."""


class BlockStored(KVEvent):
    """Shards of these blocks were stored (medium STORAGE), or holder records registered
    (medium SWA). vLLM's fields first, in vLLM's order; kvcache's after them."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    #: Shard index of each entry of ``block_hashes`` (a node may hold several of a block).
    kvcache_shards: list[int] | None = None
    #: The traffic class the shards were stored under (one per event).
    kvcache_class: str | None = None
    #: SWA: the holder's endpoint (``tcp://host:port``) and the record's TTL (ms), per entry.
    kvcache_holders: list[str] | None = None
    kvcache_ttl_ms: list[int] | None = None
    #: SWA: the token position each state was taken at.
    kvcache_positions: list[int] | None = None


class BlockRemoved(KVEvent):
    """Shards of these blocks were removed (or SWA holder records dropped)."""

    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None
    #: One of :data:`CAUSES`.
    kvcache_cause: str | None = None
    kvcache_shards: list[int] | None = None
    kvcache_class: str | None = None
    kvcache_holders: list[str] | None = None


class AllBlocksCleared(KVEvent):
    """Everything this stream said before is void (vLLM's; kvcache does not send it today)."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message's payload: vLLM's KVEventBatch."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    """msgpack bytes of ``batch``."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes | memoryview) -> EventBatch:
    """Decode a payload; raises :class:`kvcache.errors.FormatError` on malformed bytes."""
    from kvcache.errors import FormatError

    try:
        return _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FormatError(f"not a KV event batch: {exc}") from None


def topic_of(tenant: str) -> bytes:
    """A tenant's topic: ``kvcache/<tenant>/`` (the slash ends it, so no tenant's topic is a
    prefix of another's: tenant names have no slash)."""
    return TOPIC_PREFIX + tenant.encode() + b"/"


def tenant_of_topic(topic: bytes) -> str | None:
    """The tenant a topic belongs to, or None if it is not a kvcache topic."""
    if not topic.startswith(TOPIC_PREFIX) or not topic.endswith(b"/"):
        return None
    name = topic[len(TOPIC_PREFIX) : -1]
    if not name or b"/" in name:
        return None
    try:
        return name.decode()
    except UnicodeDecodeError:
        return None


def pack_seq(seq: int) -> bytes:
    """8 bytes, big-endian, signed (the markers are negative)."""
    return seq.to_bytes(8, "big", signed=True)


def unpack_seq(raw: bytes) -> int:
    """The sequence number of an 8-byte frame; raises FormatError on another length."""
    if len(raw) != 8:
        from kvcache.errors import FormatError

        raise FormatError(f"a sequence frame is 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big", signed=True)
