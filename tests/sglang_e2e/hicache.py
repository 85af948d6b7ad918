"""Runs in the SGLang venv (``scripts/sglang-venv.sh``): kvcache's HiCache backend through
SGLang's own interfaces.

What is SGLang's own here: ``HiCacheStorageConfig`` (the config SGLang's cache controller
builds), the ``HiCacheStorage`` ABC the backend must derive from, and
``StorageBackendFactory.create_backend("dynamic", ...)`` (the loader behind
``--hicache-storage-backend dynamic``: it imports ``module_path``, checks the class is a
``HiCacheStorage`` subclass and builds it with ``(storage_config, kwargs)``).

The host pool is SGLang's too: ``MHATokenToKVPoolHost`` (layer-first), built on the CPU
from an ``MHABufferInfo`` that describes CPU "device" K/V buffers, as SGLang's
``MHATokenToKVPool`` would describe its GPU ones. What does not run: the device pool itself
and the transfers between it and the host pool (SGLang's JIT/CUDA kernels), the cache
controller's threads, the radix tree and the scheduler; so the backend's calls are made
here in the order the controller makes them (register the pool, write pages, check
existence, read pages).

Usage: python hicache.py SPEC.json OUT.json
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory


def host_pool(seed: int, *, tokens: int = 256, page: int = 16) -> Any:
    """SGLang's layer-first MHA host pool over CPU 'device' buffers (4 layers, 2 heads, 64)."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    layers, heads, dim = 4, 2, 64
    k = tuple(torch.zeros(tokens, heads, dim, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(tokens, heads, dim, dtype=torch.bfloat16) for _ in range(layers))
    ptrs = [torch.tensor([t.data_ptr() for t in x], dtype=torch.uint64) for x in (k, v)]
    buffers = KVBuffers(
        k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1], layout=KVBufferLayout.NHD
    )
    info = MHABufferInfo(
        buffers=buffers, page_size=page, head_num=heads, head_dim=dim, v_head_dim=dim,
        dtype=torch.bfloat16, device=torch.device("cpu"),
    )  # fmt: skip
    pool = MHATokenToKVPoolHost(
        info, 2.0, 0, page, "layer_first", pin_memory=False, device="cpu",
        device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.kv_buffer.dtype))
    return pool


def config(spec: dict[str, Any], *, is_mla: bool) -> HiCacheStorageConfig:
    """The config SGLang's HiCacheController builds, with kvcache's extra config."""
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="test/sglang-real",
        extra_config={
            "backend_name": "kvcache",
            "module_path": "kvcache.engine.sglang_backend",
            "class_name": "KVCacheStorage",
            "cluster_file": spec["cluster_file"],
            "credentials_file": spec["credentials_file"],
            "traffic_class": "agent",
            "prefetch_threshold": 256,  # one of SGLang's own keys, read from the same JSON
            "interface_v1": 1,  # SGLang calls batch_get_v1 / batch_set_v1 only with it
        },
    )


def hashes(count: int, salt: str) -> list[str]:
    out, prior = [], b""
    for i in range(count):
        prior = hashlib.sha256(prior + f"{salt}:{i}".encode()).digest()
        out.append(prior.hex())
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    page = 16
    result: dict[str, Any] = {}
    writer = StorageBackendFactory.create_backend("dynamic", config(spec, is_mla=False), None)
    reader = StorageBackendFactory.create_backend("dynamic", config(spec, is_mla=False), None)
    result["class"] = f"{type(writer).__module__}.{type(writer).__name__}"
    result["is_hicache_storage"] = isinstance(writer, HiCacheStorage)
    src, dst = host_pool(1, page=page), host_pool(2, page=page)
    result["pool"] = type(src).__name__
    writer.register_mem_pool_host(src)
    reader.register_mem_pool_host(dst)
    keys = hashes(6, "real")
    src_idx = torch.arange(3 * page, 9 * page, dtype=torch.int64)  # pages 3..8
    dst_idx = torch.arange(20 * page, 26 * page, dtype=torch.int64)  # pages 20..25
    result["set"] = writer.batch_set_v1(keys, src_idx)
    result["exists"] = reader.batch_exists(keys)
    result["exists_longer"] = reader.batch_exists([*keys, *hashes(2, "absent")])
    result["get"] = reader.batch_get_v1(keys, dst_idx)
    result["equal"] = bool(
        torch.equal(
            src.kv_buffer[:, :, 3 * page : 9 * page], dst.kv_buffer[:, :, 20 * page : 26 * page]
        )
    )
    result["missing_get"] = reader.batch_get_v1(hashes(2, "absent"), dst_idx[: 2 * page])
    # A class that is not a HiCacheStorage is refused by SGLang's loader.
    bad = config(spec, is_mla=False)
    assert bad.extra_config is not None
    bad.extra_config |= {"module_path": "kvcache.engine.settings", "class_name": "EngineSettings"}
    try:
        StorageBackendFactory.create_backend("dynamic", bad, None)
        result["refused_non_backend"] = False
    except Exception as exc:  # SGLang raises TypeError wrapped by its loader
        result["refused_non_backend"] = "HiCacheStorage" in str(exc)
    # DeepSeek V4 / V4.1: SGLang registers its anchor pool, which holds no bytes; the
    # backend refuses it by name instead of failing on a missing method.
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    v4 = StorageBackendFactory.create_backend("dynamic", config(spec, is_mla=True), None)
    try:
        v4.register_mem_pool_host(LogicalHostPool(size=16 * page, page_size=page))
        result["v4_anchor_refused"] = ""
    except Exception as exc:
        result["v4_anchor_refused"] = f"{type(exc).__name__}: {exc}"
    v4.close()
    result["stats"] = reader.get_stats()
    writer.close()
    reader.close()
    Path(sys.argv[2]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
