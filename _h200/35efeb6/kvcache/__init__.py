"""kvcache: distributed KV-cache storage for LLM inference.

Prefix-hashed KV blocks striped 10 + 2 with Reed–Solomon over storage daemons,
read by hedged fetches. See ``docs/architecture.md``.
"""

from kvcache.keys import BlockKey, Namespace, block_keys
from kvcache.layout import REFERENCE_LAYOUT, DType, KVLayout

__all__ = ["REFERENCE_LAYOUT", "BlockKey", "DType", "KVLayout", "Namespace", "block_keys"]
__version__ = "0.1.0"
