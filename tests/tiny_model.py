"""A tiny random-weight Llama as a Hugging Face folder (config.json, model.safetensors, a
word-level tokenizer with a chat template), for tests that need a real engine but not a real
model: it loads in well under a second and one decode step costs microseconds.

Words ``w0`` .. ``w{VOCAB-4}`` are tokens (split on whitespace); ``<unk>``, ``<eos>`` and
``<bos>`` close the vocabulary. ``prompt(n)`` is a text of exactly ``n`` tokens.
"""
from __future__ import annotations

import json
from pathlib import Path

VOCAB = 128
NUM_WORDS = VOCAB - 3
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, CONTEXT = 64, 128, 2, 4, 2, 1024
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant {% endif %}")


def prompt(n: int) -> str:
    return " ".join(f"w{i % NUM_WORDS}" for i in range(n))


def write_tiny_folder(folder: Path, context: int = CONTEXT, seed: int = 0) -> Path:
    """Writes the model into ``folder`` (created) and returns it; deterministic weights (another
    ``seed``: another model with the same tokenizer)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(NUM_WORDS)] + ["<unk>", "<eos>", "<bos>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<eos>", "chat_template": CHAT_TEMPLATE}))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": context, "tie_word_embeddings": True}))
    gen = torch.Generator().manual_seed(seed)
    head_dim = HIDDEN // HEADS

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.2

    tensors = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": torch.ones(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": rand(INTER, HIDDEN),
            p + "mlp.up_proj.weight": rand(INTER, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, INTER),
            p + "input_layernorm.weight": torch.ones(HIDDEN),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        }
    save_file(tensors, str(folder / "model.safetensors"))
    return folder
