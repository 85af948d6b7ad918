"""Recompute baseline: how long a GPU takes to prefill a prompt instead of loading its KV cache.

A KV cache store only pays off when fetching a prompt's KV blocks is faster than
recomputing them. This module times the recomputation: a Llama-3-8B-shaped bf16 prefill
in plain torch (no fused kernels beyond what torch ships), with RANDOM weights, because
the arithmetic and memory traffic of a prefill do not depend on the weights' values and
no checkpoint can be downloaded on the benchmark machine.

The model per layer: RMSNorm → fused QKV projection → rotary embedding (Llama-3, theta
500000, no rope scaling) → causal GQA attention through
``torch.nn.functional.scaled_dot_product_attention`` → output projection → residual →
RMSNorm → SwiGLU MLP → residual. The final norm and the lm_head are applied to the last
token only, as a serving engine's prefill does. Every layer's rotated K and its V are
written into one preallocated buffer ``[layers, 2, tokens, kv_heads, head_dim]``, the KV
cache a real prefill would produce, so the timing includes producing the KV.

The whole sequence is processed at once per layer (flash / memory-efficient SDPA needs
O(tokens) memory, and the math backend, which would need O(tokens²), is excluded on
CUDA): 77,000 tokens of the 8B shape need about 16 GB of weights, 10 GB of KV and a few
GB of activations.

Imported by ``bench/engine_gpu.py``; also runnable on its own::

    python bench/recompute.py [--tokens 8192,32768,77000] [--tiny] [--json PATH]

(``--tiny``: a 2-layer CPU-sized shape and short sequences, to check the script on a
CPU machine in seconds.)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = [
    "LLAMA3_8B",
    "LlamaModel",
    "LlamaShape",
    "allocate_kv",
    "build_model",
    "kv_bytes_per_token",
    "main",
    "measure_prefill",
    "prefill",
    "prefill_flops",
    "random_tokens",
]


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a Llama-style decoder; the defaults are Llama-3-8B's."""

    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads")
        if self.head_dim % 2:
            raise ValueError("rotary embedding needs an even head_dim")

    @classmethod
    def tiny(cls) -> LlamaShape:
        """A CPU-sized shape with the same structure (GQA 2:1), for checks that run in seconds."""
        return cls(
            layers=2,
            hidden=256,
            heads=4,
            kv_heads=2,
            head_dim=64,
            intermediate=512,
            vocab=1000,
        )

    @property
    def params(self) -> int:
        """Number of weights (embedding and untied lm_head included)."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        per_layer = qkv + o + mlp + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


LLAMA3_8B = LlamaShape()


def kv_bytes_per_token(shape: LlamaShape, dtype_bytes: int = 2) -> int:
    """Bytes of KV cache one token occupies: K and V of every layer and KV head.

    131,072 (128 KiB) for Llama-3-8B in bf16.
    """
    return shape.layers * shape.kv_heads * shape.head_dim * 2 * dtype_bytes


def prefill_flops(shape: LlamaShape, tokens: int) -> float:
    """Model FLOPs of one prefill (multiply-add = 2), for a TFLOP/s sanity figure.

    Projections and MLP over every token, causal attention (QKᵀ and PV over the
    ``tokens * (tokens + 1) / 2`` visible pairs), the lm_head on the last token only.
    Norms, rotary embedding and softmax are left out (a few percent at most).
    """
    s = shape
    linear = s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim
    linear += s.heads * s.head_dim * s.hidden + 3 * s.hidden * s.intermediate
    pairs = tokens * (tokens + 1) / 2
    attention = 4 * s.heads * s.head_dim * pairs
    return s.layers * (2.0 * linear * tokens + attention) + 2.0 * s.vocab * s.hidden


@dataclass
class LayerWeights:
    """One decoder layer's weights, in ``F.linear`` layout ``[out_features, in_features]``."""

    attn_norm: torch.Tensor  # [hidden]
    wqkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    wo: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate rows, then up rows
    w_down: torch.Tensor  # [hidden, intermediate]


@dataclass
class LlamaModel:
    """A Llama-shaped decoder as plain tensors (no nn.Module: nothing but the forward is needed).

    ``gqa_native`` says whether SDPA's ``enable_gqa`` is used (probed at build time) or the
    KV heads are repeated to the query heads' count.
    """

    shape: LlamaShape
    device: torch.device
    dtype: torch.dtype
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]
    inv_freq: torch.Tensor  # [head_dim // 2], float32
    gqa_native: bool
    released: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes held by the weights."""
        tensors = [self.embed, self.final_norm, self.lm_head, self.inv_freq]
        for layer in self.layers:
            tensors += [
                layer.attn_norm,
                layer.wqkv,
                layer.wo,
                layer.mlp_norm,
                layer.w_gate_up,
                layer.w_down,
            ]
        return sum(t.numel() * t.element_size() for t in tensors)

    def release(self) -> None:
        """Drop every weight and return the cached device memory to the driver.

        The memory only comes back if nothing else references the weights; the caller
        should also drop its own reference to the model (``del model``). Any KV buffer
        returned by :func:`prefill` is separate and must be dropped too.
        """
        empty = torch.empty(0, device=self.device, dtype=self.dtype)
        self.embed = self.final_norm = self.lm_head = empty
        self.layers = []
        self.released = True
        _free_cached_memory(self.device)


def _free_cached_memory(device: torch.device) -> None:
    """Collect garbage and hand the caching allocator's free blocks back to the driver."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that wall-clock timings cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


def _sdpa_context(device: torch.device) -> Any:
    """On CUDA, allow only the O(tokens)-memory SDPA backends.

    The math backend materialises a ``heads x tokens x tokens`` score matrix (380 GB at
    77,000 tokens); excluding it turns a silent fallback into an error.
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    )


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa_native: bool) -> torch.Tensor:
    """Causal GQA attention; ``q`` is ``[1, heads, N, D]``, ``k`` and ``v`` ``[1, kv_heads, N, D]``.

    Query head ``h`` attends to KV head ``h // (heads // kv_heads)``, as in Llama.
    """
    with _sdpa_context(q.device):
        if gqa_native:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _probe_gqa(shape: LlamaShape, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether SDPA's ``enable_gqa`` runs here with the allowed backends and agrees with
    repeating the KV heads (it needs torch >= 2.5, and a backend that supports it)."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    n, d = 64, shape.head_dim
    q = torch.randn(1, shape.heads, n, d, generator=gen).to(device, dtype)
    k = torch.randn(1, shape.kv_heads, n, d, generator=gen).to(device, dtype)
    v = torch.randn(1, shape.kv_heads, n, d, generator=gen).to(device, dtype)
    try:
        native = _attention(q, k, v, gqa_native=True)
    except (TypeError, RuntimeError):
        return False
    repeated = _attention(q, k, v, gqa_native=False)
    return bool(torch.allclose(native.float(), repeated.float(), atol=2e-2, rtol=2e-2))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 as Llama does."""
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dimension (the Llama / HF rotary layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotary embedding of ``x`` (``[N, H, D]``); ``cos``/``sin`` are ``[N, 1, D]``.

    ``out`` lets K be rotated straight into its slot of the KV buffer.
    """
    out = torch.mul(x, cos, out=out) if out is not None else x * cos
    return out.addcmul_(_rotate_half(x), sin)


def _rope_tables(
    model: LlamaModel, tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions ``0 .. tokens-1``, ``[tokens, 1, head_dim]`` in the model dtype."""
    pos = torch.arange(tokens, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, model.inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(model.dtype)[:, None, :], emb.sin().to(model.dtype)[:, None, :]


def build_model(
    shape: LlamaShape,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    std: float = 0.02,
) -> LlamaModel:
    """Random weights of ``shape`` on ``device`` (normal, ``std``; norm weights 1).

    Seeded, so two builds with the same arguments on the same device are identical.
    ``std`` = 0.02 keeps activations finite in bf16 across 32 layers. The 8B shape takes
    about 16 GB; drop it with :meth:`LlamaModel.release` and ``del``.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*size: int) -> torch.Tensor:
        return torch.empty(size, device=device, dtype=dtype).normal_(0.0, std, generator=gen)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    s = shape
    with torch.inference_mode():
        embed = normal(s.vocab, s.hidden)
        layers = [
            LayerWeights(
                attn_norm=ones(s.hidden),
                wqkv=normal((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden),
                wo=normal(s.hidden, s.heads * s.head_dim),
                mlp_norm=ones(s.hidden),
                w_gate_up=normal(2 * s.intermediate, s.hidden),
                w_down=normal(s.hidden, s.intermediate),
            )
            for _ in range(s.layers)
        ]
        final_norm = ones(s.hidden)
        lm_head = normal(s.vocab, s.hidden)
        exponents = torch.arange(0, s.head_dim, 2, device=device, dtype=torch.float32)
        inv_freq = 1.0 / (s.rope_theta ** (exponents / s.head_dim))
        gqa_native = _probe_gqa(s, device, dtype)
    return LlamaModel(
        shape=s,
        device=device,
        dtype=dtype,
        embed=embed,
        layers=layers,
        final_norm=final_norm,
        lm_head=lm_head,
        inv_freq=inv_freq,
        gqa_native=gqa_native,
    )


def allocate_kv(model: LlamaModel, tokens: int) -> torch.Tensor:
    """An uninitialised KV buffer ``[layers, 2, tokens, kv_heads, head_dim]`` for :func:`prefill`.

    ``[:, 0]`` holds the rotated keys, ``[:, 1]`` the values (10 GB at 77,000 tokens, 8B).
    """
    s = model.shape
    return torch.empty(
        (s.layers, 2, tokens, s.kv_heads, s.head_dim), device=model.device, dtype=model.dtype
    )


def random_tokens(
    tokens: int, vocab: int, device: torch.device | str, seed: int = 0
) -> torch.Tensor:
    """``tokens`` random token ids in ``[0, vocab)`` from a seeded CPU generator (int64)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (tokens,), generator=gen, dtype=torch.int64).to(device)


@torch.inference_mode()
def prefill(
    model: LlamaModel, token_ids: torch.Tensor, kv_out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill one sequence: write every layer's K and V and return the last token's logits.

    ``token_ids``: ``[N]`` (or ``[1, N]``) on the model's device. ``kv_out``: a buffer from
    :func:`allocate_kv` with at least N tokens, reused across calls to keep allocation out
    of timings; allocated here when None. Returns ``(logits [vocab] float32, kv)`` where
    ``kv`` is ``kv_out[:, :, :N]``. Intermediates are freed layer by layer, so the peak is
    the weights + the KV + about one layer's activations.
    """
    if model.released:
        raise RuntimeError("the model was released")
    s = model.shape
    ids = token_ids.reshape(-1)
    n = ids.numel()
    if kv_out is None:
        kv_out = allocate_kv(model, n)
    kv = kv_out[:, :, :n]
    q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim

    cos, sin = _rope_tables(model, n, model.device)
    h = F.embedding(ids, model.embed)  # [N, hidden], the residual stream
    for i, layer in enumerate(model.layers):
        x = _rms_norm(h, layer.attn_norm, s.rms_eps)
        qkv = F.linear(x, layer.wqkv)  # [N, q_dim + 2 * kv_dim]
        del x
        q = qkv[:, :q_dim].view(n, s.heads, s.head_dim)
        k = qkv[:, q_dim : q_dim + kv_dim].view(n, s.kv_heads, s.head_dim)
        v = qkv[:, q_dim + kv_dim :].view(n, s.kv_heads, s.head_dim)
        q = _apply_rope(q, cos, sin)
        _apply_rope(k, cos, sin, out=kv[i, 0])  # the KV cache write
        kv[i, 1].copy_(v)
        del qkv, k, v
        # [N, H, D] -> [1, H, N, D]: a view; flash attention reads it without a copy.
        attn = _attention(
            q.transpose(0, 1).unsqueeze(0),
            kv[i, 0].transpose(0, 1).unsqueeze(0),
            kv[i, 1].transpose(0, 1).unsqueeze(0),
            model.gqa_native,
        )
        del q
        attn = attn.squeeze(0).transpose(0, 1).reshape(n, q_dim)
        h.add_(F.linear(attn, layer.wo))
        del attn

        x = _rms_norm(h, layer.mlp_norm, s.rms_eps)
        gate_up = F.linear(x, layer.w_gate_up)  # [N, 2 * intermediate]
        del x
        gate, up = gate_up.chunk(2, dim=-1)
        gate = F.silu(gate, inplace=True).mul_(up)
        h.add_(F.linear(gate, layer.w_down))
        del gate_up, gate, up

    last = _rms_norm(h[-1:], model.final_norm, s.rms_eps)
    logits = F.linear(last, model.lm_head).float().reshape(-1)
    return logits, kv


def measure_prefill(
    shape: LlamaShape,
    tokens: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    repeat: int = 3,
    warmup: int = 1,
    *,
    model: LlamaModel | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Time the prefill of ``tokens`` random tokens; the median of ``repeat`` synchronised runs.

    Pass a prebuilt ``model`` (from :func:`build_model`, same shape) to time several lengths
    with one build (its device and dtype then win over ``device`` and ``dtype``); otherwise
    one is built and released here. The KV buffer is allocated
    once, outside the timings, and freed before returning.

    Returns a flat dict: ``tokens``, ``seconds`` (median), ``seconds_min``, ``seconds_max``,
    ``tokens_per_s``, ``kv_gb`` (KV bytes produced / 1e9), ``kv_gbps_to_break_even`` (the
    load bandwidth, GB/s, at which fetching the KV takes as long as recomputing it),
    ``tflops`` (model FLOPs / median / 1e12), ``gqa_native``, ``logits_finite``, ``device``,
    ``dtype``, and on CUDA ``peak_gpu_gb`` (peak allocated during the runs, weights included).
    """
    device = torch.device(device)
    own_model = model is None
    if model is None:
        model = build_model(shape, device, dtype, seed=seed)
    elif model.shape != shape:
        raise ValueError(f"model shape {model.shape} differs from {shape}")
    device, dtype = model.device, model.dtype
    kv_buf: torch.Tensor | None = None
    try:
        ids = random_tokens(tokens, shape.vocab, device, seed=seed + 1)
        kv_buf = allocate_kv(model, tokens)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        logits = None
        for _ in range(warmup):
            logits, _ = prefill(model, ids, kv_buf)
        _sync(device)
        times = []
        for _ in range(max(1, repeat)):
            _sync(device)
            t0 = time.perf_counter()
            logits, _ = prefill(model, ids, kv_buf)
            _sync(device)
            times.append(time.perf_counter() - t0)
        assert logits is not None
        finite = bool(torch.isfinite(logits).all().item())
        peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    finally:
        del kv_buf
        if own_model:
            model.release()
        else:
            _free_cached_memory(device)

    seconds = float(np.median(times))
    kv_bytes = kv_bytes_per_token(shape, torch.empty(0, dtype=dtype).element_size()) * tokens
    result: dict[str, Any] = {
        "tokens": tokens,
        "seconds": seconds,
        "seconds_min": float(min(times)),
        "seconds_max": float(max(times)),
        "tokens_per_s": tokens / seconds,
        "kv_gb": kv_bytes / 1e9,
        "kv_gbps_to_break_even": kv_bytes / seconds / 1e9,
        "tflops": prefill_flops(shape, tokens) / seconds / 1e12,
        "gqa_native": model.gqa_native,
        "logits_finite": finite,
        "device": _device_name(device),
        "dtype": str(dtype).removeprefix("torch."),
    }
    if peak is not None:
        result["peak_gpu_gb"] = peak
    return result


def _device_name(device: torch.device) -> str:
    """A readable name of the device, for the record."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
    return str(device)


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _parse_tokens(text: str) -> list[int]:
    """``"8192,32768,77000"`` → ``[8192, 32768, 77000]``."""
    values = [int(part.strip().replace("_", "")) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"bad token counts: {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: time prefills at each length and print a markdown table."""
    p = argparse.ArgumentParser(description="GPU recompute baseline: a Llama-3-8B-shaped prefill.")
    p.add_argument(
        "--tokens",
        type=_parse_tokens,
        default=None,
        help="comma-separated prompt lengths (default 8192,32768,77000; --tiny: 128,512,2048)",
    )
    p.add_argument("--tiny", action="store_true", help="CPU-sized shape and short sequences")
    p.add_argument("--json", type=Path, help="write the shape and results as JSON")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    shape = LlamaShape.tiny() if args.tiny else LLAMA3_8B
    lengths = args.tokens or ([128, 512, 2048] if args.tiny else [8192, 32768, 77000])
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[args.dtype]

    t0 = time.perf_counter()
    model = build_model(shape, device, dtype, seed=args.seed)
    _sync(device)
    build_s = time.perf_counter() - t0
    print(
        f"recompute baseline: {'tiny' if args.tiny else 'Llama-3-8B'} shape, "
        f"{shape.params / 1e9:.3f} B params ({model.nbytes / 1e9:.2f} GB), {args.dtype}, "
        f"random weights, on {_device_name(device)}; torch {torch.__version__}; "
        f"SDPA {'enable_gqa' if model.gqa_native else 'with repeated KV heads'}; "
        f"built in {build_s:.1f} s"
    )
    results = []
    try:
        for n in lengths:
            results.append(
                measure_prefill(
                    shape, n, device, dtype, args.repeat, args.warmup, model=model, seed=args.seed
                )
            )
    finally:
        model.release()
        del model

    print("\n| tokens | seconds | tokens/s | TFLOP/s | KV GB | GB/s needed to break even |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['tokens']:,} | {r['seconds']:.4f} | {r['tokens_per_s']:,.0f} "
            f"| {r['tflops']:.1f} | {r['kv_gb']:.4g} | {r['kv_gbps_to_break_even']:.4g} |"
        )
    bad = [r["tokens"] for r in results if not r["logits_finite"]]
    if bad:
        print(f"\nWARNING: non-finite logits at {bad} tokens", file=sys.stderr)

    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "shape": asdict(shape),
            "dtype": args.dtype,
            "torch": torch.__version__,
            "build_seconds": build_s,
            "results": results,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
