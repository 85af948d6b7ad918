"""Build a tiny random-weight Llama (and its tokenizer) in a directory, offline.

Run with the vLLM venv's python: ``python make_model.py OUT_DIR``. Deterministic
(seeded), so every run on every machine builds the same weights. Two layers,
hidden size 64, two heads of 32 dimensions and a 1,024-word vocabulary: small
enough for vLLM's CPU backend to load in seconds, while weights drawn from
N(0, 0.2) keep greedy decoding from collapsing onto one token, so a single
wrong KV byte shows up as a different continuation.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 1024
SEED = 1234


def build(out: Path) -> None:
    """Write config, safetensors weights and a fast tokenizer to ``out``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    words = specials + [f"w{i}" for i in range(VOCAB - len(specials))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    (out / "kvcache-tiny.json").write_text(json.dumps({"seed": SEED, "vocab": VOCAB}))


if __name__ == "__main__":
    build(Path(sys.argv[1]))
