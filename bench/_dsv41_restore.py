"""DeepSeek V4.1 Flash: time to restore an SWA state into the sliding-window groups' pages,
against the time vLLM would spend replaying 128 tokens without it (``bench/engine_gpu.py``).

The pool is laid out as vLLM 0.32 lays V4.1's out (BLHNC, ``kvcache.engine.block_span``):
one allocation on the device, every group's block at ``block_id x block_stride``; here 5
sliding-window groups of 8 layers (40 layers, 32-token blocks of 528-byte records: 16,896 B
per layer, 135,168 B per group block, which is also the stride) and the compressor ring
(3 layers x 32,768 B). The state is what the connector takes: the 4 blocks of every group
holding the window, plus the ring block, 2,801,664 bytes.

Two figures, each the median of ``repeat`` runs, synchronised:

- ``dsv41_restore_ms``: the worker's restore of a state this worker holds
  (``vllm_worker._fetch_state`` copies it into a private host tensor, then
  ``_scatter_state``: one ``PagedKVAdapter.scatter`` per group into its 4 block ids and
  one for the ring);
- ``dsv41_fetch_restore_ms``: the same for a state fetched from a peer tier over TCP (a
  ``PeerServer`` in this process, loopback, digest checked), received straight into the
  private host tensor (``fetch(..., out=)``, as the worker does), the whole restore path.

Every restored byte is gathered back and compared.

The replay it replaces: ``replay_128_ms_est`` = 128 / the prefill rate measured by
``bench/recompute.py`` at its smallest prompt (Llama-3-8B shape, bf16, this GPU). That is a
*lower bound* for V4.1 Flash: it ignores that the 128 replayed tokens attend to the whole
stored prefix in the full-attention layers, and that a 128-token batch runs below the
rate of an 8K one; ``prefill_128_ms`` (a 128-token prefill, measured) shows the second
effect. V4.1 Flash's own forward pass does not run here (no weights, no V4.1 kernels).
"""

from __future__ import annotations

import secrets
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvcache.credentials import TenantCredentials
from kvcache.engine import PagedKVAdapter
from kvcache.keys import BlockKey
from kvcache.swa_local import StateKey, SwaStore, TcpPeerTransport, Wanted
from kvcache.swa_local.server import PeerServer

SWA_GROUPS, LAYERS_PER_GROUP, SWA_PAGE = 5, 8, 16_896
SWA_BLOCK = LAYERS_PER_GROUP * SWA_PAGE  # 135,168
RING_BLOCK = 3 * 32_768  # 98,304
WINDOW_BLOCKS = 4
STATE_BYTES = SWA_GROUPS * WINDOW_BLOCKS * SWA_BLOCK + RING_BLOCK  # 2,801,664


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


def restore_figures(device: torch.device, repeat: int, *, tiny: bool) -> dict[str, Any]:
    """Restore (and fetch + restore) one V4.1 state into a BLHNC pool on ``device``."""
    num_blocks = 128 if tiny else 8192
    stride = SWA_BLOCK
    backing = torch.zeros(num_blocks * stride, dtype=torch.uint8, device=device)
    swa_pages = backing.as_strided((num_blocks, SWA_BLOCK), (stride, 1), 0)
    ring_pages = backing.as_strided((num_blocks, RING_BLOCK), (stride, 1), 0)
    swa = PagedKVAdapter([swa_pages], page_tokens=32)
    ring = PagedKVAdapter([ring_pages], page_tokens=8)
    rng = np.random.default_rng(41)
    state = rng.integers(0, 256, STATE_BYTES, dtype=np.uint8).tobytes()

    def place() -> list[np.ndarray]:
        ids = rng.choice(num_blocks, SWA_GROUPS * WINDOW_BLOCKS + 1, replace=False)
        rows = [ids[g * WINDOW_BLOCKS : (g + 1) * WINDOW_BLOCKS] for g in range(SWA_GROUPS)]
        return [*(r.reshape(-1, 1) for r in rows), ids[-1:].reshape(1, 1)]

    def held(data: bytes) -> torch.Tensor:
        host = torch.empty(STATE_BYTES, dtype=torch.uint8)  # the worker's private copy
        host.numpy()[:] = np.frombuffer(data, np.uint8)
        return host

    def restore(host: torch.Tensor, ids: list[np.ndarray]) -> None:
        handles, offset = [], 0
        for g, pages in enumerate(ids):
            size = SWA_BLOCK if g < SWA_GROUPS else RING_BLOCK
            rows = len(pages)
            part = host[offset : offset + rows * size].view(rows, size)
            offset += rows * size
            handles.append((swa if g < SWA_GROUPS else ring).scatter(part, pages))
        for handle in handles:
            handle.synchronize()
        _sync(device)

    def equal(ids: list[np.ndarray]) -> bool:
        parts = []
        for g, pages in enumerate(ids):
            got = (swa if g < SWA_GROUPS else ring).gather(pages)
            got.synchronize()
            parts.append(got.host.reshape(-1).numpy().tobytes())
        return b"".join(parts) == state

    secret = secrets.token_bytes(32)
    tenant = TenantCredentials(name="default", secret=secret)
    key = StateKey(namespace=b"\x41" * 8, block=BlockKey(b"\x41" * 16), position=4096)
    store = SwaStore(max_bytes=2 * STATE_BYTES)
    stored = store.put(key, state)
    assert stored is not None
    server = PeerServer(store, tenant=tenant, incarnation=41)
    endpoint = server.start()
    transport = TcpPeerTransport(tenant="default", secret=secret, connections_per_peer=1)
    want = [Wanted(key, 41, stored.digest)]
    restore_s: list[float] = []
    fetch_restore_s: list[float] = []
    ok = True
    try:
        for i in range(repeat + 2):  # the first two warm up
            ids = place()
            start = time.perf_counter()
            restore(held(state), ids)
            took = time.perf_counter() - start
            ok = ok and equal(ids)
            ids = place()
            start = time.perf_counter()
            host = torch.empty(STATE_BYTES, dtype=torch.uint8)
            (got,) = transport.fetch(
                endpoint, want, deadline=time.monotonic() + 10, out=[host.numpy().data]
            )
            assert got is not None
            restore(host, ids)
            took_fetch = time.perf_counter() - start
            ok = ok and equal(ids)
            if i >= 2:
                restore_s.append(took)
                fetch_restore_s.append(took_fetch)
    finally:
        transport.close()
        server.close()
    return {
        "dsv41_state_bytes": STATE_BYTES,
        "dsv41_restore_ms": statistics.median(restore_s) * 1e3,
        "dsv41_fetch_restore_ms": statistics.median(fetch_restore_s) * 1e3,
        "dsv41_restore_bit_equal": ok,
    }


def replay_figures(
    device: torch.device, rate_tokens_per_s: float | None, *, tiny: bool, repeat: int
) -> dict[str, Any]:
    """The replay estimate from a prefill rate, and a measured 128-token prefill."""
    import recompute

    out: dict[str, Any] = {}
    if rate_tokens_per_s:
        out["replay_128_ms_est"] = 128 / rate_tokens_per_s * 1e3
        out["replay_rate_tokens_per_s"] = rate_tokens_per_s
    shape = recompute.LlamaShape.tiny() if tiny else recompute.LLAMA3_8B
    model = recompute.build_model(shape, device)
    try:
        row = recompute.measure_prefill(shape, 128, device, model=model, repeat=repeat)
        out["prefill_128_ms"] = float(row["seconds"]) * 1e3
    finally:
        model.release()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out
