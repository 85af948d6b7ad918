"""The event path's cost on the daemon's serving thread, in process: PUT batches through the
real RequestHandler and ShardStore (LMDB in a temp dir), events off and on, interleaved.

With events on, the handler queues one entry per PUT reply and the publisher thread encodes
and sends it on an XPUB socket to a subscriber thread reading every message, all in this
process, so the publisher's share of the GIL counts too. Each PUT stores ``--shards``
shards of one 112 KiB block's shard size (11,520 B of body); the store's capacity is large
enough that nothing is evicted; every round deletes what it stored (removal events too).
Prints the serving thread's time per PUT, off and on, best and median of the rounds, and
on / off (the target: <= 1.05).

Usage: python bench/events_handler.py [--quick] [--json PATH] [--rounds N] [--puts N]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _common import commit, machine, parser, print_table, write_json
from server_fixtures import block_records, put_items

from kvcache.credentials import tenant_id
from kvcache.events.publisher import EventPublisher, PublisherSettings
from kvcache.server.handler import Request, RequestHandler
from kvcache.server.metrics import Metrics
from kvcache.server.store import ShardStore
from kvcache.wire import Header, Op, decode, encode, join, make_items

TENANT = tenant_id("default")


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=0, help="rounds per side (default 20)")
    p.add_argument("--puts", type=int, default=0, help="PUT requests per round (default 50)")
    p.add_argument("--shards", type=int, default=64, help="shards per PUT (default 64)")
    args = p.parse_args()
    rounds = args.rounds or (6 if args.quick else 20)
    puts = args.puts or (20 if args.quick else 50)
    with tempfile.TemporaryDirectory() as tmp:
        store = ShardStore(Path(tmp) / "data", capacity_bytes=8 << 30)
        handler = RequestHandler(store, Metrics(), node_id="bench")
        publisher = EventPublisher(
            PublisherSettings(listen="tcp://127.0.0.1:0", auth=False),
            tenants={TENANT: ("default", b"")},
        )
        received = [0]
        stop = threading.Event()

        def subscribe() -> None:
            ctx = zmq.Context()
            sub = ctx.socket(zmq.SUB)
            sub.connect(publisher.endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            while not stop.is_set():
                if sub.poll(100):
                    sub.recv_multipart()
                    received[0] += 1
            sub.close(0)
            ctx.term()

        reader = threading.Thread(target=subscribe, daemon=True)
        reader.start()
        time.sleep(0.5)
        n = 0
        per_put: dict[str, list[float]] = {"off": [], "on": []}
        try:
            for r in range(rounds + 1):
                for side in ("off", "on") if r % 2 else ("on", "off"):
                    handler.events = publisher if side == "on" else None
                    requests, deletes = [], []
                    for _ in range(puts):
                        keys = [(n * 1000 + i).to_bytes(16, "big") for i in range(args.shards)]
                        n += 1
                        shards = [s for k in keys for s in block_records(k, indices=[0],
                                                                           body_len=11520)]  # fmt: skip
                        items, data = put_items(shards)
                        requests.append(request(Op.PUT, items, data))
                        gone = make_items(Op.DELETE, len(keys), reply=False)
                        gone["key"] = keys
                        deletes.append(request(Op.DELETE, gone, b""))
                    start = time.perf_counter()
                    for req in requests:
                        handler.handle_puts([req])
                    elapsed = time.perf_counter() - start
                    for req in deletes:
                        handler.handle(req)
                    if r:
                        per_put[side].append(elapsed / puts)
            publisher.flush()
        finally:
            stop.set()
            reader.join(5)
            publisher.close()
            store.close()
    best = {s: min(v) * 1e6 for s, v in per_put.items()}
    med = {s: statistics.median(v) * 1e6 for s, v in per_put.items()}
    figures = {
        "put_us_events_off_best": round(best["off"], 1),
        "put_us_events_on_best": round(best["on"], 1),
        "put_us_events_off_median": round(med["off"], 1),
        "put_us_events_on_median": round(med["on"], 1),
        "put_time_ratio_best": round(best["on"] / best["off"], 3),
        "put_time_ratio_median": round(med["on"] / med["off"], 3),
        "events_published": publisher.counters["events"],
        "events_dropped": publisher.counters["dropped"],
        "shards_per_put": args.shards,
        "puts_per_round": puts,
        "rounds": rounds,
        "commit": commit(),
        "machine": machine(),
    }
    print_table(f"serving-thread time per PUT of {args.shards} shards, events off / on",
                ["figure", "value"], [[k, str(v)] for k, v in figures.items()])  # fmt: skip
    write_json(args.json, figures)
    return 0


def request(op: Op, items: np.ndarray, data: bytes | memoryview) -> Request:
    raw = join(encode(Header(op=op, request_id=1, count=len(items), data_len=len(data)), items,
                      data))  # fmt: skip
    return Request(TENANT, decode(raw), time.perf_counter(), len(raw))


if __name__ == "__main__":
    sys.exit(main())
