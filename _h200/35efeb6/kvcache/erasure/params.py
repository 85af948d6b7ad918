"""The shape of a stripe: how many data and parity shards, and how shards are aligned."""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.erasure.gf import MAX_SHARDS
from kvcache.errors import ConfigError, ErasureError

__all__ = ["ErasureParams"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ErasureParams:
    """Parameters of a systematic k + m Reed–Solomon stripe over GF(2^8).

    A block's payload is cut into ``k`` equal data shards and ``m`` parity shards are
    computed from them; any ``k`` of the ``n = k + m`` shards rebuild the block.
    ``alignment`` is the byte multiple every shard length is rounded up to, so shard
    rows start on SIMD- and cache-line boundaries inside a stripe array.
    """

    k: int = 10
    m: int = 2
    alignment: int = 64

    def __post_init__(self) -> None:
        for name in ("k", "m", "alignment"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"ErasureParams.{name} must be an int, got {value!r}")
        if self.k < 1:
            raise ConfigError(f"ErasureParams.k must be >= 1, got {self.k}")
        if self.m < 1:
            raise ConfigError(f"ErasureParams.m must be >= 1, got {self.m}")
        if self.k + self.m > MAX_SHARDS:
            raise ConfigError(
                f"ErasureParams.k + m must be <= {MAX_SHARDS} over GF(2^8), "
                f"got k={self.k}, m={self.m}"
            )
        if self.alignment < 1 or self.alignment & (self.alignment - 1):
            raise ConfigError(
                f"ErasureParams.alignment must be a power of two >= 1, got {self.alignment}"
            )

    @property
    def n(self) -> int:
        """Shards per stripe: k data + m parity."""
        return self.k + self.m

    def shard_len(self, payload_len: int) -> int:
        """Bytes per shard for a payload: ceil(payload_len / k) rounded up to alignment.

        The last data shard is zero-padded; the payload length is kept elsewhere (in
        the shard header) to strip the padding on read. A non-positive length raises
        :class:`ErasureError`: there is no stripe for an empty block.
        """
        if not isinstance(payload_len, int) or isinstance(payload_len, bool) or payload_len <= 0:
            raise ErasureError(f"payload_len must be a positive int, got {payload_len!r}")
        per_shard = -(-payload_len // self.k)
        return -(-per_shard // self.alignment) * self.alignment
