"""The KV layout of one block: how many tokens it holds and how many bytes each costs.

A layout is part of every key's namespace (two layouts never share a key) and
fixes the payload size of a block: ``tokens_per_block × bytes_per_token``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvcache.errors import ConfigError

__all__ = ["DType", "KVLayout", "REFERENCE_LAYOUT"]

#: Upper bound for one block's payload; the wire and shard formats use 32-bit lengths.
MAX_PAYLOAD_BYTES = 1 << 30


class DType(enum.Enum):
    """Element type of the KV tensors; the value is a stable name used in hashing."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT8 = "int8"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DType.FLOAT32: 4,
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.FP8_E4M3: 1,
    DType.FP8_E5M2: 1,
    DType.INT8: 1,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayout:
    """Shape of one cached block.

    ``bytes_per_token`` counts every layer in the block (K and V together), so
    the payload is exactly ``tokens_per_block × bytes_per_token`` bytes.
    """

    tokens_per_block: int
    bytes_per_token: int
    dtype: DType
    layers_in_block: int

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "bytes_per_token", "layers_in_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, DType):
            raise ConfigError(f"KVLayout.dtype must be a DType, got {self.dtype!r}")
        if self.bytes_per_token % self.dtype.itemsize:
            raise ConfigError(
                f"KVLayout.bytes_per_token={self.bytes_per_token} is not a multiple of "
                f"{self.dtype.value}'s item size {self.dtype.itemsize}"
            )
        if self.payload_bytes > MAX_PAYLOAD_BYTES:
            raise ConfigError(
                f"KVLayout payload of {self.payload_bytes} bytes exceeds {MAX_PAYLOAD_BYTES}; "
                "use fewer tokens per block"
            )

    @property
    def payload_bytes(self) -> int:
        """Bytes of one block's payload."""
        return self.tokens_per_block * self.bytes_per_token

    def describe(self) -> str:
        """A stable text form, used in the namespace seed."""
        return (
            f"tpb={self.tokens_per_block};bpt={self.bytes_per_token};"
            f"dtype={self.dtype.value};layers={self.layers_in_block}"
        )


#: The reference deployment's read unit, as DeepSeek V4.1 Flash declares it in vLLM 0.32:
#: one 128-token block of the prefix-cacheable MLA group (4 compressed-KV and 4 indexer-K
#: layers, nvfp4 MLA and the MXFP4 indexer on SM100) of 896 bytes per token, i.e.
#: 112 KiB (114,688 bytes). Its records are packed bytes of several formats, hence
#: ``INT8``. A Mooncake trace's 512-token hash id covers 4 of these blocks
#: (:data:`kvcache.workload.TRACE_BLOCK_TOKENS`).
REFERENCE_LAYOUT = KVLayout(
    tokens_per_block=128, bytes_per_token=896, dtype=DType.INT8, layers_in_block=8
)
