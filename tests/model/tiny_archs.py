"""Tiny random-weight transformers models, one per architecture sluice supports
(``engine.models.config.ARCHITECTURES``), shared by the per-architecture tests and
test_architecture_paths.

Each model is built by transformers itself from a config (2-4 layers, hidden 64, GQA 4:2) with
random weights set far from transformers' near-zero init, so that a mistake in any part shows in
the logits: projections N(0, 0.15), norm weights N(1, 0.5) (Gemma's, stored as ``weight - 1``,
N(0, 0.5)), MoE router rows N(0, 0.5) so that the top-k experts are clear. ``write_folder`` saves
one beside SmolLM2's tokenizer as a Hugging Face folder (config.json, safetensors).
"""
from __future__ import annotations

import torch

# ---- the per-architecture tests' shapes ---------------------------------------------------------
MOE_COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  num_experts_per_tok=2)
DENSE_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)

# Gemma (test_gemma): 4 layers alternating sliding (window 8) and global, head_dim 24.
GEMMA_LAYERS, GEMMA_HEAD_DIM, GEMMA_WINDOW = 4, 24, 8
GEMMA3_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
GEMMA3_LOCAL_THETA, GEMMA3_GLOBAL_THETA = 500.0, 20000.0

# Phi-3 (test_phi3): longrope with an original context of 32, or a window of 16.
PHI3_ORIGINAL, PHI3_WINDOW, PHI3_HEAD_DIM = 32, 16, 16


def moe_model(model_type: str, vocab: int):
    """test_moe's models: Mixtral (6 experts), Qwen2-MoE (shared expert, top-k weights not
    renormalised), OLMoE (q/k norms over the whole projections), Qwen3-MoE (8 experts, head_dim 32)."""
    import transformers as tf

    if model_type == "mixtral":
        config = tf.MixtralConfig(vocab_size=vocab, intermediate_size=96, num_local_experts=6, **MOE_COMMON)
        return tf.MixtralForCausalLM(config)
    if model_type == "qwen2_moe":
        # norm_topk_prob False (Qwen1.5-MoE's): the top-2 weights are not renormalised.
        config = tf.Qwen2MoeConfig(vocab_size=vocab, intermediate_size=128, moe_intermediate_size=64,
                                   shared_expert_intermediate_size=96, num_experts=6, norm_topk_prob=False,
                                   **MOE_COMMON)
        return tf.Qwen2MoeForCausalLM(config)
    if model_type == "olmoe":
        # OLMoE-1B-7B's defaults: norm_topk_prob False, clip_qkv None; intermediate_size is per expert.
        config = tf.OlmoeConfig(vocab_size=vocab, intermediate_size=96, num_experts=6, **MOE_COMMON)
        assert config.norm_topk_prob is False and config.clip_qkv is None
        return tf.OlmoeForCausalLM(config)
    if model_type == "qwen3_moe":
        config = tf.Qwen3MoeConfig(vocab_size=vocab, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
                                   norm_topk_prob=True, head_dim=32, **MOE_COMMON)
        return tf.Qwen3MoeForCausalLM(config)
    raise ValueError(f"model_type: {model_type!r} is not one of the tiny MoE models")


def gemma_config(variant: str, vocab: int):
    """test_gemma's configs: "gemma2" / "gemma2_scalar" (attention soft-capped at 5,
    query_pre_attn_scalar 20 for the latter), "gemma3" (q/k norms, layer 2 global with base 20000
    and linear scaling 2, the sliding ones base 500); final logits capped at 8."""
    from transformers import Gemma2Config, Gemma3TextConfig

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=GEMMA_LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=GEMMA_HEAD_DIM,
                  max_position_embeddings=256, sliding_window=GEMMA_WINDOW, rms_norm_eps=1e-6,
                  final_logit_softcapping=8.0, pad_token_id=None, eos_token_id=None, bos_token_id=None)
    if variant.startswith("gemma2"):
        return Gemma2Config(**common, attn_logit_softcapping=5.0,
                            query_pre_attn_scalar=20 if variant == "gemma2_scalar" else GEMMA_HEAD_DIM)
    return Gemma3TextConfig(**common, query_pre_attn_scalar=GEMMA_HEAD_DIM, layer_types=GEMMA3_TYPES, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_THETA},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": GEMMA3_GLOBAL_THETA}})


def phi3_config(variant: str, vocab: int):
    """test_phi3's configs: "longrope" (random short and long factors, original context 32) or
    "window" (a sliding window of 16)."""
    from transformers import Phi3Config

    if variant == "longrope":
        g = torch.Generator().manual_seed(5)
        extra = dict(original_max_position_embeddings=PHI3_ORIGINAL, rope_scaling={
            "rope_type": "longrope",
            "short_factor": (1 + 0.5 * torch.rand(PHI3_HEAD_DIM // 2, generator=g)).tolist(),
            "long_factor": (2 + 8 * torch.rand(PHI3_HEAD_DIM // 2, generator=g)).tolist()})
    else:
        extra = dict(sliding_window=PHI3_WINDOW)
    return Phi3Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=None,
                      eos_token_id=None, bos_token_id=None, **extra)


def dense_model(arch: str, vocab: int):
    """Llama; Mistral with a window of 8 (test_sliding_window); Qwen2 (q/k/v biases) with layer 0
    global and layer 1 sliding through 8 (test_sliding_window's qwen2_mixed); Qwen3 (per-head q/k
    norms, head_dim 32: test_qwen3); Phi-3 with a window (fused projections); Gemma 2 and 3."""
    import transformers as tf

    if arch == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=vocab, rope_theta=10000.0, **DENSE_COMMON))
    if arch == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(vocab_size=vocab, sliding_window=8, **DENSE_COMMON))
    if arch == "qwen2":
        config = tf.Qwen2Config(vocab_size=vocab, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                **DENSE_COMMON)
        assert config.layer_types == ["full_attention", "sliding_attention"]
        return tf.Qwen2ForCausalLM(config)
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(vocab_size=vocab, head_dim=32, rope_theta=10000.0, **DENSE_COMMON))
    if arch == "phi3":
        return tf.Phi3ForCausalLM(phi3_config("window", vocab))
    if arch in ("gemma2", "gemma3"):
        return (tf.Gemma2ForCausalLM if arch == "gemma2" else tf.Gemma3ForCausalLM)(gemma_config(arch, vocab))
    raise ValueError(f"arch: {arch!r} is not one of the tiny dense models")


def randomize(model, seed: int = 0):
    """Fills every weight as the per-architecture tests do (see the module docstring); returns the
    model, in eval mode."""
    gemma = model.config.model_type.startswith("gemma")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                std, mean = 0.5, (0.0 if gemma else 1.0)
            elif name.endswith("mlp.gate.weight"):      # an MoE router
                std, mean = 0.5, 0.0
            else:
                std, mean = 0.15, 0.0
            p.copy_(torch.randn(p.shape, generator=gen) * std + mean)
    return model.eval()


def build(arch: str, vocab: int, seed: int = 0):
    """A random-weight transformers model of ``arch`` (a key of ARCHITECTURES)."""
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        return randomize(moe_model(arch, vocab), seed)
    return randomize(dense_model(arch, vocab), seed)


def write_folder(folder, model, tokenizer):
    """``model`` saved as safetensors beside ``tokenizer`` (sluice's Tokenizer) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_folder(folder)
    model.save_pretrained(folder, safe_serialization=True)
    return folder
