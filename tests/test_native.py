"""kvcache.native: batched hashes equal the xxhash package's, scatter/gather I/O moves
exactly the bytes of its segments, and the data path runs the same without the library."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import native
from kvcache.shard import HEADER_BYTES, HEADER_DTYPE, header_checks

ROOT = Path(__file__).resolve().parent.parent


def test_the_library_is_loaded_where_ci_requires_it() -> None:
    # CI sets KVCACHE_NATIVE=require: there the helpers must be the ones under test.
    if os.environ.get(native.ENV) == "require":
        assert native.AVAILABLE
    else:
        assert native.LIBRARY.exists() == native.AVAILABLE or not native.AVAILABLE


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=5000), min_size=0, max_size=20))
def test_batched_hashes_equal_xxhash(chunks: list[bytes]) -> None:
    arrays = [np.frombuffer(c, np.uint8) if c else np.zeros(0, np.uint8) for c in chunks]
    addrs = np.array([native.addresses_of(a) if a.size else 0 for a in arrays], np.uint64)
    lens = np.array([len(c) for c in chunks], np.uint64)
    h64 = native.xxh3_64_many(addrs, lens)
    h128 = native.xxh3_128_many(addrs, lens)
    assert h64.tolist() == [xxhash.xxh3_64_intdigest(c) for c in chunks]
    assert [bytes(d) for d in h128.tolist()] == [xxhash.xxh3_128_digest(c) for c in chunks]


@settings(max_examples=80, deadline=None)
@given(
    seed=st.binary(min_size=16, max_size=16),
    tag=st.binary(max_size=40),
    step=st.integers(1, 700),
    count=st.integers(0, 40),
    group=st.integers(1, 9),
    tag_bytes=st.integers(0, 16),
    data=st.data(),
)
def test_chained_keys_equal_one_xxhash_call_a_block(
    seed: bytes,
    tag: bytes,
    step: int,
    count: int,
    group: int,
    tag_bytes: int,
    data: st.DataObject,
) -> None:
    """The native key chain is the chain of xxhash digests, block by block, with each
    group's placement tag carried from its first block, for any tag, block size, count,
    group and tag length (a raw buffer longer than the blocks included)."""
    raw = data.draw(st.binary(min_size=step * count, max_size=step * count + 30))
    expected, parent = [], seed
    for i in range(count):
        own = xxhash.xxh3_128_digest(tag + parent + raw[i * step : (i + 1) * step])
        parent = own if i % group == 0 else parent[:tag_bytes] + own[tag_bytes:]
        expected.append(parent)
    assert native.chain_keys(seed, tag, raw, step, count, group, tag_bytes) == expected
    with pytest.raises(ValueError):
        native.chain_keys(
            seed, tag, raw[: step * count - 1], step, count, group, tag_bytes
        ) if count else (native.chain_keys(seed[:15], tag, raw, step, count, group, tag_bytes))
    with pytest.raises(ValueError):
        native.chain_keys(seed, tag, raw, step, count, 0, tag_bytes)
    with pytest.raises(ValueError):
        native.chain_keys(seed, tag, raw, step, count, group, 17)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 40), st.integers(0, 2**32))
def test_header_checks_equal_one_hash_per_record(count: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    records = np.frombuffer(
        rng.integers(0, 256, count * HEADER_BYTES, dtype=np.uint8).tobytes(), HEADER_DTYPE
    )
    raw = records.view(np.uint8).reshape(count, HEADER_BYTES)
    expected = [xxhash.xxh3_64_intdigest(raw[i, :100].tobytes()) & 0xFFFFFFFF for i in range(count)]
    assert header_checks(records).tolist() == expected


def _segments_of(buf: np.ndarray, cuts: list[int]) -> native.Segments:
    """``buf`` cut at ``cuts`` into segments, in a shuffled order of places in ``buf``."""
    bounds = sorted({0, buf.nbytes, *(c % (buf.nbytes + 1) for c in cuts)})
    base = native.addresses_of(buf)
    addrs = np.array([base + a for a in bounds[:-1]], np.uint64)
    lens = np.array([b - a for a, b in itertools.pairwise(bounds)], np.uint64)
    return native.Segments.of(addrs, lens, buf)


needs_native = pytest.mark.skipif(not native.AVAILABLE, reason="native helpers not built")


@needs_native
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3_000_000), st.lists(st.integers(0, 3_000_000), max_size=40))
def test_gather_send_and_scatter_receive_move_every_byte(size: int, cuts: list[int]) -> None:
    rng = np.random.default_rng(size)
    src = rng.integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    send_seg = _segments_of(src, cuts)
    recv_seg = _segments_of(dst, [c * 7 for c in cuts])
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    try:
        # One thread, both ends non-blocking: every call moves what the buffers allow, so
        # partial sends and receives (the paths that resume mid-segment) are exercised.
        rounds = 0
        while not recv_seg.done:
            rounds += 1
            assert rounds < 100_000
            if not send_seg.done:
                with contextlib.suppress(BlockingIOError):
                    native.send_gather(a.fileno(), send_seg)
            with contextlib.suppress(BlockingIOError):
                native.recv_scatter(b.fileno(), recv_seg)
        assert send_seg.done and not recv_seg.closed
        assert np.array_equal(src, dst)
    finally:
        a.close()
        b.close()


@needs_native
def test_scatter_receive_reports_a_closed_peer() -> None:
    dst = np.zeros(100, np.uint8)
    seg = _segments_of(dst, [10, 50])
    a, b = socket.socketpair()
    b.setblocking(False)
    a.sendall(b"x" * 30)
    a.close()
    got = native.recv_scatter(b.fileno(), seg)
    b.close()
    assert got == 30 and seg.closed and not seg.done
    assert bytes(dst[:30]) == b"x" * 30


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5000), st.lists(st.integers(0, 5000), max_size=10), st.integers(0, 5000))
def test_views_and_advance_describe_what_is_left(size: int, cuts: list[int], done: int) -> None:
    buf = np.arange(size, dtype=np.uint64).astype(np.uint8)
    seg = _segments_of(buf, cuts)
    done = min(done, size)
    seg.advance(done)
    left = b"".join(bytes(v) for v in seg.views())
    assert left == buf.tobytes()[done:]
    assert seg.done == (done == size)


def test_a_view_keeps_its_buffer_alive() -> None:
    seg = native.Segments.of(
        np.array([0], np.uint64), np.array([0], np.uint64), None
    )  # empty: nothing to view
    assert seg.views() == [] and seg.done
    buf = np.full(64, 7, np.uint8)
    seg = native.Segments.of(
        np.array([native.addresses_of(buf)], np.uint64), np.array([64], np.uint64), buf
    )
    (view,) = seg.views()
    del buf, seg
    assert bytes(view) == b"\x07" * 64


def _round_trip(env: dict[str, str]) -> str:
    code = (
        "import numpy as np, tempfile, pathlib\n"
        "from kvcache import native\n"
        "from kvcache.client import Client\n"
        "from kvcache.testing.localcluster import LocalCluster\n"
        "from kvcache.keys import Namespace\n"
        "from kvcache.layout import REFERENCE_LAYOUT as L\n"
        "P = L.payload_bytes\n"
        "tmp = tempfile.TemporaryDirectory()  # the cluster's files go with it\n"
        "with tmp, LocalCluster(pathlib.Path(tmp.name) / 'c').start(nodes=12) as cl:\n"
        "    with Client(cl.client_config()) as c:\n"
        "        rng = np.random.default_rng(3)\n"
        "        tokens = rng.integers(0, 9999, 20 * L.tokens_per_block).astype(np.uint32)\n"
        "        src = rng.integers(0, 256, (20, P), dtype=np.uint8)\n"
        "        ns = Namespace(model='m', revision='1', layout=L)\n"
        "        assert c.store(ns, tokens, src).written == 20\n"
        "        out = np.zeros_like(src)\n"
        "        assert c.load(ns, c.match_prefix(ns, tokens), out=out).blocks == 20\n"
        "        assert np.array_equal(out, src)\n"
        "        print('native' if native.AVAILABLE else 'python')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_the_data_path_without_the_library_stores_and_loads_the_same_bytes() -> None:
    assert _round_trip({native.ENV: "0"}) == "python"


def test_a_required_library_that_cannot_load_is_a_clear_error(tmp_path: Path) -> None:
    env = {
        **os.environ,
        native.ENV: "require",
        native.LIBRARY_ENV: str(tmp_path / "missing" / "libkvfast.so"),
    }
    done = subprocess.run(
        [sys.executable, "-c", "import kvcache.native"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "ConfigError" in done.stderr and "scripts/build-native.sh" in done.stderr


@needs_native
@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 40),
    st.sampled_from([(10, 2, 114_688), (3, 2, 1000), (4, 0, 4096), (2, 1, 65)]),
    st.integers(0, 2**32),
)
def test_native_landing_segments_equal_the_numpy_ones(
    count: int, code: tuple[int, int, int], seed: int
) -> None:
    from kvcache.client.assembly import LoadAssembly
    from kvcache.erasure import get_codec
    from kvcache.shard import shard_len_for

    k, m, payload = code
    blocks_in_load = 8
    rng = np.random.default_rng(seed)
    out = np.zeros((blocks_in_load, payload), np.uint8)
    asm = LoadAssembly(
        key_words=np.zeros(blocks_in_load, "V16"),
        stripes=np.ones(blocks_in_load, np.uint64),
        out=out,
        k=k,
        n=k + m,
        payload_len=payload,
        codec=get_codec(),
    )
    record = HEADER_BYTES + shard_len_for(payload, k)
    blocks = rng.integers(0, blocks_in_load, count).astype(np.int64)
    indices = rng.integers(0, k + m, count).astype(np.int64)
    statuses = rng.choice(np.array([0, 0, 0, 1, 2], np.uint8), count)
    lengths = np.where(rng.random(count) < 0.8, record, rng.integers(0, 3 * record, count))
    lengths = np.where(statuses == 0, lengths, 0).astype(np.int64)
    live = rng.random(count) < 0.9
    fast = asm._segments(blocks, indices, statuses, lengths, live)
    slow = asm._segments_numpy(blocks, indices, statuses, lengths, live)
    assert fast.lens.tolist() == slow.lens.tolist()
    assert fast.nbytes == slow.nbytes == int(lengths[statuses == 0].sum())
    # Addresses agree except inside the per-reply scratch buffers (each has its own).
    scratch = (statuses == 0) & ~((lengths == record) & live)
    kinds = []
    for j in range(count):
        if statuses[j] != 0 or lengths[j] == 0:
            continue
        shard = record - HEADER_BYTES
        straddles = indices[j] < k and indices[j] * shard < payload < (indices[j] + 1) * shard
        if not scratch[j]:
            kinds += [False] * (3 if straddles else 2)
        elif live[j] and lengths[j] >= HEADER_BYTES:
            # A record of another length for an open block: its header to the odd headers
            # table (the same address both ways), the rest, if any, to scratch.
            kinds += [False] + ([True] if lengths[j] > HEADER_BYTES else [])
        else:
            kinds.append(True)
    assert len(kinds) == fast.count
    for a, b, is_scratch in zip(fast.addrs.tolist(), slow.addrs.tolist(), kinds, strict=True):
        if not is_scratch:
            assert a == b


def _accept_assembly(k: int, m: int, payload: int, blocks_in_load: int, known: np.ndarray) -> Any:
    from kvcache.client.assembly import LoadAssembly
    from kvcache.erasure import get_codec

    return LoadAssembly(
        key_words=np.arange(blocks_in_load, dtype="<u8").repeat(2).view("V16"),
        stripes=np.where(known, np.arange(1, blocks_in_load + 1), 0).astype(np.uint64),
        out=np.zeros((blocks_in_load, payload), np.uint8),
        k=k,
        n=k + m,
        payload_len=payload,
        codec=get_codec(),
    )


@needs_native
@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 40),
    st.sampled_from([(10, 2, 114_688), (3, 2, 1000), (2, 1, 65)]),
    st.integers(0, 2**32),
)
def test_native_accept_equals_the_numpy_one(
    count: int, code: tuple[int, int, int], seed: int
) -> None:
    """Same verdicts and the same got / rejected / not-found marks, for replies mixing
    good records, wrong lengths, NOT_FOUND, errors, sealed blocks, headers damaged in
    their identity (class length, stripe id, key, index) and blocks of unknown stripe."""
    from kvcache.shard import shard_len_for

    k, m, payload = code
    n, blocks_in_load = k + m, 6
    rng = np.random.default_rng(seed)
    known = rng.random(blocks_in_load) < 0.7
    pair = [_accept_assembly(k, m, payload, blocks_in_load, known) for _ in range(2)]
    record = HEADER_BYTES + shard_len_for(payload, k)
    blocks = rng.integers(0, blocks_in_load, count).astype(np.int64)
    indices = rng.integers(0, n, count).astype(np.int64)
    statuses = rng.choice(np.array([0, 0, 0, 1, 2], np.uint8), count)
    lengths = np.where(rng.random(count) < 0.8, record, rng.integers(0, 3 * record, count))
    sealed = rng.random(blocks_in_load) < 0.2
    # Received headers: the expected identity, then some bytes damaged.
    received = pair[0]._identities.copy()
    received[:, HEADER_DTYPE.fields["class_len"][1]] = 4  # a class name of 4 bytes
    rows = rng.integers(0, blocks_in_load * n, 12)
    cols = rng.integers(0, received.shape[1], 12)
    received[rows, cols] ^= rng.integers(1, 256, 12).astype(np.uint8)
    for asm in pair:
        asm.sealed[:] = sealed
        asm._header_rows[:, : received.shape[1]] = received
    # The native call gets its columns as a reply hands them over: fields of one structured
    # array (strided, so converted on the way in; a converted copy must outlive the call).
    reply = np.zeros(count, [("block", "<i4"), ("index", "<i2"), ("status", "u1"), ("len", "<u4")])
    reply["block"], reply["index"], reply["status"], reply["len"] = (
        blocks, indices, statuses, lengths
    )  # fmt: skip
    fast = pair[0].accept(reply["block"], reply["index"], reply["status"], reply["len"])
    slow = pair[1]._accept_numpy(blocks, indices, statuses, lengths.astype(np.int64))
    assert fast.tolist() == slow.tolist()
    for table in ("got", "rejected", "not_found"):
        assert getattr(pair[0], table).tolist() == getattr(pair[1], table).tolist(), table


def _wire_reply(statuses: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """GET reply items as the transport receives them (the wire's own record type)."""
    from kvcache.wire import Op, make_items

    items = make_items(Op.GET, len(statuses), reply=True)
    items["status"], items["length"] = statuses, lengths
    return items


@needs_native
@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 40),
    st.sampled_from([(10, 2, 114_688), (3, 2, 1000), (2, 1, 65)]),
    st.integers(0, 2**32),
)
def test_accepting_a_reply_from_its_own_items_equals_the_numpy_accept(
    count: int, code: tuple[int, int, int], seed: int
) -> None:
    """``accept_reply`` (``kv_accept_get_reply``, reading the wire's 8-byte records) gives
    the verdicts and marks of the numpy accept over the same columns."""
    from kvcache.shard import shard_len_for

    k, m, payload = code
    n, blocks_in_load = k + m, 6
    rng = np.random.default_rng(seed)
    known = rng.random(blocks_in_load) < 0.7
    pair = [_accept_assembly(k, m, payload, blocks_in_load, known) for _ in range(2)]
    record = HEADER_BYTES + shard_len_for(payload, k)
    blocks = rng.integers(0, blocks_in_load, count).astype(np.int64)
    indices = rng.integers(0, n, count).astype(np.int64)
    statuses = rng.choice(np.array([0, 0, 0, 1, 2], np.uint8), count)
    lengths = np.where(rng.random(count) < 0.8, record, rng.integers(0, 3 * record, count))
    received = pair[0]._identities.copy()
    received[:, HEADER_DTYPE.fields["class_len"][1]] = 4
    rows = rng.integers(0, blocks_in_load * n, 12)
    cols = rng.integers(0, received.shape[1], 12)
    received[rows, cols] ^= rng.integers(1, 256, 12).astype(np.uint8)
    sealed = rng.random(blocks_in_load) < 0.2
    for asm in pair:
        asm.sealed[:] = sealed
        asm._header_rows[:, : received.shape[1]] = received
    at = (native.addresses_of(blocks), native.addresses_of(indices))
    items = _wire_reply(statuses, lengths)
    # The verdicts go to the buffer of the reply's native landing; one made for a reply
    # of the same shards, all OK, with the blocks open, has room for them.
    asm = pair[0]
    sealed_now = asm.sealed.copy()
    asm.sealed[:] = False
    landing = asm.land_reply(blocks, indices, at, _wire_reply(np.zeros(count, np.uint8),
                                                              np.full(count, record)))  # fmt: skip
    assert isinstance(landing, native.GetLanding)
    asm.landed(landing.writes, landing.writes_at)
    asm.sealed[:] = sealed_now
    fast = asm.accept_reply(blocks, indices, at, items, landing)
    assert fast is landing.accepted
    slow = pair[1]._accept_numpy(blocks, indices, statuses, lengths.astype(np.int64))
    assert fast.tolist() == slow.tolist()
    for table in ("got", "rejected", "not_found"):
        assert getattr(pair[0], table).tolist() == getattr(pair[1], table).tolist(), table


@needs_native
@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 40),
    st.sampled_from([(10, 2, 114_688), (3, 2, 1000), (4, 0, 4096), (2, 1, 65)]),
    st.floats(0.0, 1.0),
    st.integers(0, 2**32),
)
def test_landing_a_reply_from_its_own_items_equals_the_general_landing(
    count: int, code: tuple[int, int, int], odd: float, seed: int
) -> None:
    """``land_reply`` (``kv_land_get_reply``) lands a reply where ``landing`` does, counts
    the same blocks as being written, and leaves a reply with a record for scratch (a
    length other than a shard's, or a sealed block) to the general path, unchanged."""
    from kvcache.shard import shard_len_for

    k, m, payload = code
    n, blocks_in_load = k + m, 8
    rng = np.random.default_rng(seed)
    asm = _accept_assembly(k, m, payload, blocks_in_load, np.ones(8, bool))
    record = HEADER_BYTES + shard_len_for(payload, k)
    blocks = rng.integers(0, blocks_in_load, count).astype(np.int64)
    indices = rng.integers(0, n, count).astype(np.int64)
    statuses = rng.choice(np.array([0, 0, 0, 1, 2], np.uint8), count)
    # ``odd`` of the replies have records that must go to scratch.
    lengths = np.full(count, record, np.int64)
    if rng.random() < odd:
        lengths[rng.integers(0, count)] = rng.integers(0, 3 * record)
    if rng.random() < odd:
        asm.sealed[rng.integers(0, blocks_in_load)] = True
    lengths = np.where(statuses == 0, lengths, 0)
    at = (native.addresses_of(blocks), native.addresses_of(indices))
    # The same assembly lands the reply both ways, one after the other.
    fast = asm.land_reply(blocks, indices, at, _wire_reply(statuses, lengths))
    assert fast is not None
    fast_writing = asm._writing.copy()
    if isinstance(fast, native.GetLanding):
        fseg, fwrites = fast.segments, fast.writes
        asm.landed(fast.writes, fast.writes_at)
    else:  # declined: the general landing
        fseg, fwrites = fast
        asm.landed(fwrites)
    assert not asm._writing.any()
    slow = asm.landing(blocks, indices, statuses, lengths)
    assert slow is not None
    sseg, swrites = slow
    assert sorted(fwrites.tolist()) == sorted(swrites.tolist())
    assert fast_writing.tolist() == asm._writing.tolist()
    assert fseg.nbytes == sseg.nbytes == int(lengths[statuses == 0].sum())
    assert fseg.lens.tolist() == sseg.lens.tolist()
    scratch = bool(((statuses == 0) & ((lengths != record) | asm.sealed[blocks])).any())
    # The native landing declines exactly the replies with a record for scratch.
    assert isinstance(fast, native.GetLanding) == (not scratch)
    if not scratch:  # no scratch buffer: every address is a place in the assembly
        assert fseg.addrs.tolist() == sseg.addrs.tolist()
    asm.landed(swrites)
    assert not asm._writing.any()


@needs_native
def test_native_accept_checks_the_identity_but_an_unknown_stripe() -> None:
    from kvcache.shard import shard_len_for

    k, m, payload = 3, 2, 1000
    known = np.array([True, False])
    asm = _accept_assembly(k, m, payload, 2, known)
    record = HEADER_BYTES + shard_len_for(payload, k)
    asm._header_rows[:, : asm._identities.shape[1]] = asm._identities
    stripe_at = HEADER_DTYPE.fields["stripe_id"][1]
    class_at = HEADER_DTYPE.fields["class_len"][1]
    asm._header_rows[:, class_at] = 4  # a class name of 4 bytes
    asm._header_rows[[1, 6], stripe_at] ^= 0xFF  # block 0 shard 1, block 1 shard 1
    asm._header_rows[2, class_at] = 0  # block 0 shard 2: no class name
    blocks = np.array([0, 0, 0, 0, 1, 1], np.int64)
    indices = np.array([0, 1, 2, 3, 1, 2], np.int64)
    statuses = np.array([0, 0, 0, 1, 0, 0], np.uint8)
    lengths = np.array([record, record, record, 0, record, record - 1], np.int64)
    accepted = asm.accept(blocks, indices, statuses, lengths)
    # Another stripe id: rejected where the stripe is known, taken where it is not.
    assert accepted.tolist() == [True, False, False, False, True, False]
    assert np.flatnonzero(asm.got).tolist() == [0, 6]
    assert np.flatnonzero(asm.rejected).tolist() == [1, 2, 7]
    assert np.flatnonzero(asm.not_found).tolist() == [3]


@needs_native
@settings(max_examples=30, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=3000), min_size=1, max_size=8))
def test_every_hash_kernel_equals_xxhash(chunks: list[bytes]) -> None:
    """The run-time choice of kernel must not change a hash: each kernel the CPU can run is
    checked, not only the one this machine picks."""
    import ctypes

    lib = native._LIB
    arrays = [np.frombuffer(c, np.uint8) if c else np.zeros(1, np.uint8) for c in chunks]
    addrs = np.array([native.addresses_of(a) for a in arrays], np.uint64)
    lens = np.array([len(c) for c in chunks], np.uint64)
    flags = Path("/proc/cpuinfo").read_text().split()
    runnable = ["sse2"] + [
        k for k in ("avx2", "avx512") if (k if k != "avx512" else "avx512f") in flags
    ]
    for kernel in runnable:
        f64 = getattr(lib, f"kv_xxh3_64_many_{kernel}")
        f128 = getattr(lib, f"kv_xxh3_128_many_{kernel}")
        for f in (f64, f128):
            f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            f.restype = None
        out64 = np.empty(len(chunks), np.uint64)
        out128 = np.empty(len(chunks), "V16")
        f64(
            native.addresses_of(addrs),
            native.addresses_of(lens),
            len(chunks),
            native.addresses_of(out64),
        )
        f128(
            native.addresses_of(addrs),
            native.addresses_of(lens),
            len(chunks),
            native.addresses_of(out128),
        )
        assert out64.tolist() == [xxhash.xxh3_64_intdigest(c) for c in chunks], kernel
        assert [bytes(d) for d in out128.tolist()] == [xxhash.xxh3_128_digest(c) for c in chunks], (
            kernel
        )


def _runnable_kernels() -> list[str]:
    flags = Path("/proc/cpuinfo").read_text().split()
    return ["sse2"] + [
        k for k in ("avx2", "avx512") if (k if k != "avx512" else "avx512f") in flags
    ]


@needs_native
@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 5),
    st.integers(1, 40_000),
    st.sampled_from([(10, 2), (8, 4), (3, 1), (2, 0)]),
    st.integers(0, 2**32),
)
def test_encoding_and_hashing_block_by_block_equal_the_three_passes(
    blocks: int, payload_len: int, km: tuple[int, int], seed: int
) -> None:
    """``encode_hashed`` (each kernel the CPU runs) gives the parity of the codec's
    ``encode_rows`` and the digests of xxhash, block by block, for payloads whose last data
    row is partly padding (rows copied out as the client's encoding does)."""
    from kvcache.erasure import Backend, ErasureParams, get_codec, isal_available

    if not isal_available():
        pytest.skip("libisal.so.2 not installed")
    k, m = km
    n = k + m
    # A codec needs parity; with m = 0 the job runs with no output rows (hashes only).
    codec = get_codec(ErasureParams(k=k, m=max(m, 1)), Backend.ISAL)
    job = codec.encode_job()
    assert job is not None
    if m == 0:
        job = job._replace(outputs=0)
    rng = np.random.default_rng(seed)
    length = -(-payload_len // k)
    payloads = rng.integers(0, 256, (blocks, payload_len), dtype=np.uint8)
    # Every row in its own padded copy (a zero tail past the payload's end), parity after.
    padded = np.zeros((blocks, k * length), np.uint8)
    padded[:, :payload_len] = payloads
    stripes = np.zeros((blocks, n, length), np.uint8)
    rows = np.empty((blocks, n), np.uint64)
    for b in range(blocks):
        stripes[b, :k] = padded[b].reshape(k, length)
        rows[b] = native.addresses_of(stripes[b]) + np.arange(n, dtype=np.uint64) * length
    bases = np.array([native.addresses_of(payloads[b]) for b in range(blocks)], np.uint64)
    want_parity = stripes.copy()
    if m:
        want_rows = np.empty_like(rows)
        for b in range(blocks):
            want_rows[b] = (
                native.addresses_of(want_parity[b]) + np.arange(n, dtype=np.uint64) * length
            )
        codec.encode_rows(want_rows, length)
    want_digests = [xxhash.xxh3_128_digest(payloads[b].tobytes()) for b in range(blocks)]
    want_hashes = [
        [xxhash.xxh3_64_intdigest(want_parity[b, i].tobytes()) for i in range(n)]
        for b in range(blocks)
    ]
    digests, hashes = native.encode_hashed(job, k, rows, length, bases, payload_len)
    assert [bytes(d) for d in digests.tolist()] == want_digests
    assert hashes.tolist() == want_hashes
    assert np.array_equal(stripes, want_parity)
    lib = native._LIB
    for kernel in _runnable_kernels():
        f = getattr(lib, f"kv_encode_hashed_{kernel}")
        f.argtypes = lib.kv_encode_hashed.argtypes
        f.restype = None
        stripes[:, k:] = 0
        got_digests = np.empty(blocks, "V16")
        got_hashes = np.zeros((blocks, n), np.uint64)
        if blocks:
            f(
                job.function, length, k, job.outputs, job.tables, blocks,
                native.addresses_of(rows), native.addresses_of(bases), payload_len,
                native.addresses_of(got_digests), native.addresses_of(got_hashes),
            )  # fmt: skip
        assert [bytes(d) for d in got_digests.tolist()] == want_digests, kernel
        assert got_hashes.tolist() == want_hashes, kernel
        assert np.array_equal(stripes, want_parity), kernel


def test_encode_hashed_refuses_rows_of_another_shape() -> None:
    from kvcache.erasure import Backend, ErasureParams, get_codec, isal_available

    if not (native.AVAILABLE and isal_available()):
        pytest.skip("needs the native library and libisal.so.2")
    job = get_codec(ErasureParams(k=10, m=2), Backend.ISAL).encode_job()
    assert job is not None
    with pytest.raises(ValueError, match="rows must be"):
        native.encode_hashed(job, 10, np.zeros((3, 11), np.uint64), 64, np.zeros(3, np.uint64), 640)
    with pytest.raises(ValueError, match="at most 2"):
        native.encode_hashed(job, 10, np.zeros((1, 12), np.uint64), 2**31, np.zeros(1), 2**34)


@needs_native
@settings(max_examples=40, deadline=None)
@given(
    st.binary(min_size=0, max_size=300_000),
    st.integers(1, 70_000),
    st.integers(1, 50_000),
    st.sampled_from([None, b"", b"kvcache:swa-state:v1\x00"]),
)
def test_a_hashed_receive_lands_the_bytes_and_their_digest(
    data: bytes, piece: int, sent_at_once: int, prefix: bytes | None
) -> None:
    """Whatever the sender's write sizes and the receive's piece size: the bytes land, and
    the digest is xxhash's XXH3-128 of the prefix, then the bytes."""
    status, got, out, digest = _send_and_receive_hashed(data, piece, sent_at_once, prefix)
    assert (status, got, out) == (native.RECV_DONE, len(data), data)
    assert digest == (b"" if prefix is None else xxhash.xxh3_128(prefix + data).digest())


def _send_and_receive_hashed(
    data: bytes, piece: int, sent_at_once: int, prefix: bytes | None
) -> tuple[int, int, bytes, bytes]:
    """``data`` sent over a socket pair ``sent_at_once`` bytes a write, from a thread, and
    received with ``native.recv_hashed``: (status, bytes received, what landed, digest)."""
    import threading
    import time

    a, b = socket.socketpair()
    out = bytearray(len(data))

    def send() -> None:
        for at in range(0, len(data), sent_at_once):
            a.sendall(data[at : at + sent_at_once])

    sender = threading.Thread(target=send)
    sender.start()
    try:
        status, got, digest = native.recv_hashed(
            b.fileno(), out, piece=piece, deadline=time.monotonic() + 30, prefix=prefix
        )
    finally:
        sender.join()
        a.close()
        b.close()
    return status, got, bytes(out), digest


@needs_native
def test_a_hashed_receive_reports_a_close_a_stall_and_a_passed_deadline() -> None:
    import struct
    import time

    a, b = socket.socketpair()
    with a, b:
        out = bytearray(1000)
        a.sendall(b"x" * 300)
        # The socket's receive timeout passes with 300 of 1,000 bytes in: -EAGAIN.
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 50_000))
        status, got, digest = native.recv_hashed(
            b.fileno(), out, piece=1000, deadline=time.monotonic() + 30, prefix=b""
        )
        assert (status, got, digest) == (-errno.EAGAIN, 300, b"")
        # The deadline passed before anything was asked: nothing is read.
        a.sendall(b"y" * 100)
        status, got, _ = native.recv_hashed(
            b.fileno(), out, piece=10, deadline=time.monotonic() - 1, prefix=b""
        )
        assert (status, got) == (native.RECV_DEADLINE, 0)
        # The sender closes after 100 bytes: they land, and the close is reported.
        a.shutdown(socket.SHUT_WR)
        status, got, digest = native.recv_hashed(
            b.fileno(), out, piece=1000, deadline=time.monotonic() + 30, prefix=b""
        )
        assert (status, got, digest, bytes(out[:100])) == (
            native.RECV_CLOSED, 100, b"", b"y" * 100
        )  # fmt: skip


@needs_native
@settings(max_examples=12, deadline=None)
@given(
    st.integers(1 << 20, 4 << 20),
    st.sampled_from([4096, 65_536, 131_072, 1 << 20]),
    st.sampled_from([1000, 65_536, 300_000]),
    st.integers(0, 2**32 - 1),
)
def test_a_large_hashed_receive_lands_a_state_and_its_digest(
    size: int, piece: int, sent_at_once: int, seed: int
) -> None:
    """States of V4.1's size (1-4 MiB, more than a socket buffer holds): the bytes land and
    the digest is the one computed in one go, whatever the piece and the sender's write
    sizes."""
    import numpy as np

    data = np.random.default_rng(seed).integers(0, 256, size, np.uint8).tobytes()
    prefix = b"kvcache:swa-state:v1\x00"
    status, got, out, digest = _send_and_receive_hashed(data, piece, sent_at_once, prefix)
    assert (status, got) == (native.RECV_DONE, size) and out == data
    assert digest == xxhash.xxh3_128(prefix + data).digest()


@needs_native
def test_a_large_hashed_receive_that_fails_midway_reports_it_and_returns() -> None:
    """A stall, and a close after 2 MiB of a 3 MiB state, come back as -EAGAIN and
    RECV_CLOSED with what landed, and no digest."""
    import struct
    import time

    size = 3 << 20
    for how in ("stall", "close"):
        a, b = socket.socketpair()
        with a, b:
            a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 100_000))
            out = bytearray(size)
            import threading

            sent = threading.Thread(target=a.sendall, args=(b"z" * (2 << 20),))
            sent.start()
            if how == "close":
                sent.join()
                a.shutdown(socket.SHUT_WR)
            status, got, digest = native.recv_hashed(
                b.fileno(), out, piece=131_072, deadline=time.monotonic() + 30, prefix=b"p"
            )
            sent.join()
            expected = -errno.EAGAIN if how == "stall" else native.RECV_CLOSED
            assert (status, got, digest) == (expected, 2 << 20, b""), how
            assert bytes(out[: 2 << 20]) == b"z" * (2 << 20)


def _quiet_case(n: int, seed: int, spoil: str) -> tuple[Any, ...]:
    """A GET of ``n`` shards and a getmulti answer for it: every shard a quiet hit, then
    one thing spoiled (``spoil``), as the daemon's index could answer; and whether it was
    (a stripe cannot be spoiled for an item that wants any)."""
    from kvcache.server.records import HIT_DTYPE, KEY_LEN, get_key_rows
    from kvcache.wire import Op, make_items

    rng = np.random.default_rng(seed)
    tenant = rng.bytes(8)
    items = make_items(Op.GET, n, reply=False)
    items["key"] = [rng.bytes(16) for _ in range(n)]
    items["index"] = rng.integers(0, 12, n)
    stored_stripes = rng.integers(1, 2**63, n, dtype=np.uint64)
    items["stripe"] = np.where(rng.random(n) < 0.5, stored_stripes, 0)
    raw_keys = get_key_rows(tenant, items)
    hits = np.zeros(n, HIT_DTYPE)
    keys = np.frombuffer(raw_keys, np.uint8).reshape(n, KEY_LEN)
    hits["key"] = keys[:, :24].copy().view("V24").ravel()
    rows = hits["row"]
    rows["index"] = items["index"]
    rows["expiry"] = rng.integers(1_001, 2**32, n)  # whole seconds: 1,001,000 ms on
    rows["stripe"] = stored_stripes
    rows["size"] = rng.integers(104, 20_000, n)
    # Runs: each record follows the last in its segment, or starts a new place.
    rows["seg"] = np.cumsum(rng.random(n) < 0.2) % 3
    jumps = rng.random(n) < 0.3
    off = np.zeros(n, np.int64)
    for j in range(1, n):
        off[j] = (
            off[j - 1] + int(rows["size"][j - 1]) + (int(rng.integers(1, 999)) if jumps[j] else 0)
        )
    rows["off"] = off
    hits["row"] = rows
    j = int(rng.integers(0, n))
    spoiled = spoil != "none" and (spoil != "stripe" or bool(items["stripe"][j]))
    if spoil == "expired":
        hits["row"]["expiry"][j] = 1_000  # s: not after quiet_above (ms)
    elif spoil == "stripe" and items["stripe"][j]:
        items["stripe"][j] = int(items["stripe"][j]) ^ 1
    elif spoil == "key":
        raw = hits.view(np.uint8).reshape(n, -1)
        raw[j, int(rng.integers(0, 24))] ^= 0x10
    elif spoil == "index":
        hits["row"]["index"][j] ^= 1
    found: Any = hits.tobytes()
    if spoil == "short":
        found = found[: -int(rng.integers(1, 60))]
    elif spoil == "extra":
        found = found + found[:60]
    return items, raw_keys, memoryview(found), 1_000_000, spoiled


@needs_native
@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 70),
    st.integers(0, 2**32),
    st.sampled_from(["none", "none", "expired", "stripe", "key", "index", "short", "extra"]),
)
def test_native_quiet_get_equals_the_numpy_one(n: int, seed: int, spoil: str) -> None:
    from kvcache.server.records import quiet_get_numpy
    from kvcache.wire import Op, make_items

    items, raw_keys, found, quiet_above, spoiled = _quiet_case(n, seed, spoil)
    fast_reply = make_items(Op.GET, n, reply=True)
    slow_reply = make_items(Op.GET, n, reply=True)
    fast = native.get_quiet(items, raw_keys, found, quiet_above, fast_reply)
    slow = quiet_get_numpy(items, raw_keys, found, quiet_above, slow_reply)
    assert fast_reply.tobytes() == slow_reply.tobytes()
    assert (slow is None) == spoiled
    if slow is None:
        assert fast is None
        assert not fast_reply.view(np.uint8).any()  # untouched when it falls back
        return
    assert fast is not None
    assert fast[1] == slow[1] == int(fast_reply["length"].sum())
    assert fast[0].tolist() == slow[0].tolist()
    runs = slow[0]  # the runs cover every record, and each starts where no run goes on
    assert int((runs[:, 2] - runs[:, 1]).sum()) == slow[1]
    assert all(
        (s0, e0) != (s1, b1)
        for (s0, _, e0), (s1, b1, _) in zip(runs[:-1].tolist(), runs[1:].tolist(), strict=True)
    )


@needs_native
def test_native_get_keys_equal_the_numpy_ones() -> None:
    from kvcache.server.records import get_key_rows, store_key_rows
    from kvcache.wire import Op, make_items

    rng = np.random.default_rng(7)
    items = make_items(Op.GET, 50, reply=False)
    items["key"] = [rng.bytes(16) for _ in range(50)]
    items["index"] = rng.integers(0, 2**16, 50)
    assert get_key_rows(b"T" * 8, items) == store_key_rows(b"T" * 8, items["key"], items["index"])
