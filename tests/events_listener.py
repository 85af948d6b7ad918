"""An independent subscriber to a daemon's event stream: plain pyzmq + msgspec, none of
kvcache's code. It decodes with structs shaped as vLLM 0.32's own (``KVEventBatch``,
field for field, no kvcache fields: what a router written for vLLM runs), reads kvcache's
extra fields from the untyped map, and follows vLLM's replay protocol (a 3-frame
request naming only the sequence). Each batch it handles becomes one JSON line of ``--out``
(flushed), so a test may kill it at any time and restart it with ``--start-seq``.

    python tests/events_listener.py --endpoint E --replay R --user U --password P --out F
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec
import zmq


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
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


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


END_SEQ = (-1).to_bytes(8, "big", signed=True)
RESYNC_SEQ = (-2).to_bytes(8, "big", signed=True)
typed = msgspec.msgpack.Decoder(KVEventBatch)
untyped = msgspec.msgpack.Decoder()


def line(seq: int, payload: bytes, replayed: bool) -> str:
    batch = typed.decode(payload)  # fails loudly if vLLM's decoder could not read it
    raw = untyped.decode(payload)
    events = []
    for event, extra in zip(batch.events, raw[1], strict=True):
        name = type(event).__name__
        keys = [h.hex() if isinstance(h, bytes) else h for h in getattr(event, "block_hashes", [])]
        events.append([name, getattr(event, "medium", None), extra.get("kvcache_cause"), keys,
                       extra.get("kvcache_shards")])  # fmt: skip
    return json.dumps({"seq": seq, "replayed": replayed, "events": events})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--replay", required=True)
    parser.add_argument("--user", required=True)
    parser.add_argument("--password", required=True)
    parser.add_argument("--topic", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--start-seq", type=int, default=None)
    args = parser.parse_args()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    dealer = ctx.socket(zmq.DEALER)
    for sock in (sub, dealer):
        sock.plain_username = args.user.encode()
        sock.plain_password = args.password.encode()
    sub.connect(args.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    dealer.connect(args.replay)
    out = open(args.out, "a")  # noqa: SIM115 - held for the life of the process
    expected = args.start_seq

    def write(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    def replay(start: int, upto: int | None) -> int:
        """Ask for ``start`` on (vLLM's 3-frame request); returns the next expected seq."""
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        nxt = start
        while True:
            if not dealer.poll(10_000):
                write(json.dumps({"resync": start, "reason": "replay timed out"}))
                sys.exit(3)
            _, _topic, seq_raw, payload = dealer.recv_multipart()
            if seq_raw == END_SEQ:
                return nxt
            if seq_raw == RESYNC_SEQ:
                write(json.dumps({"resync": start}))
                sys.exit(4)
            seq = int.from_bytes(seq_raw, "big")
            if seq < nxt or (upto is not None and seq >= upto):
                continue
            assert seq == nxt, (seq, nxt)
            write(line(seq, payload, True))
            nxt = seq + 1

    if expected is not None:
        expected = replay(expected, None)
    write(json.dumps({"ready": True}))
    while True:
        _topic, seq_raw, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_raw, "big")
        if expected is None:
            expected = seq
        if seq < expected:
            continue
        if seq > expected:
            expected = replay(expected, seq)
        write(line(seq, payload, False))
        expected = seq + 1


if __name__ == "__main__":
    sys.exit(main())
