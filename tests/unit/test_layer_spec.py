"""The per-architecture layer description (``models.layer_spec``) both layer stacks build from."""
from __future__ import annotations

import dataclasses

import pytest

from sluice.engine.models.config import ModelArchConfig
from sluice.engine.models.layer_spec import LayerSpec

BASE = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def _spec(model_type: str, **extra) -> LayerSpec:
    return LayerSpec.from_arch(ModelArchConfig.from_hf_config({**BASE, "model_type": model_type, **extra}))


def test_each_architecture_says_what_sets_its_layers_apart():
    traits = {t: (_spec(t).attention.qkv_bias, _spec(t).attention.qk_norm) for t in ("llama", "mistral", "qwen2", "qwen3")}
    assert traits == {"llama": (False, False), "mistral": (False, False), "qwen2": (True, False), "qwen3": (False, True)}
    assert _spec("llama", attention_bias=True).attention.qkv_bias        # a Llama config may ask for the bias
    spec = _spec("qwen3", head_dim=32, rms_norm_eps=1e-5)
    assert (spec.attention.head_dim, spec.attention.q_size, spec.attention.kv_size) == (32, 128, 64)
    assert spec.norm_eps == 1e-5 and spec.attention.scale == 32 ** -0.5 and (spec.norm, spec.mlp) == ("rms", "swiglu")


@pytest.mark.parametrize("model_type, flag, window", [
    ("qwen3", False, None), ("qwen3", True, 32), ("qwen2", True, 32), ("mistral", False, 32), ("llama", True, None)])
def test_a_sliding_window_is_in_force_as_each_architecture_reads_it(model_type, flag, window):
    spec = _spec(model_type, sliding_window=32, use_sliding_window=flag, max_window_layers=0)   # every layer slides
    assert spec.attention.sliding_window == window


def test_a_kind_no_stack_implements_is_refused_by_name():
    spec = _spec("llama")
    with pytest.raises(ValueError, match=r"norm: must be one of \('rms', 'gemma_rms'\), got 'layer'"):
        dataclasses.replace(spec, norm="layer")
    with pytest.raises(ValueError, match=r"mlp: must be one of \(.*'swiglu'.*'geglu'\), got 'relu2'"):
        dataclasses.replace(spec, mlp="relu2")


def test_gemma_layers_say_their_norms_mlp_scale_and_cap():
    gemma = {"head_dim": 24, "query_pre_attn_scalar": 20, "sliding_window": 8, "num_hidden_layers": 4}
    spec = _spec("gemma2", **gemma, attn_logit_softcapping=5.0)
    assert (spec.norm, spec.mlp, spec.sandwich_norms) == ("gemma_rms", "geglu", True)
    assert spec.attention.scale == 20 ** -0.5 and spec.attention.softcap == 5.0 and not spec.attention.qk_norm
    assert spec.cpp_stack_lacks() is None
    spec3 = _spec("gemma3_text", **gemma)
    assert spec3.attention.qk_norm and spec3.attention.softcap is None and spec3.attention.scale == 20 ** -0.5
    assert _spec("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32).cpp_stack_lacks() is None
    olmoe = _spec("olmoe", num_experts=4, num_experts_per_tok=2, intermediate_size=32)
    assert olmoe.attention.qk_norm_full and olmoe.cpp_stack_lacks() is None   # StackSpec.qk_norm_full
