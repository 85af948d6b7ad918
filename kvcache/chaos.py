"""Faults planted in a running local cluster, the way bad disks and bad peers make them.

Used by the tests and ``bench/reliability.py`` to check that damage costs no
wrong bytes and as few hits as the redundancy allows. Each fault hits one
stored shard of one block on the node that holds it:

* ``missing``: the shard is deleted (a lost write, a replaced disk);
* ``corrupt-body`` / ``corrupt-header``: one byte of the stored record is
  flipped inside the daemon's LMDB file while the daemon runs (bitrot); the
  shard's own checksums no longer match;
* ``forged``: the body is changed and the shard checksum recomputed, so the
  shard looks healthy on its own (a buggy or hostile writer); only the
  payload hash over the rebuilt block shows it.

Byte flips go through the files, not the daemon: every copy of the record in
the node's segment files (and ``data.mdb``) is flipped, and
:meth:`PlantedFault.undo` flips them back.

:func:`run_kill_stop` is the process-level chaos: daemons killed and restarted,
or stopped and resumed, at most two at a time, under a writer and a reader.
"""

from __future__ import annotations

import dataclasses
import enum
import mmap
import os
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvcache.client.client import Client
from kvcache.errors import KVCacheError
from kvcache.keys import BlockKey, Namespace, block_keys
from kvcache.server.probe import Probe
from kvcache.shard import HEADER_BYTES, ShardHeader, shard_hash
from kvcache.testing.localcluster import LocalCluster
from kvcache.wire import Status
from kvcache.workload import payload_for_key

__all__ = [
    "ChaosTally",
    "PlantedFault",
    "ShardFault",
    "find_shard",
    "flip_record_byte",
    "plant",
    "run_kill_stop",
    "unflip",
]


class ShardFault(enum.Enum):
    """What is done to one stored shard (see the module docstring)."""

    MISSING = "missing"
    CORRUPT_BODY = "corrupt-body"
    CORRUPT_HEADER = "corrupt-header"
    FORGED = "forged"


@dataclass
class PlantedFault:
    """A fault in place: where, and (for byte flips) how to take it back."""

    kind: ShardFault
    node: int
    key: BlockKey
    index: int
    #: (file, offset) of every byte flipped in the node's data files (byte flips only).
    offsets: list[tuple[str, int]] = field(default_factory=list)
    data_file: str = ""

    def undo(self) -> None:
        """Flip the flipped bytes back (byte flips only; a deleted or forged shard stays)."""
        if not self.offsets:
            raise KVCacheError(f"a {self.kind.value} fault cannot be undone")
        _xor_at(self.offsets)
        self.offsets = []


def _probe(cluster: LocalCluster, node: int, tenant: str) -> Probe:
    entry = cluster.credentials().tenant(tenant)
    if entry is None:
        raise KVCacheError(f"no tenant {tenant!r} in the cluster's credentials")
    return Probe(cluster.nodes[node].data, tenant=tenant, secret=entry.secret)


def find_shard(
    cluster: LocalCluster, key: BlockKey, index: int, *, tenant: str = "default"
) -> tuple[int, int, bytes]:
    """(node position, stripe id, stored record) of shard ``index`` of ``key``."""
    for node in range(len(cluster.nodes)):
        with _probe(cluster, node, tenant) as probe:
            held = probe.has([key])[key]
            if index not in held:
                continue
            status, records = probe.get([(key, index)])
            record = records[0]
            if status[0] != Status.OK or record is None:
                raise KVCacheError(f"node {node} lists shard {index} of {key.hex()} but GET failed")
            return node, held[index], record
    raise KVCacheError(f"no node holds shard {index} of {key.hex()}")


def flip_record_byte(
    cluster: LocalCluster, node: int, record: bytes, position: int, *, mask: int = 0xFF
) -> list[tuple[str, int]]:
    """XOR byte ``position`` of every copy of ``record`` in node ``node``'s data files (its
    segment files and ``data.mdb``) with ``mask``; returns the (file, offset) pairs flipped
    (flip them again to undo)."""
    if not 0 <= position < len(record) or not 0 < mask < 256:
        raise ValueError(f"position {position} outside the record or bad mask {mask}")
    directory = cluster.data_dir(node)
    offsets = []
    for path in [directory / "data.mdb", *sorted((directory / "segments").glob("*.seg"))]:
        if not path.exists() or not path.stat().st_size:
            continue
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            start = mm.find(record)
            while start >= 0:
                offsets.append((str(path), start + position))
                start = mm.find(record, start + 1)
    if not offsets:
        raise KVCacheError(f"record not found in {directory}")
    _xor_at(offsets, mask)
    return offsets


def unflip(
    cluster: LocalCluster, node: int, offsets: list[tuple[str, int]], *, mask: int = 0xFF
) -> None:
    """Undo :func:`flip_record_byte` (its offsets and mask)."""
    _xor_at(offsets, mask)


def _xor_at(offsets: list[tuple[str, int]], mask: int = 0xFF) -> None:
    for path, offset in offsets:
        fd = os.open(path, os.O_RDWR)
        try:
            old = os.pread(fd, 1, offset)
            os.pwrite(fd, bytes([old[0] ^ mask]), offset)
        finally:
            os.close(fd)


def plant(
    cluster: LocalCluster,
    key: BlockKey,
    index: int,
    kind: ShardFault,
    *,
    tenant: str = "default",
    position: int | None = None,
) -> PlantedFault:
    """Do ``kind`` to shard ``index`` of ``key``; ``position`` picks the flipped byte
    within the header or the body (default: the middle)."""
    node, stripe, record = find_shard(cluster, key, index, tenant=tenant)
    fault = PlantedFault(kind, node, key, index)
    if kind is ShardFault.MISSING:
        with _probe(cluster, node, tenant) as probe:
            if probe.delete([(key, stripe, index)])[0] != Status.OK:
                raise KVCacheError(f"node {node} refused to delete shard {index}")
    elif kind is ShardFault.FORGED:
        body = bytearray(record[HEADER_BYTES:])
        for i in range(0, len(body), 97):
            body[i] ^= 0x5A
        header = dataclasses.replace(ShardHeader.unpack(record), shard_hash=shard_hash(bytes(body)))
        # The same stripe id: the daemon takes it as a rewrite of the same shard.
        with _probe(cluster, node, tenant) as probe:
            if probe.put([(key, index, header.pack() + bytes(body))])[0] != Status.OK:
                raise KVCacheError(f"node {node} refused the forged shard {index}")
    else:
        span = HEADER_BYTES if kind is ShardFault.CORRUPT_HEADER else len(record) - HEADER_BYTES
        at = span // 2 if position is None else position
        if not 0 <= at < span:
            raise ValueError(f"position {at} outside the {kind.value} span of {span} bytes")
        base = 0 if kind is ShardFault.CORRUPT_HEADER else HEADER_BYTES
        fault.data_file = str(cluster.data_dir(node))
        fault.offsets = flip_record_byte(cluster, node, record, base + at)
    return fault


# ---------------------------------------------------------------------- process chaos


@dataclass
class ChaosTally:
    """What the writer and reader of :func:`run_kill_stop` saw."""

    acked: list[int] = field(default_factory=list)
    stores: int = 0
    loads: int = 0
    blocks_loaded: int = 0
    wrong_bytes: int = 0
    faults: int = 0
    errors: list[BaseException] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def chaos_prompt(i: int, blocks: int, tokens_per_block: int) -> npt.NDArray[np.uint32]:
    """Prompt ``i`` of a chaos run (deterministic)."""
    rng = np.random.default_rng(i)
    return rng.integers(0, 50_000, blocks * tokens_per_block).astype(np.uint32)


def check_prompt(
    client: Client, space: Namespace, tokens: npt.NDArray[np.uint32]
) -> tuple[int, int]:
    """(blocks loaded, wrong bytes among them) of a prompt whose payloads are
    :func:`kvcache.workload.payload_for_key` of its keys."""
    result = client.load_prefix(space, tokens)
    size = space.layout.payload_bytes
    want = [payload_for_key(k, size) for k in block_keys(space, tokens)]
    wrong = sum(int(np.count_nonzero(g != w)) for g, w in zip(result.payloads, want, strict=False))
    return result.blocks, wrong


def run_kill_stop(
    cluster: LocalCluster,
    space: Namespace,
    *,
    seconds: float,
    seed: int,
    blocks: int = 4,
    min_rounds: int = 3,
    client_overrides: dict[str, object] | None = None,
) -> ChaosTally:
    """Store and load prompts for ``seconds`` (and at least ``min_rounds`` fault rounds)
    while one or two daemons at a time are killed (then restarted) or stopped (then
    resumed); returns the tally."""
    tally = ChaosTally()
    stop = threading.Event()
    overrides = {"timeout_s": 1.0, "down_retry_s": 0.5, **(client_overrides or {})}
    tpb = space.layout.tokens_per_block
    size = space.layout.payload_bytes

    def writer() -> None:
        with Client(cluster.client_config(**overrides)) as client:
            i = seed * 1_000_000
            while not stop.is_set():
                i += 1
                tokens = chaos_prompt(i, blocks, tpb)
                payloads = [payload_for_key(k, size) for k in block_keys(space, tokens)]
                result = client.store(space, tokens, payloads)
                with tally.lock:
                    tally.stores += 1
                    if result.failed == 0:
                        tally.acked.append(i)

    def reader() -> None:
        rng = random.Random(seed)
        with Client(cluster.client_config(**overrides)) as client:
            while not stop.is_set():
                with tally.lock:
                    acked = list(tally.acked)
                if not acked:
                    stop.wait(0.01)
                    continue
                got, wrong = check_prompt(
                    client, space, chaos_prompt(rng.choice(acked), blocks, tpb)
                )
                with tally.lock:
                    tally.loads += 1
                    tally.blocks_loaded += got
                    tally.wrong_bytes += wrong

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # reported in the tally
                tally.errors.append(exc)
                stop.set()

        return run

    workers = [
        threading.Thread(target=guarded(f), name=f"chaos-{f.__name__}") for f in (writer, reader)
    ]
    for w in workers:
        w.start()
    rng = random.Random(seed)
    over = threading.Event()
    timer = threading.Timer(seconds, over.set)
    timer.start()
    rounds = 0
    try:
        while (rounds < min_rounds or not over.is_set()) and not stop.is_set():
            rounds += 1
            victims = rng.sample(range(len(cluster.nodes)), rng.choice((1, 2)))
            kill = rng.random() < 0.5
            for v in victims:
                if kill:
                    cluster.kill(v)
                else:
                    cluster.pause(v)
            tally.faults += len(victims)
            over.wait(rng.uniform(0.3, 1.0))
            for v in victims:
                if kill:
                    cluster.restart(v)
                else:
                    cluster.resume(v)
            over.wait(rng.uniform(0.1, 0.5))
    finally:
        timer.cancel()
        stop.set()
        for w in workers:
            w.join(60)
    return tally
