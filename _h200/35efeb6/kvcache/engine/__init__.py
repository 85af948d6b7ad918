"""Engine adapters: paged KV caches on GPU/NPU/CPU through torch, a vLLM KV connector
and an SGLang HiCache storage backend. torch is needed; vLLM and SGLang are imported lazily."""

from kvcache.engine.paged import PagedKVAdapter, TransferHandle, kv_dtype

__all__ = ["PagedKVAdapter", "TransferHandle", "kv_dtype"]
