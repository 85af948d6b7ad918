"""A torch reference for bounded replay: a tiny hybrid model that executes a ReplayPlan.

:class:`TinyHybridModel` is a small decoder (RMSNorm, rotary attention,
GELU MLP) whose layers are either full attention or sliding-window attention,
with seeded random weights, in float64 so that "exact" means equal to the
last bits that matter. It runs any token range against an explicit per-layer
KV cache, which is what an engine does, and lets a run

- keep the full-attention layers' stored KV for tokens before a point (a
  replay recomputes tokens without rewriting the KV the store supplied), and
- limit sliding-window attention to tokens from a point on (nothing older
  exists in those layers after a miss).

:func:`compare_replay` measures what a plan costs and what it changes: it
prefills a prompt and its continuation in one pass (the truth), then loads
the full-attention KV of the first ``hit`` tokens as a store would, replays
the plan's tokens, computes the continuation, and reports the tokens
recomputed and the continuation's logits distance from the truth.

torch is imported here only (``kvcache.swa_local`` works without it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcache.errors import ArgumentError
from kvcache.swa_local.replay import ReplayPlan

__all__ = ["ReplayReport", "TinyHybridConfig", "TinyHybridModel", "compare_replay"]

FULL = "full"
SLIDING = "sliding"


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyHybridConfig:
    """Shape of the reference model (defaults: the e2e test's Gemma3-like 6-layer model)."""

    vocab: int = 512
    hidden: int = 64
    heads: int = 2
    head_dim: int = 32
    mlp: int = 128
    window: int = 64
    layer_types: tuple[str, ...] = (SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL)
    seed: int = 0
    init_std: float = 0.2

    def __post_init__(self) -> None:
        if any(t not in (FULL, SLIDING) for t in self.layer_types) or not self.layer_types:
            raise ArgumentError(f"layer_types must be 'full' or 'sliding', got {self.layer_types}")
        if self.window < 2 or self.head_dim % 2:
            raise ArgumentError("window must be >= 2 and head_dim even")

    @property
    def swa_layers(self) -> int:
        """Number of sliding-window layers."""
        return sum(t == SLIDING for t in self.layer_types)


@dataclass
class KVCache:
    """Per-layer K and V for every position of a sequence, shape (tokens, heads, head_dim)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def empty(cls, config: TinyHybridConfig, tokens: int) -> KVCache:
        """Zeros (the engine's fresh pages) for ``tokens`` positions."""
        shape = (tokens, config.heads, config.head_dim)
        layers = len(config.layer_types)
        return cls(
            [torch.zeros(shape, dtype=torch.float64) for _ in range(layers)],
            [torch.zeros(shape, dtype=torch.float64) for _ in range(layers)],
        )


class TinyHybridModel:
    """The reference model (see the module docstring)."""

    def __init__(self, config: TinyHybridConfig) -> None:
        self.config = config
        c = config
        gen = torch.Generator().manual_seed(c.seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64) * c.init_std

        inner = c.heads * c.head_dim
        self.embed = w(c.vocab, c.hidden) * 5
        self.layers: list[dict[str, torch.Tensor]] = [
            {
                "wq": w(c.hidden, inner),
                "wk": w(c.hidden, inner),
                "wv": w(c.hidden, inner),
                "wo": w(inner, c.hidden),
                "w1": w(c.hidden, c.mlp),
                "w2": w(c.mlp, c.hidden),
            }
            for _ in c.layer_types
        ]
        self.head = w(c.hidden, c.vocab)
        inv = 1.0 / (10000 ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        self._inv_freq = inv

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        angles = positions[:, None].to(torch.float64) * self._inv_freq[None, :]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos
        return out

    def run(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        *,
        begin: int,
        end: int,
        swa_from: int = 0,
        keep_full_below: int = 0,
    ) -> torch.Tensor:
        """Compute positions ``begin .. end - 1``; their logits, shape (end - begin, vocab).

        K/V of the computed positions are written into ``cache``, except the
        full-attention layers' below ``keep_full_below`` (stored KV is kept);
        sliding-window attention sees no position below ``swa_from``.
        """
        c = self.config
        positions = torch.arange(begin, end)
        h = self.embed[tokens[begin:end]]
        key_pos = torch.arange(end)
        causal = key_pos[None, :] <= positions[:, None]
        for kind, weights, keys, values in zip(
            c.layer_types, self.layers, cache.keys, cache.values, strict=True
        ):
            x = _rms(h)
            q = self._rope((x @ weights["wq"]).view(-1, c.heads, c.head_dim), positions)
            k = self._rope((x @ weights["wk"]).view(-1, c.heads, c.head_dim), positions)
            v = (x @ weights["wv"]).view(-1, c.heads, c.head_dim)
            write = positions >= (keep_full_below if kind == FULL else 0)
            keys[begin:end][write] = k[write]
            values[begin:end][write] = v[write]
            mask = causal
            if kind == SLIDING:
                lowest = torch.clamp(positions - c.window + 1, min=swa_from)
                mask = causal & (key_pos[None, :] >= lowest[:, None])
            scores = torch.einsum("qhd,khd->hqk", q, keys[:end]) / math.sqrt(c.head_dim)
            scores = scores.masked_fill(~mask[None], float("-inf"))
            attn = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), values[:end])
            h = h + attn.reshape(len(positions), -1) @ weights["wo"]
            h = h + torch.nn.functional.gelu(_rms(h) @ weights["w1"]) @ weights["w2"]
        return _rms(h) @ self.head


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


@dataclass(frozen=True, slots=True)
class ReplayReport:
    """What one plan recomputed, and how far the continuation's logits are from the truth."""

    plan: ReplayPlan
    continuation: int
    max_abs_logit_diff: float
    mean_kl: float
    argmax_agreement: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "hit": self.plan.hit,
            "replayed_tokens": self.plan.tokens,
            "exact_plan": self.plan.exact,
            "continuation_tokens": self.continuation,
            "max_abs_logit_diff": self.max_abs_logit_diff,
            "mean_kl": self.mean_kl,
            "argmax_agreement": self.argmax_agreement,
            **self.extra,
        }


def compare_replay(model: TinyHybridModel, tokens: torch.Tensor, plan: ReplayPlan) -> ReplayReport:
    """Execute ``plan`` after a hit of ``plan.hit`` tokens of ``tokens`` and compare the
    continuation (tokens ``hit ..``) with a prefill of everything (module docstring)."""
    n, hit = len(tokens), plan.hit
    if not 0 < hit < n:
        raise ArgumentError(f"the hit ({hit}) must leave a continuation of the {n} tokens")
    truth_cache = KVCache.empty(model.config, n)
    truth = model.run(tokens, truth_cache, begin=0, end=n)[hit:]
    cache = KVCache.empty(model.config, n)
    held_from = max(0, hit - model.config.window + 1)
    for layer, kind in enumerate(model.config.layer_types):
        # What the block store supplies, and (a state that was held) what the SWA tier does.
        lo = 0 if kind == FULL else (held_from if not plan.tokens else hit)
        cache.keys[layer][lo:hit] = truth_cache.keys[layer][lo:hit]
        cache.values[layer][lo:hit] = truth_cache.values[layer][lo:hit]
    if plan.tokens:
        model.run(
            tokens, cache, begin=plan.start, end=hit, swa_from=plan.start, keep_full_below=hit
        )
    # A held state is the window itself: nothing limits attention to it.
    swa_from = plan.start if plan.tokens else 0
    got = model.run(tokens, cache, begin=hit, end=n, swa_from=swa_from, keep_full_below=hit)
    log_p = torch.log_softmax(truth, dim=-1)
    log_q = torch.log_softmax(got, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    return ReplayReport(
        plan=plan,
        continuation=n - hit,
        max_abs_logit_diff=float((truth - got).abs().max()),
        mean_kl=float(kl),
        argmax_agreement=float((truth.argmax(-1) == got.argmax(-1)).double().mean()),
    )
