"""CPU time of one ShardStore, in process: HAS of 7,813 keys, PUT and GET batches, a sweep.

What ``bench/scale.py`` times over the wire, without the socket loop and counted in CPU
seconds of this process (``time.process_time``), so that two store formats can be
compared on a machine shared with other work, where wall-clock rates swing by several
times between runs (issue 21). The store is filled as ``bench/scale.py`` fills it
(``scale.fill``: one small shard per block key, 10 % class ``agent``); then:

* HAS of 7,813 distinct filled keys (a 1M-token prompt's blocks), median of 9;
* 40 PUT batches of 120 shards of 11,624-byte records (10 blocks of 112 KiB at 10 + 2),
  then a GET of each batch;
* the clock moved 3 days + 1 h on, and the sweep run to the end (the expired tenth).

    PYTHONPATH=. python bench/store_cpu.py 1e6 >> out.jsonl

Prints one JSON object.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale

from kvcache.credentials import tenant_id
from kvcache.server.config import SyncMode
from kvcache.server.store import PutBatch, ShardStore
from kvcache.wire import Op, make_items


def main() -> int:
    shards = int(float(sys.argv[1])) if len(sys.argv) > 1 else 10**6
    cpu = time.process_time
    out: dict[str, object] = {"commit": scale.commit(), "shards": shards}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "data"
        c0 = cpu()
        _fill_s, sample = scale.fill(path, shards, seed=7)
        out["fill_cpu_s"] = cpu() - c0
        out.update({k: v for k, v in scale.index_bytes(path).items() if k.endswith("per_shard")})
        now = [time.time()]
        with ShardStore(
            path,
            capacity_bytes=1 << 40,
            map_size_bytes=scale.MAP_SIZE,
            sync=SyncMode.PERIODIC,
            clock=lambda: now[0],
        ) as store:
            tenant = tenant_id(scale.TENANT)
            keys = sample[:7813]
            items = make_items(Op.HAS, len(keys), reply=False)
            items["key"] = keys
            lat = []
            for _ in range(9):
                c0 = cpu()
                reply = store.has(tenant, items)
                lat.append(cpu() - c0)
            if len(reply) != len(keys):
                raise RuntimeError(f"HAS found {len(reply)} of {len(keys)} shards")
            out["has_7813_cpu_ms"] = float(np.median(lat) * 1e3)
            out["has_cpu_us_per_key"] = float(np.median(lat) / len(keys) * 1e6)
            rng = np.random.default_rng(3)
            body = rng.integers(0, 256, scale.BODY, dtype=np.uint8).tobytes()
            puts = [scale.records(scale.new_keys(rng, 10), body, "chat", rng) for _ in range(40)]
            c0 = cpu()
            for put, data in puts:
                done = store.put_many([PutBatch(tenant, put, memoryview(data))])[0]
                if isinstance(done, Exception) or done["status"].any():
                    raise RuntimeError("PUT refused")
            out["put_cpu_us_per_shard"] = (cpu() - c0) / (40 * 120) * 1e6
            c0 = cpu()
            for put, _ in puts:
                got = store.get(tenant, scale.get_items(put))
                missed = bool(got.items["status"].any())
                got.release()
                if missed:
                    raise RuntimeError("GET missed")
            out["get_cpu_us_per_shard"] = (cpu() - c0) / (40 * 120) * 1e6
            now[0] += 3 * scale.DAY_S + 3600
            c0, w0, swept = cpu(), time.perf_counter(), 0
            while True:
                step = store.sweep(limit=512)
                swept += step
                if step < 512:
                    break
            out["swept"] = swept
            out["sweep_cpu_us_per_shard"] = (cpu() - c0) / max(1, swept) * 1e6
            out["sweep_wall_shards_per_s"] = swept / (time.perf_counter() - w0)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
