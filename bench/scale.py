"""How cost grows: one daemon holding 10^5 .. 10^7 shards, a 1M-token prompt, 48 daemons.

Three parts (issue 21, items 1-3), each on real processes over loopback:

``daemon``: one ``kvcache server`` process whose data directory is first filled
to N shards (10^5, 10^6; 10^7 in the full run) *directly*, through
:class:`kvcache.server.store.ShardStore` in this process (the daemon's own
code and LMDB layout, group-committed ``put_many`` batches of 8,192 shards),
with small shards: 64-byte bodies plus the 104-byte header, 168 bytes a
record, 10 % of them in class ``agent`` (3 days), the rest ``chat`` (7 days).
The daemon is then started on that directory and timed with shards of a real
112 KiB block (114,688 bytes at 10 + 2: 11,520-byte bodies, 11,624-byte
records, :func:`kvcache.shard.shard_len_for`), over the wire protocol
(:class:`kvcache.server.probe.Probe`, one connection, request/reply):

* ``put``/``get``: batches of 120 shards (10 blocks), shards/s and p99 per request;
  every fill is made and its daemon started first, and then the timed requests go
  to the fills' daemons in turn, ten requests to each, so that the host's stalls
  fall on every fill alike and the ratios between fills are the
  store's (one fill after another, the p99 of 200 requests moved 2-3x from run
  to run at every fill on the 2-core VM);
* ``has``: HAS of 64 filled keys, p99;
* ``sweep``: the daemon's clock moved 3 days + 1 h on (``POST /debug/clock``),
  so the ``agent`` tenth expires; shards swept per second, from ``/stats``;
* ``evict``: the daemon restarted with its capacity set to what it holds, so it
  drains from 100 % down to the low watermark (80 %); shards evicted per second;
* ``restart_s``: process start to the first answer (ready file, ``/healthz``,
  a STATS reply), on the filled directory (page cache warm: this machine has
  no way to drop it);
* ``rss_mib``: the daemon's RSS after the timed requests;
* ``--warm-host-gb G``: right before each fill's timed requests, G GiB of this
  host's memory touched and freed (``_common.warm_host``), so that the daemon's
  page cache reuses backed pages; ``host_touch_s_per_gib`` says what a first
  touch cost then. Why: on the 2-core VM a fill of 10^7 shards leaves the guest's
  free memory handed back to its host, and a fresh page's first touch then cost
  10-20x a copy; at 10^7 the PUT's copy into the page cache
  (``copy_folio_from_iter_atomic``) was 3.4 ms of a 4.8 ms PUT under ``perf``,
  against 0.06 ms at 10^5: the VM's memory, not the store;
* ``index_bytes_per_shard``: everything on disk but the records themselves,
  per shard (store format v6): the pages of the two LMDB databases
  (``index``: one row per shard, its location and retention; ``expiry``) times
  the page size, plus the segment files' bytes beyond the records (batch heads
  and a 32-byte entry per record). ``lmdb_index_bytes_per_shard`` and
  ``segment_overhead_per_shard`` are the two parts, ``index_db_per_shard`` and
  ``expiry_db_per_shard`` the two databases.

``long``: a 1M-token prompt (7,813 blocks of 128 tokens at 896 bytes a token:
114,688-byte blocks) stored on a 12-daemon :class:`LocalCluster`, then
``match_prefix`` timed and the whole prefix loaded by a fresh process whose
destination is a shared-memory file mapping (``/dev/shm``) standing in for the
engine's pages (the client does not own them): the figure is that process's
peak *anonymous* RSS, sampled every 5 ms, against the configured client buffer
(``chunk_bytes`` x ``window``). 1,000,000 tokens make 7,812 full blocks (the
tail of 64 tokens is recomputed, never cached).

``nodes``: 12 and then 48 daemons on loopback, the same 64-block prompts stored
and loaded: client CPU seconds per block (``time.process_time``), p99 of a
64-block load, the client's threads, sockets and RSS.

    python bench/scale.py --quick --json bench/results/scale.json
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import commit, machine, parser, print_table, warm_host_cost, write_json
from server_fixtures import DaemonProcess, http

from kvcache.credentials import tenant_id
from kvcache.layout import DType, KVLayout
from kvcache.server.config import SyncMode
from kvcache.server.probe import Probe
from kvcache.server.store import PutBatch, ShardStore
from kvcache.shard import HEADER_BYTES, build_headers, shard_hash, shard_len_for
from kvcache.wire import Op, Status, make_items

BLOCK = 114_688
BODY = shard_len_for(BLOCK, 10)  # 11,520
RECORD = BODY + HEADER_BYTES
FILL_BODY = 64
FILL_RECORD = FILL_BODY + HEADER_BYTES
FILL_BATCH = 8192
MAP_SIZE = 64 << 30
DAY_S = 86_400
TENANT = "default"

Items = npt.NDArray[np.void]
#: The long-prompt layout of the issue: 128 tokens of 896 bytes, 114,688-byte blocks.
LONG_LAYOUT = KVLayout(
    tokens_per_block=128, bytes_per_token=896, dtype=DType.BFLOAT16, layers_in_block=1
)


# ---------------------------------------------------------------------- records


def records(
    keys: npt.NDArray[np.void],
    body: bytes,
    traffic_class: str,
    rng: np.random.Generator,
    *,
    one_per_key: bool = False,
) -> tuple[Items, bytes]:
    """PUT items and data for all 12 shards of each 16-byte key, one stripe per key; with
    ``one_per_key`` only shard ``i mod 12`` of the i-th key (what one node of 12 holds)."""
    blocks = len(keys)
    stripes = rng.integers(1, 2**63, blocks, dtype=np.uint64)
    heads = build_headers(
        keys=keys,
        stripe_ids=stripes,
        k=10,
        m=2,
        payload_len=10 * len(body),
        payload_hashes=np.zeros(blocks, "V16"),
        shard_hashes=np.full((blocks, 12), shard_hash(body), np.uint64),
        traffic_class=traffic_class,
        created_ms=0,
        expiry_ms=0,
    ).reshape(-1)
    rows = np.empty((blocks * 12, HEADER_BYTES + len(body)), np.uint8)
    rows[:, :HEADER_BYTES] = heads.view(np.uint8).reshape(-1, HEADER_BYTES)
    rows[:, HEADER_BYTES:] = np.frombuffer(body, np.uint8)
    items = make_items(Op.PUT, blocks * 12, reply=False)
    items["key"] = np.repeat(keys, 12)
    items["index"] = np.tile(np.arange(12), blocks)
    items["length"] = rows.shape[1]
    if one_per_key:
        pick = np.arange(blocks) * 12 + np.arange(blocks) % 12
        return items[pick], rows[pick].tobytes()
    return items, rows.tobytes()


def new_keys(rng: np.random.Generator, count: int) -> npt.NDArray[np.void]:
    return np.frombuffer(rng.bytes(16 * count), "V16").copy()


def fill(path: Path, shards: int, seed: int) -> tuple[float, npt.NDArray[np.void]]:
    """Fill a fresh data directory with ``shards`` small shards; (seconds, sample of keys)."""
    rng = np.random.default_rng(seed)
    body = bytes(FILL_BODY)
    tenant = tenant_id(TENANT)
    sample = []
    started = time.perf_counter()
    with ShardStore(
        path, capacity_bytes=1 << 40, map_size_bytes=MAP_SIZE, sync=SyncMode.NONE
    ) as store:
        done = 0
        while done < shards:
            blocks = min(FILL_BATCH, shards - done)
            keys = new_keys(rng, blocks)
            sample.append(keys[: max(1, blocks // 64)])
            cls = "agent" if done < shards // 10 else "chat"
            items, data = records(keys, body, cls, rng, one_per_key=True)
            reply = store.put_many([PutBatch(tenant, items, memoryview(data))])[0]
            if isinstance(reply, Exception) or reply["status"].any():
                raise RuntimeError(f"fill failed at {done} shards: {reply}")
            done += len(items)
    return time.perf_counter() - started, np.concatenate(sample)


def index_bytes(path: Path, record_bytes: int = FILL_RECORD) -> dict[str, float]:
    """Bytes on disk per shard of the index (store format v6: the ``index`` database, one row
    per shard with its location and retention, and the ``expiry`` database) plus the segment
    files' own overhead (batch heads and per-record entries: the files' bytes less the
    records')."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=4)
    try:
        out: dict[str, float] = {}
        with env.begin() as txn:
            stats = {name: txn.stat(env.open_db(name, txn=txn, create=False)) for name in
                     (b"index", b"expiry")}  # fmt: skip
        psize = stats[b"index"]["psize"]
        count = max(1, stats[b"index"]["entries"])

        def pages(s: dict[str, int]) -> int:
            return s["branch_pages"] + s["leaf_pages"] + s["overflow_pages"]

        lmdb_bytes = (pages(stats[b"index"]) + pages(stats[b"expiry"])) * psize
        files = sum(p.stat().st_size for p in (path / "segments").glob("*.seg"))
        segment_overhead = max(0, files - count * record_bytes)
        out["index_bytes_per_shard"] = (lmdb_bytes + segment_overhead) / count
        out["lmdb_index_bytes_per_shard"] = lmdb_bytes / count
        out["segment_overhead_per_shard"] = segment_overhead / count
        out["index_db_per_shard"] = pages(stats[b"index"]) * psize / count
        out["expiry_db_per_shard"] = pages(stats[b"expiry"]) * psize / count
        out["entries"] = count
        return out
    finally:
        env.close()


# ---------------------------------------------------------------------- daemon part


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def major_faults(pid: int) -> int:
    """Page faults of process ``pid`` so far that had to read from the disk (majflt): an
    index page the kernel had dropped from the page cache, read back on the request."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[9])


def start_daemon(root: Path, capacity: int) -> tuple[DaemonProcess, Probe, float]:
    """Start a daemon on ``root/data``; (daemon, probe, seconds to its first answer)."""
    daemon = DaemonProcess(
        root,
        server={
            "node_id": "scale",
            "capacity_bytes": capacity,
            "map_size_bytes": MAP_SIZE,
            "sync": "periodic",
            "allow_clock_override": True,
        },
    )
    started = time.perf_counter()
    daemon.start()
    entry = daemon.credentials.tenant(TENANT)
    assert entry is not None
    probe = Probe(daemon.data, tenant=TENANT, secret=entry.secret, timeout_s=120)
    probe.stats()
    return daemon, probe, time.perf_counter() - started


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def p99_ms(lat: list[float]) -> float:
    return float(np.percentile(lat, 99) * 1000)


def wait_counter(
    daemon: DaemonProcess, name: str, want: int, timeout_s: float
) -> tuple[int, float]:
    """Poll /stats until counter ``name`` reaches ``want`` or stops growing; (value, seconds)."""
    started = time.perf_counter()
    last, last_change = -1, started
    while True:
        value = int(daemon.stats()["gc"][name])
        now = time.perf_counter()
        if value != last:
            last, last_change = value, now
        if value >= want or now - last_change > 3.0 or now - started > timeout_s:
            return value, last_change - started
        time.sleep(0.05)


@dataclasses.dataclass
class FilledNode:
    """One fill's daemon, its timed requests and its figures (see :func:`daemon_part`)."""

    shards: int
    root: Path
    sample: npt.NDArray[np.void]
    daemon: DaemonProcess
    probe: Probe
    puts: list[tuple[Items, bytes]]
    out: dict[str, Any]
    lat: dict[str, list[float]] = dataclasses.field(
        default_factory=lambda: {"put": [], "get": [], "has": []}
    )
    #: The daemon's major page faults during each kind of timed request.
    majflt: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"put": 0, "get": 0, "has": 0}
    )

    @property
    def tag(self) -> str:
        return fill_tag(self.shards)


def fill_tag(shards: int) -> str:
    """A fill's suffix in the figures' names: 1e5, 1e6, 1e7."""
    return f"{shards:.0e}".replace("+0", "").replace("+", "")


def fill_node(root: Path, shards: int, batches: int) -> FilledNode:
    """Fill ``root/data`` to ``shards`` and start its daemon (restart time, index bytes)."""
    tag = fill_tag(shards)
    out: dict[str, Any] = {}
    data = root / "data"
    fill_s, sample = fill(data, shards, seed=shards)
    out[f"fill_s_{tag}"] = fill_s
    out.update({f"{k}_{tag}": v for k, v in index_bytes(data).items()})
    daemon, probe, restart_s = start_daemon(root, capacity=1 << 40)
    out[f"restart_s_{tag}"] = restart_s
    rng = np.random.default_rng(1)
    body = rng.integers(0, 256, BODY, dtype=np.uint8).tobytes()
    puts = [records(new_keys(rng, 10), body, "chat", rng) for _ in range(batches)]
    return FilledNode(shards, root, sample, daemon, probe, puts, out)


def timed_requests(nodes: list[FilledNode], batches: int, chunks: int) -> None:
    """PUTs, then GETs, then HAS of 64 keys, ``batches`` each (4x for HAS) a node, sent to
    the nodes in turn, a chunk to each, ``chunks`` rounds: a hiccup of the host then falls
    on every fill alike, and the ratios between fills are of the store (this VM's host
    stalls for milliseconds at a time; one phase after another, the p99 of 200 requests
    said more about when each phase ran than about its fill)."""
    per = -(-batches // chunks)
    for node in nodes:
        node.lat = {"put": [], "get": [], "has": []}
        node.majflt = {"put": 0, "get": 0, "has": 0}
    order = np.random.default_rng(2).permutation(batches).tolist()
    for op, total in (("put", batches), ("get", batches), ("has", 4 * batches)):
        for _ in range(chunks):
            for node in nodes:
                probe = node.probe
                assert node.daemon.proc is not None
                faults = major_faults(node.daemon.proc.pid)
                for _ in range(min(per * (4 if op == "has" else 1), total - len(node.lat[op]))):
                    j = len(node.lat[op])  # this node's requests of this kind so far
                    t0 = time.perf_counter()
                    if op == "put":
                        items, payload = node.puts[j]
                        reply = probe.request(Op.PUT, items, payload)
                        if reply.header.status != Status.OK or reply.items["status"].any():
                            raise RuntimeError(f"PUT refused: {reply.error_text()}")
                    elif op == "get":
                        items = node.puts[order[j]][0]
                        reply = probe.request(Op.GET, get_items(items))
                        if reply.header.status != Status.OK or reply.items["status"].any():
                            raise RuntimeError("GET missed")
                    else:
                        wanted = node.sample[(np.arange(64) * 7919 + j * 64) % len(node.sample)]
                        found = probe.has([bytes(k) for k in wanted])
                        if sum(map(len, found.values())) != 64:
                            raise RuntimeError(f"HAS found {len(found)} of 64 keys")
                    node.lat[op].append(time.perf_counter() - t0)
                node.majflt[op] += major_faults(node.daemon.proc.pid) - faults


def node_figures(node: FilledNode) -> None:
    """The timed requests' figures, the RSS, then the sweep; stops the daemon."""
    tag, out, daemon, lat = node.tag, node.out, node.daemon, node.lat
    shard_batch = 120
    out[f"put_shards_per_s_{tag}"] = shard_batch * len(lat["put"]) / sum(lat["put"])
    out[f"put_p99_ms_{tag}"] = p99_ms(lat["put"])
    out[f"get_shards_per_s_{tag}"] = shard_batch * len(lat["get"]) / sum(lat["get"])
    out[f"get_p99_ms_{tag}"] = p99_ms(lat["get"])
    out[f"has64_p99_ms_{tag}"] = p99_ms(lat["has"])
    out[f"has64_median_ms_{tag}"] = float(np.median(lat["has"]) * 1000)
    out[f"get_median_ms_{tag}"] = float(np.median(lat["get"]) * 1000)
    out[f"put_median_ms_{tag}"] = float(np.median(lat["put"]) * 1000)
    for op in ("put", "get", "has"):
        out[f"{op}_majflt_per_request_{tag}"] = node.majflt[op] / max(1, len(lat[op]))
    assert daemon.proc is not None
    out[f"rss_mib_{tag}"] = rss_mib(daemon.proc.pid)
    try:
        # Sweep: the agent tenth expires once the clock is 3 days + 1 h on.
        expire = node.shards // 10
        status, text = http(
            "POST",
            daemon.admin + "/debug/clock",
            {"offset_s": 3 * DAY_S + 3600},
            token=daemon.admin_token,
        )
        if status != 200:
            raise RuntimeError(f"/debug/clock: {status} {text!r}")
        swept, took = wait_counter(daemon, "expired_shards", expire, timeout_s=600)
        out[f"swept_{tag}"] = swept
        out[f"sweep_shards_per_s_{tag}"] = swept / max(took, 1e-9)
        used = int(daemon.stats()["usage"]["used_bytes"])
    finally:
        node.probe.close()
        daemon.stop(120)
    # Eviction: restart with the capacity set to what it holds: it drains to 80 %.
    daemon, probe, again_s = start_daemon(node.root, capacity=max(used, 1 << 20))
    try:
        left = int(daemon.stats()["usage"]["shards"])
        evicted, took = wait_counter(daemon, "evicted_shards", left // 5, timeout_s=600)
        out[f"evicted_{tag}"] = evicted
        out[f"evict_shards_per_s_{tag}"] = evicted / max(took, 1e-9)
        out[f"restart_full_s_{tag}"] = again_s
    finally:
        probe.close()
        daemon.stop(120)


def daemon_part(
    root: Path, fills: list[int], batches: int, warm_gib: float = 0.0, chunks: int = 0
) -> dict[str, Any]:
    """Every fill's figures. The fills are made and their daemons started one after
    another; the timed requests then go to all of them in turn (:func:`timed_requests`),
    after ``warm_gib`` GiB of host memory were touched, ``batches / chunks`` requests to
    each in turn (``chunks`` 0: ten at a time); then each is swept, restarted full and
    drained, one after another."""
    started = time.monotonic()
    nodes: list[FilledNode] = []
    out: dict[str, Any] = {}
    try:
        for n in fills:
            nodes.append(fill_node(root / f"fill-{n}", n, batches))
            print(f"# fill {n} done at {time.monotonic() - started:.0f} s", flush=True)
        if warm_gib > 0:
            out["host_touch_s_per_gib"] = warm_host_cost(warm_gib)[1]
        timed_requests(nodes, batches, chunks or max(1, batches // 10))
        for node in nodes:
            node_figures(node)
            out.update(node.out)
            shutil.rmtree(node.root, ignore_errors=True)
            print(
                f"# fill {node.shards} measured at {time.monotonic() - started:.0f} s", flush=True
            )
    finally:
        for node in nodes:
            node.probe.close()
            node.daemon.stop(120)
    return out


def get_items(put: Items) -> Items:
    items = make_items(Op.GET, len(put), reply=False)
    items["key"] = put["key"]
    items["index"] = put["index"]
    return items


# ---------------------------------------------------------------------- client parts


@contextlib.contextmanager
def anon_peak() -> Iterator[Callable[[], float]]:
    """Sample this process's anonymous RSS every 5 ms; yields a getter of the peak (MiB)."""
    peak = [0.0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    peak[0] = max(peak[0], int(line.split()[1]) / 1024)
            stop.wait(0.005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield lambda: peak[0]
    finally:
        stop.set()
        thread.join()


def long_tokens(count: int) -> npt.NDArray[np.uint32]:
    return np.random.default_rng(21).integers(0, 100_000, count).astype(np.uint32)


def long_loader(cluster_root: str, tokens: int, out_path: str) -> None:
    """Child process: match and load the long prompt into a file mapping; print figures."""
    from kvcache.client import Client
    from kvcache.keys import Namespace
    from kvcache.testing.localcluster import LocalCluster

    layout = LONG_LAYOUT
    space = Namespace(model="bench/scale-long", revision="1", layout=layout)
    toks = long_tokens(tokens)
    cluster = LocalCluster.attach(cluster_root)
    config = cluster.client_config()
    with Client(config) as client:
        client.match_prefix(space, toks[: 128 * 16])  # connections up
        match_lat = timed(lambda: client.match_prefix(space, toks), 5)
        match = client.match_prefix(space, toks)
        blocks = match.hit_blocks
        size = blocks * layout.payload_bytes
        with open(out_path, "w+b") as f:
            f.truncate(max(1, size))
            mapped = mmap.mmap(f.fileno(), max(1, size))
        out = np.frombuffer(mapped, np.uint8)[:size].reshape(blocks, layout.payload_bytes)
        base = _anon_now()
        with anon_peak() as peak:
            t0 = time.perf_counter()
            result = client.load(space, match, out=out)
            load_s = time.perf_counter() - t0
            peak_mib = peak()
        print(
            json.dumps(
                {
                    "match_prefix_1m_ms": float(np.median(match_lat) * 1000),
                    "match_prefix_1m_p99_ms": p99_ms(match_lat),
                    "long_hit_blocks": blocks,
                    "long_loaded_blocks": result.blocks,
                    "load_1m_s": load_s,
                    "load_1m_gbps": result.bytes_loaded / load_s / 1e9,
                    "load_1m_peak_rss_mib": peak_mib,
                    "load_1m_rss_before_mib": base,
                    "client_buffer_mib": config.chunk_bytes * config.window / (1 << 20),
                }
            ),
            flush=True,
        )


def _anon_now() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return 0.0


def long_part(root: Path, tokens: int) -> dict[str, Any]:
    from kvcache.client import Client
    from kvcache.keys import Namespace, block_keys
    from kvcache.testing.localcluster import LocalCluster
    from kvcache.workload import payload_for_key

    layout = LONG_LAYOUT
    space = Namespace(model="bench/scale-long", revision="1", layout=layout)
    toks = long_tokens(tokens)
    keys = block_keys(space, toks)
    nbytes = len(keys) * layout.payload_bytes
    capacity = max(64 << 20, int(nbytes * 1.2 / 12 * 1.6))
    out: dict[str, Any] = {"long_tokens": tokens, "long_blocks": len(keys)}
    with LocalCluster(root / "cluster").start(nodes=12, capacity=str(capacity)) as cluster:
        with Client(cluster.client_config()) as client:
            t0 = time.perf_counter()
            step = 512
            for i in range(0, len(keys), step):
                # Stored in pieces of the same chain (the store of a prefix is a prefix).
                part = keys[i : i + step]
                stored = client.store_keys(
                    part,
                    [payload_for_key(k, layout.payload_bytes) for k in part],
                    payload_len=layout.payload_bytes,
                )
                if stored.failed:
                    raise RuntimeError(f"stored {stored} of {len(part)} blocks")
            out["store_1m_s"] = time.perf_counter() - t0
        # The engine's pages: shared memory (tmpfs), so the figure is the client's own
        # anonymous memory and no disk write-back of the pages slows the load.
        shm = Path("/dev/shm")
        pages = (shm if shm.is_dir() else root) / f"kvcache-scale-pages-{os.getpid()}"
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--long-loader", str(cluster.root), str(tokens),
                 str(pages)],
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
        finally:
            pages.unlink(missing_ok=True)
        if proc.returncode != 0:
            raise RuntimeError(f"long loader failed:\n{proc.stderr}")
        out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def open_sockets() -> int:
    """Sockets this process holds open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since the listing
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def nodes_part(root: Path, nodes: int, prompts: int, rounds: int) -> dict[str, Any]:
    """Client cost of 64-block prompts against ``nodes`` daemons."""
    from kvcache.client import Client
    from kvcache.keys import Namespace, block_keys
    from kvcache.layout import REFERENCE_LAYOUT
    from kvcache.testing.localcluster import LocalCluster
    from kvcache.workload import payload_for_key

    space = Namespace(model=f"bench/scale-{nodes}", revision="1", layout=REFERENCE_LAYOUT)
    rng = np.random.default_rng(nodes)
    tpb = REFERENCE_LAYOUT.tokens_per_block
    size = REFERENCE_LAYOUT.payload_bytes
    toks = [rng.integers(0, 50_000, 64 * tpb).astype(np.uint32) for _ in range(prompts)]
    payloads = [[payload_for_key(k, size) for k in block_keys(space, t)] for t in toks]
    tag = f"_{nodes}n"
    out: dict[str, Any] = {}
    started = LocalCluster(root / f"n{nodes}").start(nodes=nodes, capacity="256MiB")
    with started as cluster, Client(cluster.client_config()) as client:
        client.match_prefix(space, toks[0])  # connections up
        c0 = time.process_time()
        for t, p in zip(toks, payloads, strict=True):
            client.store(space, t, p)
        store_cpu = time.process_time() - c0
        lat = []
        c0 = time.process_time()
        for _ in range(rounds):
            for t in toks:
                t1 = time.perf_counter()
                res = client.load_prefix(space, t)
                lat.append(time.perf_counter() - t1)
                if res.blocks != 64:
                    raise RuntimeError(f"{nodes} nodes: loaded {res.blocks} of 64 blocks")
        load_cpu = time.process_time() - c0
        out[f"store_cpu_us_per_block{tag}"] = store_cpu / (64 * prompts) * 1e6
        out[f"load_cpu_us_per_block{tag}"] = load_cpu / (64 * prompts * rounds) * 1e6
        out[f"cpu_us_per_block{tag}"] = (store_cpu + load_cpu) / (64 * prompts * (1 + rounds)) * 1e6
        out[f"load64_p99_ms{tag}"] = p99_ms(lat)
        out[f"load64_median_ms{tag}"] = float(np.median(lat) * 1000)
        out[f"client_threads{tag}"] = threading.active_count()
        out[f"client_os_threads{tag}"] = len(os.listdir("/proc/self/task"))
        out[f"client_sockets{tag}"] = open_sockets()
        out[f"client_rss_mib{tag}"] = rss_mib(os.getpid())
    return out


# ---------------------------------------------------------------------- main


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--long-loader":
        long_loader(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return 0
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--parts", default="daemon,long,nodes", help="which parts to run")
    p.add_argument("--fills", default="", help="comma-separated shard counts (overrides)")
    p.add_argument(
        "--warm-host-gb", type=float, default=0.0,
        help="GiB of host memory touched before each fill's timed requests (see above)",
    )  # fmt: skip
    args = p.parse_args()
    quick = args.quick
    fills = (
        [int(float(x)) for x in args.fills.split(",")]
        if args.fills
        else ([10**5, 10**6] if quick else [10**5, 10**6, 10**7])
    )
    parts = set(args.parts.split(","))
    figures: dict[str, Any] = {"commit": commit(), "machine": machine(), "quick": quick}
    figures["fill_record_bytes"] = FILL_RECORD
    figures["timed_record_bytes"] = RECORD
    figures["warm_host_gb"] = args.warm_host_gb
    started = time.monotonic()
    base = Path(os.environ.get("KVCACHE_BENCH_TMP", tempfile.gettempdir()))
    root = Path(tempfile.mkdtemp(prefix="kvcache-scale-", dir=base))
    try:
        if "daemon" in parts:
            figures.update(daemon_part(root, fills, 40 if quick else 200, args.warm_host_gb))
            write_json(args.json, figures)  # so far: a run cut short keeps what it measured
        if "long" in parts:
            figures.update(long_part(root / "long", 1_000_000))
            shutil.rmtree(root / "long", ignore_errors=True)
            print(f"# long prompt done at {time.monotonic() - started:.0f} s", flush=True)
            write_json(args.json, figures)
        if "nodes" in parts:
            for n in (12, 48):
                figures.update(nodes_part(root, n, 4 if quick else 16, 5 if quick else 10))
                print(f"# {n} nodes done at {time.monotonic() - started:.0f} s", flush=True)
                write_json(args.json, figures)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ok = report(figures, fills)
    figures["wall_seconds"] = time.monotonic() - started
    write_json(args.json, figures)
    return 0 if ok else 1


def report(figures: dict[str, Any], fills: list[int]) -> bool:
    tags = [fill_tag(n) for n in fills]
    rows = []
    names = [
        ("put_shards_per_s", "{:,.0f}"), ("put_p99_ms", "{:.2f}"),
        ("get_shards_per_s", "{:,.0f}"), ("get_p99_ms", "{:.2f}"),
        ("put_median_ms", "{:.2f}"), ("get_median_ms", "{:.2f}"),
        ("has64_median_ms", "{:.2f}"), ("has64_p99_ms", "{:.2f}"),
        ("put_majflt_per_request", "{:.2f}"), ("get_majflt_per_request", "{:.2f}"),
        ("has_majflt_per_request", "{:.2f}"), ("sweep_shards_per_s", "{:,.0f}"),
        ("evict_shards_per_s", "{:,.0f}"), ("restart_s", "{:.2f}"),
        ("restart_full_s", "{:.2f}"), ("rss_mib", "{:.0f}"),
        ("index_bytes_per_shard", "{:.1f}"), ("index_db_per_shard", "{:.1f}"),
        ("fill_s", "{:.1f}"),
    ]  # fmt: skip
    if any(f"restart_s_{t}" in figures for t in tags):
        for name, fmt in names:
            rows.append([name] + [
                fmt.format(figures[f"{name}_{t}"]) if f"{name}_{t}" in figures else "-"
                for t in tags
            ])  # fmt: skip
        print_table(
            f"One daemon by fill (fill records {FILL_RECORD} B, timed records {RECORD} B)",
            ["figure", *tags],
            rows,
        )
    first, last = tags[0], tags[-1]
    checks: list[tuple[str, str, str, bool]] = []
    if f"get_p99_ms_{last}" in figures:
        for op in ("get", "put"):
            name = f"{op}_p99_ratio_{last}_vs_{first}"
            figures[name] = figures[f"{op}_p99_ms_{last}"] / figures[f"{op}_p99_ms_{first}"]
            checks.append((name, f"{figures[name]:.2f}", "<= 1.5", figures[name] <= 1.5))
        checks.append((f"restart_s_{last}", f"{figures[f'restart_s_{last}']:.2f}", "<= 5",
                       figures[f"restart_s_{last}"] <= 5))  # fmt: skip
        sweep = figures[f"sweep_shards_per_s_{last}"]
        checks.append((f"sweep_shards_per_s_{last}", f"{sweep:,.0f}", ">= 100,000",
                       sweep >= 100_000))  # fmt: skip
        figures["index_bytes_per_shard"] = figures[f"index_bytes_per_shard_{last}"]
        checks.append(("index_bytes_per_shard", f"{figures['index_bytes_per_shard']:.1f}",
                       "<= 128", figures["index_bytes_per_shard"] <= 128))  # fmt: skip
    if "match_prefix_1m_ms" in figures:
        checks.append(("match_prefix_1m_ms", f"{figures['match_prefix_1m_ms']:.1f}", "<= 30",
                       figures["match_prefix_1m_ms"] <= 30))  # fmt: skip
        bound = figures["client_buffer_mib"] + 256
        checks.append(("load_1m_peak_rss_mib", f"{figures['load_1m_peak_rss_mib']:.0f}",
                       f"<= {bound:.0f}", figures["load_1m_peak_rss_mib"] <= bound))  # fmt: skip
        checks.append(("load_1m_loaded_blocks", str(figures["long_loaded_blocks"]),
                       str(figures["long_blocks"]),
                       figures["long_loaded_blocks"] == figures["long_blocks"]))  # fmt: skip
    if "cpu_us_per_block_48n" in figures:
        for name, bound in (("cpu_us_per_block", 1.2), ("load64_p99_ms", 1.5)):
            ratio = figures[f"{name}_48n"] / figures[f"{name}_12n"]
            figures[f"{name}_ratio_48_vs_12"] = ratio
            checks.append((f"{name}_ratio_48_vs_12", f"{ratio:.2f}", f"<= {bound}",
                           ratio <= bound))  # fmt: skip
        rows = [
            [name] + [f"{figures[f'{name}_{n}n']:.1f}" for n in (12, 48)]
            for name in ("store_cpu_us_per_block", "load_cpu_us_per_block", "cpu_us_per_block",
                         "load64_median_ms", "load64_p99_ms", "client_os_threads",
                         "client_sockets", "client_rss_mib")
        ]  # fmt: skip
        print_table("Client against 12 and 48 daemons", ["figure", "12", "48"], rows)
    print_table(
        "Targets (issue 21)" + (" - --quick stops at 10^6 shards" if last != "1e7" else ""),
        ["figure", "value", "target", "met"],
        [[a, b, c, str(d)] for a, b, c, d in checks],
    )
    return all(d for *_, d in checks)


if __name__ == "__main__":
    sys.exit(main())
