"""Paged KV adapter on CPU tensors: gather/scatter round trips across layouts and dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache.engine import PagedKVAdapter
from kvcache.errors import ConfigError

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.uint8]


def make_caches(
    layers: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        # Reinterpret random bytes as the dtype: the adapter treats tiles as opaque bytes.
        out.append(
            raw.view(torch.uint8).view(-1).view(dtype).reshape(*shape[:-1], -1)
            if dtype != torch.uint8
            else raw
        )
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "block_dim"),
    [
        ((40, 2, 16, 64), 0),  # vLLM CPU/TPU-like: [num_blocks, kv_heads, block_size, 2*head]
        ((40, 16, 2, 32), 0),  # [num_blocks, block_size, heads, head]
        ((2, 40, 16, 2, 32), 1),  # FlashAttention-like: [2, num_blocks, block_size, heads, head]
    ],
)
@pytest.mark.parametrize("pages_per_block", [1, 3])
def test_gather_scatter_round_trip(
    dtype: torch.dtype, shape: tuple[int, ...], block_dim: int, pages_per_block: int
) -> None:
    src = make_caches(3, shape, dtype, seed=1)
    dst = [torch.zeros_like(t) for t in src]
    a = PagedKVAdapter(
        src,
        page_tokens=16,
        pages_per_block=pages_per_block,
        block_dim=block_dim,
        staging_bytes=1 << 16,
    )
    b = PagedKVAdapter(dst, page_tokens=16, pages_per_block=pages_per_block, block_dim=block_dim)
    assert a.payload_bytes == b.payload_bytes
    g = torch.Generator().manual_seed(2)
    blocks = 7
    pages = torch.randperm(40, generator=g)[: blocks * pages_per_block].view(
        blocks, pages_per_block
    )
    other = torch.randperm(40, generator=g)[: blocks * pages_per_block].view(
        blocks, pages_per_block
    )
    handle = a.gather(pages)
    handle.synchronize()
    payloads = handle.host
    assert payloads.shape == (blocks, a.payload_bytes)
    b.scatter(payloads, other).synchronize()
    for s_layer, d_layer in zip(src, dst, strict=True):
        s_u8 = s_layer.view(torch.uint8)
        d_u8 = d_layer.view(torch.uint8)
        for blk in range(blocks):
            for p in range(pages_per_block):
                sp, dp = int(pages[blk, p]), int(other[blk, p])
                if block_dim == 0:
                    assert torch.equal(s_u8[sp], d_u8[dp])
                else:
                    assert torch.equal(s_u8[:, sp], d_u8[:, dp])
    # Pages not scattered into stay untouched.
    untouched = sorted(set(range(40)) - set(other.view(-1).tolist()))
    for d_layer in dst:
        d_u8 = d_layer.view(torch.uint8)
        sel = d_u8[untouched] if block_dim == 0 else d_u8[:, untouched]
        assert int(sel.count_nonzero()) == 0


def test_payload_is_layer_major_bytes() -> None:
    caches = make_caches(2, (10, 4, 8), torch.float32, seed=3)
    a = PagedKVAdapter(caches, page_tokens=4, pages_per_block=2)
    h = a.gather([[5, 2]])
    h.synchronize()
    expected = torch.cat(
        [caches[layer][p].reshape(-1).view(torch.uint8) for layer in (0, 1) for p in (5, 2)]
    )
    assert torch.equal(h.host[0], expected)
    layout = a.kv_layout()
    assert layout.tokens_per_block == 8 and layout.layers_in_block == 2
    assert layout.payload_bytes == a.payload_bytes


def test_bad_inputs_raise_config_error() -> None:
    caches = make_caches(2, (10, 4, 8), torch.float32, seed=4)
    a = PagedKVAdapter(caches, page_tokens=4)
    with pytest.raises(ConfigError):
        a.gather([[10]])
    with pytest.raises(ConfigError):
        a.gather([[1, 2]])
    with pytest.raises(ConfigError):
        a.scatter(torch.zeros((1, 5), dtype=torch.uint8), [[1]])
    with pytest.raises(ConfigError):
        PagedKVAdapter([caches[0], caches[1][:5]], page_tokens=4)
    with pytest.raises(ConfigError):
        PagedKVAdapter([], page_tokens=4)


def test_float_ids_read_only_hosts_and_empty_caches_are_refused() -> None:
    """Each was accepted: float page ids were truncated to other pages, a gather wrote into
    a read-only array (an immutable bytes object among them), and caches without pages
    raised a bare ZeroDivisionError."""
    caches = make_caches(2, (10, 4, 8), torch.float32, seed=5)
    a = PagedKVAdapter(caches, page_tokens=4)
    for ids in ([[2.7]], np.array([[5.99]]), torch.tensor([[1.0]]), [[True]]):
        with pytest.raises(ConfigError, match="integers"):
            a.gather(ids)
    assert a.gather(np.array([[3]], np.int32)).host.shape == (1, a.payload_bytes)
    frozen = np.frombuffer(bytes(2 * a.payload_bytes), np.uint8).reshape(2, a.payload_bytes)
    with pytest.raises(ConfigError, match="read-only"):
        a.pin_host(frozen)
    for shape in ((0, 4, 8), (10, 0, 8)):
        with pytest.raises(ConfigError, match="no pages"):
            PagedKVAdapter([torch.zeros(shape), torch.zeros(shape)], page_tokens=4)
