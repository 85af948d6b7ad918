"""KV layout: payload size, validation, and the 112 KiB reference preset."""

from __future__ import annotations

import pytest

from kvcache.errors import ConfigError
from kvcache.layout import REFERENCE_LAYOUT, DType, KVLayout


def test_reference_layout_is_v41_flash_mla_block() -> None:
    # DeepSeek V4.1 Flash's MLA group in vLLM 0.32 (SM100, nvfp4 MLA, MXFP4 indexer):
    # 128-token blocks of 896 bytes per token, 112 KiB.
    assert REFERENCE_LAYOUT.payload_bytes == 112 * 1024 == 114_688
    assert (REFERENCE_LAYOUT.tokens_per_block, REFERENCE_LAYOUT.bytes_per_token) == (128, 896)


def test_payload_is_tokens_times_bytes() -> None:
    layout = KVLayout(
        tokens_per_block=16, bytes_per_token=4096, dtype=DType.BFLOAT16, layers_in_block=1
    )
    assert layout.payload_bytes == 65536


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tokens_per_block=0, bytes_per_token=2, dtype=DType.FLOAT16, layers_in_block=1),
        dict(tokens_per_block=4, bytes_per_token=3, dtype=DType.FLOAT16, layers_in_block=1),
        dict(tokens_per_block=4, bytes_per_token=2, dtype="float16", layers_in_block=1),
        dict(tokens_per_block=4, bytes_per_token=2, dtype=DType.FLOAT16, layers_in_block=True),
        dict(
            tokens_per_block=1 << 20, bytes_per_token=4096, dtype=DType.FLOAT32, layers_in_block=1
        ),
    ],
)
def test_invalid_layouts(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        KVLayout(**kwargs)  # type: ignore[arg-type]


def test_dtype_sizes() -> None:
    assert [d.itemsize for d in DType] == [4, 2, 2, 1, 1, 1]
