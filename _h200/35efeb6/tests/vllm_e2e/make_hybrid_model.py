"""Build a tiny random-weight hybrid model (sliding-window and full attention layers), offline.

Run with the vLLM venv's python: ``python make_hybrid_model.py OUT_DIR``. A
``Gemma3ForCausalLM`` (``gemma3_text``) of six layers, ``[sliding, sliding,
full, sliding, sliding, full]``, with a 64-token window: vLLM 0.32's hybrid
KV-cache manager gives it two sliding-window groups and one full-attention
group, and runs it on the CPU. Seeded weights drawn from N(0, 0.2) keep greedy
decoding from collapsing, so a wrong window byte shows up as a different
continuation. The tokenizer is the same word-level one as ``make_model.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 1024
SEED = 4321
WINDOW = 64
LAYER_TYPES = [
    "sliding_attention",
    "sliding_attention",
    "full_attention",
    "sliding_attention",
    "sliding_attention",
    "full_attention",
]


def build(out: Path) -> None:
    """Write config, safetensors weights and a fast tokenizer to ``out``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    words = specials + [f"w{i}" for i in range(VOCAB - len(specials))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)

    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=WINDOW,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(0.0)  # Gemma's norms scale by (1 + weight)
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    (out / "kvcache-tiny.json").write_text(
        json.dumps({"seed": SEED, "vocab": VOCAB, "window": WINDOW, "layer_types": LAYER_TYPES})
    )


if __name__ == "__main__":
    build(Path(sys.argv[1]))
