"""Llama 3.1/3.2 GGUF files: RoPE scaling carried as ``rope_freqs.weight`` (llama.cpp's divisors
of the base frequencies) is applied, not refused: a tiny Llama written with the divisors of a
llama3 scaling gives transformers' logits for the same weights with that ``rope_scaling``, at
positions far past ``original_max_position_embeddings`` where the scaling matters."""
from __future__ import annotations

import numpy as np
import torch

from sluice.engine.loaders import load_model
from sluice.engine.models.config import ModelArchConfig
from sluice.engine.models.rope import compute_inv_freq
from tests.model.test_logits import _prefill_logits
from tests.unit.test_loader_errors import D, H, HEADS, INTER, KV_HEADS, LAYERS, TOKENS, _hf_weights, write_tiny_gguf

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def _arch(rope_scaling) -> ModelArchConfig:
    return ModelArchConfig(architecture="llama", vocab_size=len(TOKENS), hidden_size=H, intermediate_size=INTER,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                           head_dim=D, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
                           rope_scaling=rope_scaling)


def _divisors() -> np.ndarray:
    base = compute_inv_freq(_arch(None))[0]
    return (base / compute_inv_freq(_arch(LLAMA3))[0]).numpy()


def test_rope_freqs_give_the_llama3_frequencies():
    ours = compute_inv_freq(_arch({"rope_type": "factors", "factors": tuple(map(float, _divisors()))}))[0]
    torch.testing.assert_close(ours, compute_inv_freq(_arch(LLAMA3))[0], rtol=1e-6, atol=0)
    assert not np.allclose(_divisors(), 1.0)          # the scaling does something at this size


def test_a_gguf_with_rope_freqs_matches_transformers_llama3(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    weights = _hf_weights(np.random.default_rng(3))
    path = write_tiny_gguf(tmp_path / "llama31.gguf", weights, rope_freqs=_divisors())
    ours = load_model(path, dtype="float32")
    assert ours.arch.rope_scaling["rope_type"] == "factors"
    config = LlamaConfig(vocab_size=len(TOKENS), hidden_size=H, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=D, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=128, rope_scaling=dict(LLAMA3),
                         tie_word_embeddings=True)
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    hf.tie_weights()
    ids = [int(i) for i in np.random.default_rng(4).integers(3, len(TOKENS), size=100)]
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_prefill_logits(ours.model, ids), theirs, atol=1e-4, rtol=1e-4)
