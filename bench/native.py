"""kvcache.native against the Python data path it replaced, operation by operation.

Each row times, in one process and interleaved, the same work done the two ways, on the
reference shape (112 KiB blocks, 10 + 2, 64 blocks a call, 11 shards asked per block):
- hashing a call's payloads (one XXH3-128 per block) and shards (one XXH3-64 per shard);
- the header checks of a call's shard headers (XXH3-64 of 100 bytes each);
- where a GET reply of 64 shards lands (per-shard memoryviews vs one C call);
- receiving that reply's data section over a socketpair (``recvmsg_into`` over a list of
  views vs ``recv_scatter`` over segments);
- a PUT's data section for one node (per-shard views vs segments) and sending it;
- a daemon's checks of that PUT (64 shards: header rules, both checksums, the keys) as
  numpy columns (``records.check_put_numpy``) vs one ``kv_check_put`` call;
- a store batch's parity and hashes (XXH3-128 of each payload, XXH3-64 of each of its 12
  shards) as three native passes over the batch against ``encode_hashed``'s one pass that
  works block by block, for 64 and 1,024 blocks, each call after 256 MiB of other memory
  was written (the payloads are not in the CPU's caches, as after a device-to-host copy).

Usage: python bench/native.py [--quick] [--json PATH]
"""

from __future__ import annotations

import select
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import best_of, commit, machine, parser, print_table, write_json

from kvcache import native
from kvcache.client.assembly import LoadAssembly
from kvcache.credentials import tenant_id
from kvcache.erasure import get_codec
from kvcache.server.records import check_put, check_put_numpy
from kvcache.shard import HEADER_BYTES, HEADER_DTYPE, build_headers, header_checks, shard_len_for
from kvcache.wire import Op, make_items

P = 114_688
K, N = 10, 12
BLOCKS = 64
L = shard_len_for(P, K)
TENANT = tenant_id("default")


def _python_payload_hashes(rows: np.ndarray) -> list[bytes]:
    return [xxhash.xxh3_128_digest(rows[b].data) for b in range(len(rows))]


def _python_shard_hashes(rows: np.ndarray) -> list[int]:
    flat = rows.reshape(-1)
    return [
        xxhash.xxh3_64_intdigest(flat[b * P + i * L : b * P + (i + 1) * L].data)
        for b in range(len(rows))
        for i in range(K - 1)
    ]


def _python_header_checks(headers: np.ndarray) -> list[int]:
    raw = headers.view(np.uint8).reshape(len(headers), HEADER_BYTES)
    return [xxhash.xxh3_64_intdigest(raw[i, :100].data) & 0xFFFFFFFF for i in range(len(raw))]


def _python_landing_views(
    out: np.ndarray, headers: np.ndarray, blocks: np.ndarray, indices: np.ndarray
) -> list[memoryview]:
    """What the landing did before kvcache.native: views per shard (data shards only)."""
    flat, hdr = out.reshape(-1).data, headers.view(np.uint8).reshape(-1).data
    views: list[memoryview] = []
    for b, i in zip(blocks.tolist(), indices.tolist(), strict=True):
        at = (b * N + i) * HEADER_BYTES
        views.append(hdr[at : at + HEADER_BYTES])
        views.append(flat[b * P + i * L : b * P + i * L + L])
    return views


def _node_put(rows: np.ndarray) -> tuple[np.ndarray, memoryview]:
    """What one node of 12 receives of a store of ``rows``: a PUT of one shard a block."""
    keys = np.frombuffer(np.random.default_rng(3).bytes(16 * BLOCKS), "V16")
    stripes = np.arange(1, BLOCKS + 1, dtype=np.uint64)
    shards = rows.reshape(BLOCKS, -1)[:, :L].copy()  # the first data row of each block
    headers = build_headers(
        keys=keys,
        stripe_ids=stripes,
        k=K,
        m=N - K,
        payload_len=P,
        payload_hashes=np.zeros(BLOCKS, "V16"),
        shard_hashes=np.repeat(
            native.xxh3_64_many(
                native.addresses_of(shards) + np.arange(BLOCKS, dtype=np.uint64) * np.uint64(L), L
            )[:, None],
            N,
            axis=1,
        ),
        traffic_class="chat",
        created_ms=0,
        expiry_ms=0,
    )[:, 0]
    records = np.empty((BLOCKS, HEADER_BYTES + L), np.uint8)
    records[:, :HEADER_BYTES] = headers.view(np.uint8).reshape(BLOCKS, HEADER_BYTES)
    records[:, HEADER_BYTES:] = shards
    items = make_items(Op.PUT, BLOCKS, reply=False)
    items["key"] = keys
    items["index"] = 0
    items["length"] = HEADER_BYTES + L
    return items, memoryview(records.tobytes())


def _transfer(send: socket.socket, recv_one: object, nbytes: int, payload: bytes) -> None:
    sender = threading.Thread(target=send.sendall, args=(payload,))
    sender.start()
    recv_one()  # type: ignore[operator]
    sender.join()


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    repeat = 20 if args.quick else 100
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 256, (BLOCKS, P), dtype=np.uint8)
    headers = np.zeros(BLOCKS * N, HEADER_DTYPE)
    headers.view(np.uint8)[:] = rng.integers(0, 256, headers.nbytes, dtype=np.uint8)
    results: dict[str, float] = {}
    table: list[list[str]] = []

    def row(name: str, what: str, python_fn: object, native_fn: object) -> None:
        py = best_of(python_fn, repeat)  # type: ignore[arg-type]
        nat = best_of(native_fn, repeat)  # type: ignore[arg-type]
        results[f"{name}_python_us"] = py * 1e6
        results[f"{name}_native_us"] = nat * 1e6
        results[f"{name}_speedup"] = py / nat
        table.append([what, f"{py * 1e6:.0f}", f"{nat * 1e6:.0f}", f"{py / nat:.1f}x"])

    bases = native.addresses_of(rows) + np.arange(BLOCKS, dtype=np.uint64) * np.uint64(P)
    shard_addrs = (bases[:, None] + np.arange(K - 1, dtype=np.uint64) * np.uint64(L)).reshape(-1)
    assert [bytes(d) for d in native.xxh3_128_many(bases, P).tolist()] == (
        _python_payload_hashes(rows)
    )
    row(
        "payload_hashes",
        f"XXH3-128 of {BLOCKS} payloads of {P} B",
        lambda: _python_payload_hashes(rows),
        lambda: native.xxh3_128_many(bases, P),
    )
    row(
        "shard_hashes",
        f"XXH3-64 of {BLOCKS * (K - 1)} shard bodies of {L} B",
        lambda: _python_shard_hashes(rows),
        lambda: native.xxh3_64_many(shard_addrs, L),
    )
    assert header_checks(headers).tolist() == _python_header_checks(headers)
    row(
        "header_checks",
        f"header checks of {len(headers)} shard headers",
        lambda: _python_header_checks(headers),
        lambda: header_checks(headers),
    )

    put_items, put_data = _node_put(rows)
    fast = check_put(TENANT, put_items, put_data)
    assert fast.positions == list(range(BLOCKS)) and fast.keys == (
        check_put_numpy(TENANT, put_items, put_data).keys
    )
    row(
        "put_checks",
        f"a daemon's checks of a {BLOCKS}-shard PUT",
        lambda: check_put_numpy(TENANT, put_items, put_data),
        lambda: check_put(TENANT, put_items, put_data),
    )

    out = np.zeros((BLOCKS, P), np.uint8)
    asm = LoadAssembly(
        key_words=np.zeros(BLOCKS, "V16"),
        stripes=np.ones(BLOCKS, np.uint64),
        out=out,
        k=K,
        n=N,
        payload_len=P,
        codec=get_codec(),
    )
    blocks = np.arange(BLOCKS, dtype=np.int64)
    indices = np.full(BLOCKS, 3, np.int64)
    statuses = np.zeros(BLOCKS, np.uint8)
    lengths = np.full(BLOCKS, HEADER_BYTES + L, np.int64)
    live = np.ones(BLOCKS, bool)
    hdr_table = np.zeros((BLOCKS, N), HEADER_DTYPE)
    row(
        "landing",
        f"where a GET reply of {BLOCKS} shards lands",
        lambda: _python_landing_views(out, hdr_table, blocks, indices),
        lambda: asm._segments(blocks, indices, statuses, lengths, live),
    )

    # Receiving the reply's data section: the same bytes into the same places.
    payload = rng.integers(0, 256, BLOCKS * (HEADER_BYTES + L), dtype=np.uint8).tobytes()
    a, b = socket.socketpair()
    try:

        def recv_views() -> None:
            views = _python_landing_views(out, hdr_table, blocks, indices)
            index = 0
            while index < len(views):
                got = b.recvmsg_into(views[index : index + 1024])[0]
                while got:
                    head = views[index]
                    if got >= head.nbytes:
                        got -= head.nbytes
                        index += 1
                    else:
                        views[index] = head[got:]
                        got = 0

        def recv_segments() -> None:
            seg = asm._segments(blocks, indices, statuses, lengths, live)
            while not seg.done:
                try:
                    native.recv_scatter(b.fileno(), seg)
                except BlockingIOError:
                    select.select([b], [], [])  # wait for more data

        b.setblocking(True)
        py = best_of(lambda: _transfer(a, recv_views, len(payload), payload), repeat)
        b.setblocking(False)
        nat = best_of(lambda: _transfer(a, recv_segments, len(payload), payload), repeat)
    finally:
        a.close()
        b.close()
    results.update(
        receive_python_us=py * 1e6, receive_native_us=nat * 1e6, receive_speedup=py / nat
    )
    table.append(
        [
            f"receive that reply ({len(payload) / 1e6:.2f} MB) over a socketpair",
            f"{py * 1e6:.0f}",
            f"{nat * 1e6:.0f}",
            f"{py / nat:.2f}x",
        ]
    )

    print_table(
        f"kvcache.native vs the Python path, µs per call (best of {repeat}; "
        f"hash kernel {native.HASH_KERNEL}; {machine()}; {commit()})",
        ["operation", "Python", "native", "speed-up"],
        table,
    )
    results["hash_kernel_avx512"] = float(native.HASH_KERNEL == "avx512")
    encode_rows = encode_and_hash(repeat, results)
    if encode_rows:
        print_table(
            "A store batch's parity and hashes, µs per call (median; caches flushed before "
            "each call): three passes over the batch vs one block by block",
            ["blocks", "three passes", "block by block", "speed-up"],
            encode_rows,
        )
    write_json(args.json, results)


def encode_and_hash(repeat: int, results: dict[str, float]) -> list[list[str]]:
    """The store's parity and hashes two ways, cold (see the module docstring); [] without
    ISA-L."""
    codec = get_codec()
    job = codec.encode_job()
    if job is None:
        return []
    flush = np.zeros(256 << 20, np.uint8)
    table: list[list[str]] = []
    for blocks in (BLOCKS, 1024):
        payloads = np.random.default_rng(blocks).integers(0, 256, (blocks, P), dtype=np.uint8)
        parity = np.zeros((blocks, N - K, L), np.uint8)
        # The client's encoding: data rows in the payloads (the last one copied and padded).
        tail = np.zeros((blocks, L), np.uint8)
        tail[:, : P - (K - 1) * L] = payloads[:, (K - 1) * L :]
        bases = native.addresses_of(payloads) + np.arange(blocks, dtype=np.uint64) * np.uint64(P)
        rows = np.empty((blocks, N), np.uint64)
        rows[:, : K - 1] = bases[:, None] + np.arange(K - 1, dtype=np.uint64) * np.uint64(L)
        rows[:, K - 1] = native.addresses_of(tail) + np.arange(blocks, dtype=np.uint64) * L
        rows[:, K:] = native.addresses_of(parity) + (
            np.arange(blocks, dtype=np.uint64)[:, None] * (N - K) + np.arange(N - K)
        ).astype(np.uint64) * np.uint64(L)

        def passes(rows: np.ndarray = rows, bases: np.ndarray = bases) -> tuple[Any, Any]:
            digests = native.xxh3_128_many(bases, P)
            codec.encode_rows(rows, L)
            return digests, native.xxh3_64_many(rows, L)

        def fused(rows: np.ndarray = rows, bases: np.ndarray = bases) -> tuple[Any, Any]:
            return native.encode_hashed(job, K, rows, L, bases, P)

        a, b = passes(), fused()
        assert a[0].tobytes() == b[0].tobytes() and np.array_equal(a[1], b[1])
        times: dict[str, list[float]] = {"passes": [], "fused": []}
        for _ in range(max(5, repeat // 10)):
            for name, fn in (("passes", passes), ("fused", fused)):
                flush += 1  # the payloads leave the caches
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        py, nat = (float(np.median(times[x])) for x in ("passes", "fused"))
        results[f"encode_hash_{blocks}_passes_us"] = py * 1e6
        results[f"encode_hash_{blocks}_fused_us"] = nat * 1e6
        results[f"encode_hash_{blocks}_speedup"] = py / nat
        table.append([str(blocks), f"{py * 1e6:.0f}", f"{nat * 1e6:.0f}", f"{py / nat:.2f}x"])
    return table


if __name__ == "__main__":
    if not native.AVAILABLE:
        sys.exit("the native helpers are not built: bash scripts/build-native.sh")
    main()
