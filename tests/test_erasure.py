"""Tests of kvcache.erasure: every backend against reedsolo, and against each other.

reedsolo is the oracle: ``RSCodec(nsym=m).encode(column)`` of each byte column of a
stripe must give our parity bytes exactly. It is slow (a few MB/s), so the
oracle tests use short shard rows; the backends are then compared with each
other on larger, odd-sized batches. All randomness is seeded.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest
import reedsolo
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache.erasure
from kvcache.erasure import (
    Backend,
    Codec,
    ErasureParams,
    alloc_stripes,
    encode_payloads,
    get_codec,
    gf,
    isal_available,
    numpy_backend,
    payload_view,
)
from kvcache.erasure.codec import plan_rebuild
from kvcache.erasure.isal_backend import IsalCodec
from kvcache.erasure.numpy_backend import NumpyCodec
from kvcache.erasure.numpy_kernels import bit_planes, mul_alpha, weighted_sum
from kvcache.errors import ConfigError, ErasureError, TooManyErasuresError

Stripes = npt.NDArray[np.uint8]

BACKENDS = [
    Backend.NUMPY,
    pytest.param(
        Backend.ISAL,
        marks=pytest.mark.skipif(not isal_available(), reason="libisal.so.2 not installed"),
    ),
]
SETTINGS = settings(derandomize=True, deadline=None, max_examples=60)


# --- helpers and strategies ---------------------------------------------------------------


def random_stripes(params: ErasureParams, blocks: int, length: int, seed: int) -> Stripes:
    """A (blocks, n, length) array with random data rows and garbage parity rows."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (blocks, params.n, length), dtype=np.uint8)


def reedsolo_parity(data: Stripes, m: int) -> Stripes:
    """Parity rows by the oracle: reedsolo on every byte column of every block."""
    rs = reedsolo.RSCodec(nsym=m)
    blocks, k, length = data.shape
    out = np.zeros((blocks, m, length), dtype=np.uint8)
    for b in range(blocks):
        for j in range(length):
            word = rs.encode(bytes(data[b, :, j].tolist()))
            out[b, :, j] = list(word[k:])
    return out


def encoded(codec: Codec, blocks: int, length: int, seed: int) -> Stripes:
    stripes = random_stripes(codec.params, blocks, length, seed)
    codec.encode(stripes)
    return stripes


def erasure_patterns(n: int, most: int) -> Iterator[tuple[int, ...]]:
    for count in range(most + 1):
        yield from itertools.combinations(range(n), count)


@st.composite
def small_params(draw: st.DrawFn, max_k: int = 12, max_m: int = 5) -> ErasureParams:
    return ErasureParams(k=draw(st.integers(1, max_k)), m=draw(st.integers(1, max_m)))


# --- the field and the matrices -------------------------------------------------------------


def test_reedsolo_defaults_are_the_field_we_implement() -> None:
    rs = reedsolo.RSCodec(nsym=2)
    assert (rs.prim, rs.generator, rs.fcr, rs.c_exp) == (gf.PRIM, gf.GENERATOR, gf.FCR, 8)


@pytest.mark.parametrize(("k", "m"), [(10, 2), (4, 3), (1, 1), (20, 4), (1, 5), (200, 55)])
def test_parity_matrix_is_reedsolo_on_unit_vectors(k: int, m: int) -> None:
    rs = reedsolo.RSCodec(nsym=m)
    expected = np.array(
        [list(rs.encode(bytes(int(i == j) for i in range(k)))[k:]) for j in range(k)],
        dtype=np.uint8,
    )
    assert np.array_equal(gf.parity_matrix(k, m), expected)


def test_parity_matrix_golden_10_2() -> None:
    # Pinned: changing these changes every parity byte ever stored.
    p = gf.parity_matrix(10, 2)
    assert p[:, 0].tolist() == [172, 216, 226, 255, 127, 63, 31, 15, 7, 3]
    assert p[:, 1].tolist() == [173, 217, 227, 254, 126, 62, 30, 14, 6, 2]
    # p0 + p1 is the XOR of the data (1 is a root of the generator polynomial).
    assert (p[:, 0] ^ p[:, 1]).tolist() == [1] * 10


def test_field_inverse_and_matrix_inverse() -> None:
    for a in range(1, 256):
        assert gf.gf_mul(a, gf.gf_inv(a)) == 1
    g = gf.generator_matrix(10, 2)
    rows = g[[0, 1, 2, 3, 5, 6, 7, 9, 10, 11]]
    assert np.array_equal(gf.mat_mul(gf.mat_inv(rows), rows), np.eye(10, dtype=np.uint8))
    with pytest.raises(ErasureError, match="singular"):
        gf.mat_inv(np.zeros((3, 3), dtype=np.uint8))


def test_mul_alpha_every_byte() -> None:
    acc = np.arange(256, dtype=np.uint8).view(np.int8).copy()
    mul_alpha(acc, np.empty_like(acc))
    assert acc.view(np.uint8).tolist() == [gf.gf_mul(2, a) for a in range(256)]


@SETTINGS
@given(
    coeffs=st.lists(st.integers(0, 255), min_size=1, max_size=12),
    seed=st.integers(0, 2**32 - 1),
)
def test_weighted_sum_is_the_field_dot_product(coeffs: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 256, (len(coeffs), 3, 17), dtype=np.uint8)
    out = np.empty((3, 17), dtype=np.uint8)
    scratch = np.empty((2, 3, 17), dtype=np.int8)
    signed = rows.view(np.int8)
    weighted_sum(out.view(np.int8), list(signed), bit_planes(coeffs), scratch[0], scratch[1])
    expected = np.zeros((3, 17), dtype=np.uint8)
    for c, row in zip(coeffs, rows, strict=True):
        expected ^= np.vectorize(lambda v, c=c: gf.gf_mul(c, int(v)), otypes=[np.uint8])(row)
    assert np.array_equal(out, expected)


def test_rebuild_plan_reads_the_k_lowest_present_shards() -> None:
    params = ErasureParams(k=4, m=3)
    plan = plan_rebuild(params, [6, 5, 0, 2, 3, 2])
    assert plan.sources == (0, 2, 3, 5)
    assert plan.targets == (1,)
    plan = plan_rebuild(params, [0, 1, 2, 4, 6], rows=[6, 5, 1, 3])
    assert plan.sources == (0, 1, 2, 4)
    assert plan.targets == (3, 5)  # 1 and 6 are present: left alone
    assert plan_rebuild(params, range(7)).targets == ()


# --- agreement with reedsolo ----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(
    params=small_params(),
    blocks=st.integers(1, 3),
    length=st.integers(1, 24),
    seed=st.integers(0, 2**32 - 1),
)
def test_encode_matches_reedsolo_per_column(
    backend: Backend, params: ErasureParams, blocks: int, length: int, seed: int
) -> None:
    stripes = encoded(get_codec(params, backend), blocks, length, seed)
    assert np.array_equal(stripes[:, params.k :], reedsolo_parity(stripes[:, : params.k], params.m))


@pytest.mark.parametrize("backend", BACKENDS)
def test_10_2_every_pattern_of_up_to_two_erasures(backend: Backend) -> None:
    """All 79 patterns (none, 12 single, 66 double) rebuild the exact bytes."""
    params = ErasureParams()
    codec = get_codec(params, backend)
    original = encoded(codec, blocks=4, length=96, seed=1)
    assert np.array_equal(original[:, 10:], reedsolo_parity(original[:, :10], 2))
    patterns = list(erasure_patterns(params.n, params.m))
    assert len(patterns) == 79
    for lost in patterns:
        present = [i for i in range(params.n) if i not in lost]
        # Every lost row, parity included.
        stripes = original.copy()
        stripes[:, list(lost)] = 0xA5
        codec.reconstruct(stripes, present, rows=list(lost))
        assert np.array_equal(stripes, original), lost
        # Default: only the lost data rows, and nothing else is touched.
        stripes = original.copy()
        stripes[:, list(lost)] = 0x5A
        codec.reconstruct(stripes, present)
        expected = original.copy()
        expected[:, [i for i in lost if i >= params.k]] = 0x5A
        assert np.array_equal(stripes, expected), lost


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("k", "m", "sample"), [(4, 3, 0), (1, 1, 0), (3, 4, 0), (20, 4, 400)])
def test_every_pattern_of_up_to_m_erasures(backend: Backend, k: int, m: int, sample: int) -> None:
    """Exhaustive for small codes; a seeded sample of the 12951 patterns of 20 + 4."""
    params = ErasureParams(k=k, m=m)
    codec = get_codec(params, backend)
    original = encoded(codec, blocks=2, length=33, seed=k * 100 + m)
    patterns = list(erasure_patterns(params.n, m))
    if sample:
        rng = np.random.default_rng(sample)
        patterns = [patterns[i] for i in rng.choice(len(patterns), sample, replace=False)]
    for lost in patterns:
        stripes = original.copy()
        stripes[:, list(lost)] = 0xFF
        codec.reconstruct(stripes, [i for i in range(params.n) if i not in lost], rows=list(lost))
        assert np.array_equal(stripes, original), lost


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(params=small_params(), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_any_k_shards_rebuild_the_block(
    backend: Backend, params: ErasureParams, seed: int, data: st.DataObject
) -> None:
    codec = get_codec(params, backend)
    original = encoded(codec, blocks=2, length=40, seed=seed)
    present = data.draw(
        st.lists(st.integers(0, params.n - 1), min_size=params.k, unique=True), label="present"
    )
    stripes = original.copy()
    lost = [i for i in range(params.n) if i not in present]
    stripes[:, lost] = 0
    codec.reconstruct(stripes, present, rows=range(params.n))
    assert np.array_equal(stripes, original)


# --- the two backends agree -----------------------------------------------------------------

needs_isal = pytest.mark.skipif(not isal_available(), reason="libisal.so.2 not installed")


@needs_isal
@SETTINGS
@given(
    shape=st.sampled_from([(10, 2), (4, 3), (1, 1), (20, 4), (7, 1), (2, 9)]),
    blocks=st.integers(1, 9),
    length=st.integers(1, 300),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_backends_agree_byte_for_byte(
    shape: tuple[int, int],
    blocks: int,
    length: int,
    seed: int,
    data: st.DataObject,
) -> None:
    params = ErasureParams(k=shape[0], m=shape[1])
    fast, slow = get_codec(params, Backend.ISAL), get_codec(params, Backend.NUMPY)
    a = random_stripes(params, blocks, length, seed)
    b = a.copy()
    fast.encode(a)
    slow.encode(b)
    assert np.array_equal(a, b)
    # Rebuild from random (non-codeword) bytes: both read the same k sources, so they
    # must still agree exactly.
    present = data.draw(st.lists(st.integers(0, params.n - 1), min_size=params.k, unique=True))
    rows = data.draw(st.lists(st.integers(0, params.n - 1), unique=True))
    a = random_stripes(params, blocks, length, seed + 1)
    b = a.copy()
    fast.reconstruct(a, present, rows=rows)
    slow.reconstruct(b, present, rows=rows)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("k", "m"), [(10, 2), (4, 3)])
def test_many_tiles_and_split_rows(
    backend: Backend, k: int, m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tiny numpy tiles: blocks grouped into tiles, and long rows split into column tiles."""
    monkeypatch.setattr(numpy_backend, "TILE_BYTES", 256)
    params = ErasureParams(k=k, m=m)
    codec = get_codec(params, backend)
    for blocks, length in [(9, 100), (2, 1000)]:
        original = encoded(codec, blocks, length, seed=blocks)
        assert np.array_equal(original[:, k:], reedsolo_parity(original[:, :k], m))
        stripes = original.copy()
        stripes[:, [0, k]] = 0
        codec.reconstruct(stripes, list(range(1, k)) + list(range(k + 1, k + m)), rows=[0, k])
        assert np.array_equal(stripes, original)


# --- errors and the no-op path ----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_than_m_erasures_raise(backend: Backend) -> None:
    params = ErasureParams()
    codec = get_codec(params, backend)
    stripes = encoded(codec, 1, 64, seed=3)
    for lost in [(0, 1, 2), (0, 10, 11), (9, 10, 11, 3)]:
        present = [i for i in range(params.n) if i not in lost]
        with pytest.raises(TooManyErasuresError, match="at least k=10") as info:
            codec.reconstruct(stripes, present)
        assert (info.value.needed, info.value.available) == (10, len(present))
    # Duplicates do not count twice.
    with pytest.raises(TooManyErasuresError):
        codec.reconstruct(stripes, [0] * 5 + list(range(1, 9)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_requested_rows_present_does_no_work(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = ErasureParams()
    codec = get_codec(params, backend)
    stripes = random_stripes(params, 3, 64, seed=4)  # not even a codeword
    before = stripes.copy()

    def forbidden(*args: object) -> None:
        raise AssertionError("reconstruct did field arithmetic with nothing to rebuild")

    monkeypatch.setattr(codec, "_rebuild", forbidden)
    codec.reconstruct(stripes, range(10))
    codec.reconstruct(stripes, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11])
    codec.reconstruct(stripes, [0, 1, 2, 3, 4, 5, 6, 7, 10, 11], rows=[0, 10])
    assert np.array_equal(stripes, before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_raise_erasure_error(backend: Backend) -> None:
    params = ErasureParams(k=4, m=2)
    codec = get_codec(params, backend)
    good = np.zeros((2, 6, 64), dtype=np.uint8)
    bad_arrays: list[object] = [
        good.astype(np.uint16),
        np.zeros((6, 64), dtype=np.uint8),
        np.zeros((2, 5, 64), dtype=np.uint8),
        np.zeros((2, 6, 128), dtype=np.uint8)[:, :, ::2],
        b"\0" * 768,
    ]
    readonly = good.copy()
    readonly.flags.writeable = False
    bad_arrays.append(readonly)
    for bad in bad_arrays:
        with pytest.raises(ErasureError):
            codec.encode(bad)  # type: ignore[arg-type]
        with pytest.raises(ErasureError):
            codec.reconstruct(bad, range(6))  # type: ignore[arg-type]
    for present in [[0, 1, 2, 6], [-1, 0, 1, 2], [0, 1, 2, "3"], "0123", 7]:
        with pytest.raises(ErasureError):
            codec.reconstruct(good, present)  # type: ignore[arg-type]
    with pytest.raises(ErasureError):
        codec.reconstruct(good, [0, 1, 2, 4], rows=[6])
    # Empty batches and empty rows are fine and do nothing.
    codec.encode(np.zeros((0, 6, 64), dtype=np.uint8))
    codec.encode(np.zeros((2, 6, 0), dtype=np.uint8))
    codec.reconstruct(np.zeros((0, 6, 64), dtype=np.uint8), [1, 2, 3, 4])


# --- params, backend choice, public names ---------------------------------------------------


def test_params_defaults_and_shard_len() -> None:
    p = ErasureParams()
    assert (p.k, p.m, p.n, p.alignment) == (10, 2, 12, 64)
    assert p.shard_len(114688) == 11520  # ceil(11468.8) = 11469 -> 11520
    assert p.shard_len(1) == 64
    assert p.shard_len(640) == 64
    assert p.shard_len(641) == 128
    assert ErasureParams(k=3, m=1, alignment=1).shard_len(10) == 4
    for bad_len in [0, -5]:
        with pytest.raises(ErasureError):
            p.shard_len(bad_len)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"k": 0},
        {"m": 0},
        {"k": 250, "m": 6},
        {"alignment": 0},
        {"alignment": 48},
        {"k": 2.0},
        {"m": True},
        {"alignment": "64"},
    ],
)
def test_params_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ErasureParams(**kwargs)  # type: ignore[arg-type]


def test_params_are_frozen_keyword_only_and_hashable() -> None:
    p = ErasureParams(k=4, m=2)
    with pytest.raises(AttributeError):
        p.k = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        ErasureParams(4, 2)  # type: ignore[call-arg]
    assert {p: 1}[ErasureParams(k=4, m=2)] == 1


def test_get_codec_explicit_numpy_and_caching() -> None:
    codec = get_codec(ErasureParams(k=4, m=2), Backend.NUMPY)
    assert isinstance(codec, NumpyCodec)
    assert codec.backend is Backend.NUMPY
    assert codec.params == ErasureParams(k=4, m=2)
    assert get_codec(ErasureParams(k=4, m=2), Backend.NUMPY) is codec
    with pytest.raises(ErasureError):
        get_codec(ErasureParams(), "numpy")  # type: ignore[arg-type]


def test_get_codec_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHE_ERASURE_BACKEND", "numpy")
    assert get_codec().backend is Backend.NUMPY
    monkeypatch.setenv("KVCACHE_ERASURE_BACKEND", "auto")
    assert get_codec().backend is (Backend.ISAL if isal_available() else Backend.NUMPY)
    monkeypatch.setenv("KVCACHE_ERASURE_BACKEND", "ISAL")
    if isal_available():
        assert get_codec().backend is Backend.ISAL
    else:
        with pytest.raises(ErasureError, match="apt-get install libisal2"):
            get_codec()
    monkeypatch.setenv("KVCACHE_ERASURE_BACKEND", "gpu")
    with pytest.raises(ConfigError, match="KVCACHE_ERASURE_BACKEND"):
        get_codec()
    # An explicit backend wins over the environment.
    assert get_codec(backend=Backend.NUMPY).backend is Backend.NUMPY


def test_missing_isal_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCACHE_ERASURE_BACKEND", raising=False)
    monkeypatch.setenv("KVCACHE_ISAL_LIBRARY", "libisal-does-not-exist.so.2")
    assert not isal_available()
    assert get_codec().backend is Backend.NUMPY
    with pytest.raises(ErasureError, match="apt-get install libisal2"):
        get_codec(backend=Backend.ISAL)


def test_isal_backend_present_in_ci() -> None:
    """In CI a broken ISA-L binding must fail loudly, not fall back to numpy."""
    if os.environ.get("CI") != "true":
        pytest.skip("only enforced in CI")
    assert isal_available()
    codec = get_codec()
    assert codec.backend is Backend.ISAL
    assert isinstance(codec, IsalCodec)


def test_public_names_are_pinned() -> None:
    assert sorted(kvcache.erasure.__all__) == [
        "Backend",
        "Codec",
        "EncodeJob",
        "ErasureParams",
        "alloc_stripes",
        "encode_payloads",
        "get_codec",
        "isal_available",
        "payload_view",
    ]
    for name in kvcache.erasure.__all__:
        assert getattr(kvcache.erasure, name) is not None
    assert [b.value for b in Backend] == ["isal", "numpy"]


# --- payload helpers -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_encode_payloads_round_trip(backend: Backend) -> None:
    params = ErasureParams()
    codec = get_codec(params, backend)
    rng = np.random.default_rng(7)
    payloads: list[bytes | memoryview | npt.NDArray[np.generic]] = [
        rng.integers(0, 256, 1000, dtype=np.uint8).tobytes(),
        memoryview(bytearray(rng.integers(0, 256, 777, dtype=np.uint8).tobytes())),
        rng.standard_normal(50).astype(np.float16),
    ]
    stripes = encode_payloads(codec, payloads)
    assert stripes.shape == (3, 12, params.shard_len(1000))
    assert stripes.ctypes.data % 64 == 0
    assert np.array_equal(stripes[:, 10:], reedsolo_parity(stripes[:, :10], 2))
    for b, p in enumerate(payloads):
        raw = p.view(np.uint8) if isinstance(p, np.ndarray) else np.frombuffer(p, dtype=np.uint8)
        view = payload_view(stripes, b, raw.size, params=params)
        assert np.shares_memory(view, stripes)
        assert np.array_equal(view, raw)
        assert not stripes[b, :10].reshape(-1)[raw.size :].any()  # zero padding
    lost = stripes.copy()
    lost[:, [2, 7]] = 0
    codec.reconstruct(lost, [0, 1, 3, 4, 5, 6, 8, 9, 10, 11])
    assert np.array_equal(lost, stripes)
    assert encode_payloads(codec, []).shape == (0, 12, 0)
    with pytest.raises(ErasureError):
        encode_payloads(codec, [b"x", b""])
    with pytest.raises(ErasureError):
        payload_view(stripes, 3, 10)
    with pytest.raises(ErasureError):
        payload_view(stripes, 0, 10 * stripes.shape[2] + 1, params=params)


def test_alloc_stripes_is_aligned_and_zeroed() -> None:
    params = ErasureParams(k=3, m=2)
    for blocks in range(1, 5):
        stripes = alloc_stripes(params, blocks, 192)
        assert stripes.shape == (blocks, 5, 192)
        assert stripes.ctypes.data % 64 == 0
        assert stripes.flags.c_contiguous and stripes.flags.writeable
        assert not stripes.any()


@pytest.mark.parametrize("backend", [Backend.NUMPY, Backend.ISAL])
def test_rebuild_only_chosen_blocks(backend: Backend) -> None:
    if backend is Backend.ISAL and not isal_available():
        pytest.skip("libisal2 not installed (CI enforces it separately)")
    codec = get_codec(ErasureParams(), backend)
    rng = np.random.default_rng(11)
    stripes = np.zeros((6, 12, 256), np.uint8)
    stripes[:, :10] = rng.integers(0, 256, (6, 10, 256), dtype=np.uint8)
    codec.encode(stripes)
    original = stripes.copy()
    damaged = stripes.copy()
    damaged[:, [2, 5]] = 0xAA
    codec.reconstruct(damaged, [0, 1, 3, 4, 6, 7, 8, 9, 10, 11], blocks=[1, 4])
    assert np.array_equal(damaged[[1, 4]], original[[1, 4]])
    untouched = [0, 2, 3, 5]
    assert (damaged[untouched][:, [2, 5]] == 0xAA).all()
    with pytest.raises(ErasureError):
        codec.reconstruct(damaged, list(range(10)), rows=[10], blocks=[6])


@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(
    params=small_params(),
    blocks=st.integers(1, 4),
    length=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_reconstruct_rows_rebuilds_rows_scattered_in_memory(
    backend: Backend,
    params: ErasureParams,
    blocks: int,
    length: int,
    seed: int,
    data: st.DataObject,
) -> None:
    """Rows at arbitrary addresses (each its own array, in shuffled order) come back with
    the exact bytes, and rows not asked for are not written."""
    codec = get_codec(params, backend)
    original = encoded(codec, blocks, length, seed)
    lost = data.draw(st.sets(st.integers(0, params.n - 1), max_size=params.m))
    present = [i for i in range(params.n) if i not in lost]
    rng = np.random.default_rng(seed)
    cells = [[original[b, i].copy() for i in range(params.n)] for b in range(blocks)]
    for b in range(blocks):
        for i in lost:
            cells[b][i][:] = rng.integers(0, 256, length, dtype=np.uint8)
    before = [[c.copy() for c in row] for row in cells]
    rows = np.array([[c.ctypes.data for c in row] for row in cells], np.uint64)
    written = codec.reconstruct_rows(rows, length, present, targets=sorted(lost))
    assert set(written) == set(lost)
    for b in range(blocks):
        for i in range(params.n):
            want = original[b, i] if i in lost else before[b][i]
            assert np.array_equal(cells[b][i], want), (b, i)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("native_loop", [True, False])
@SETTINGS
@given(
    params=small_params(),
    length=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_reconstruct_rows_many_rebuilds_each_block_by_its_own_pattern(
    backend: Backend,
    native_loop: bool,
    params: ErasureParams,
    length: int,
    seed: int,
    data: st.DataObject,
) -> None:
    """A batch whose blocks lost different shards (some more than m) in one call: each
    block with k rows present gets exactly its missing data rows back, and nothing else is
    written, with ISA-L run by the native loop or one ctypes call a block."""
    from kvcache import native

    codec = get_codec(params, backend)
    blocks = data.draw(st.integers(1, 8))
    original = encoded(codec, blocks, length, seed)
    lost = [
        data.draw(st.sets(st.integers(0, params.n - 1), max_size=params.m + 1))
        for _ in range(blocks)
    ]
    present = np.array([[i not in lost[b] for i in range(params.n)] for b in range(blocks)])
    rng = np.random.default_rng(seed)
    cells = [[original[b, i].copy() for i in range(params.n)] for b in range(blocks)]
    for b in range(blocks):
        for i in lost[b]:
            cells[b][i][:] = rng.integers(0, 256, length, dtype=np.uint8)
    before = [[c.copy() for c in row] for row in cells]
    rows = np.array([[c.ctypes.data for c in row] for row in cells], np.uint64)
    saved = native._LIB
    if not native_loop:
        native._LIB = None
    try:
        written = codec.reconstruct_rows_many(rows, length, present)
    finally:
        native._LIB = saved
    for b in range(blocks):
        rebuilt = set() if len(lost[b]) > params.m else lost[b] & set(range(params.k))
        assert set(np.flatnonzero(written[b]).tolist()) == rebuilt, (b, lost[b])
        for i in range(params.n):
            want = original[b, i] if i in rebuilt else before[b][i]
            assert np.array_equal(cells[b][i], want), (b, i)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reconstruct_rows_many_with_more_rows_than_a_mask_holds(backend: Backend) -> None:
    """Stripes of more than 62 rows (k + m may reach 255) are rebuilt one call per pattern."""
    params = ErasureParams(k=60, m=10)
    codec = get_codec(params, backend)
    original = encoded(codec, 6, 16, seed=3)
    rng = np.random.default_rng(3)
    stripes = original.copy()
    present = np.ones((6, params.n), bool)
    for b in range(6):
        lost = rng.choice(params.n, size=10, replace=False)
        present[b, lost] = False
        stripes[b, lost] = 0
    base = stripes.ctypes.data
    rows = base + (np.arange(6)[:, None] * params.n + np.arange(params.n)[None, :]).astype(
        np.uint64
    ) * np.uint64(16)
    written = codec.reconstruct_rows_many(rows.astype(np.uint64), 16, present)
    assert (written == (~present & (np.arange(params.n) < params.k))).all()
    assert np.array_equal(stripes[:, : params.k], original[:, : params.k])


def test_reconstruct_rows_many_checks_its_arguments() -> None:
    codec = get_codec(ErasureParams(k=3, m=2), Backend.NUMPY)
    rows = np.zeros((2, 5), np.uint64)
    with pytest.raises(ErasureError, match="shape"):
        codec.reconstruct_rows_many(np.zeros((2, 4), np.uint64), 8, np.ones((2, 4), bool))
    with pytest.raises(ErasureError, match="present"):
        codec.reconstruct_rows_many(rows, 8, np.ones((2, 5), np.uint8))  # type: ignore[arg-type]
