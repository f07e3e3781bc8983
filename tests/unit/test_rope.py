"""Our rotary embedding equals transformers' for every rope-scaling kind we accept.

For default, linear, dynamic (NTK), yarn and llama3 scaling: the inverse frequencies and the
attention factor equal ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` (the default kind
against ``LlamaRotaryEmbedding``), and rotating q/k with our half-split ``apply_rotary`` equals
``apply_rotary_pos_emb`` with transformers' cos/sin, bit for bit in float32. Bad rope configs
raise ValueError naming the field.
"""
from __future__ import annotations

import pytest
import torch

from sluice.engine.models.config import ModelArchConfig, normalize_rope_scaling
from sluice.engine.models.rope import RotaryEmbedding, apply_rotary, compute_inv_freq

HEAD_DIM, THETA, MPE = 64, 10000.0, 256
SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2,
     "mscale": 0.8, "mscale_all_dim": 0.6},
    {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 64, "attention_factor": 1.3,
     "truncate": False},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
]


def _arch(rope_scaling, head_dim=HEAD_DIM) -> ModelArchConfig:
    return ModelArchConfig(
        architecture="llama", vocab_size=32, hidden_size=head_dim * 4, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        rms_norm_eps=1e-6, rope_theta=THETA, max_position_embeddings=MPE, rope_scaling=rope_scaling,
    )


def _hf_config(rope_scaling, head_dim=HEAD_DIM):
    from transformers import LlamaConfig

    params = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": THETA}
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                       max_position_embeddings=MPE, rope_parameters=params)


def _hf_inv_freq(rope_scaling, seq_len=None, head_dim=HEAD_DIM):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _hf_config(rope_scaling, head_dim)
    if rope_scaling is None:
        emb = LlamaRotaryEmbedding(config)
        return emb.inv_freq, emb.attention_scaling
    return ROPE_INIT_FUNCTIONS[rope_scaling["rope_type"]](config, "cpu", seq_len=seq_len)


@pytest.mark.oracle
@pytest.mark.parametrize("rope_scaling", SCALINGS, ids=lambda s: "default" if s is None else s["rope_type"])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_inv_freq_matches_transformers(rope_scaling, head_dim):
    ours, our_scale = compute_inv_freq(_arch(rope_scaling, head_dim))
    ref, ref_scale = _hf_inv_freq(rope_scaling, head_dim=head_dim)
    assert ours.dtype == torch.float32 and ours.shape == (head_dim // 2,)
    torch.testing.assert_close(ours, ref.float(), rtol=0, atol=0)
    assert our_scale == pytest.approx(ref_scale, rel=1e-12)


@pytest.mark.oracle
def test_dynamic_ntk_stretches_past_max_positions_like_transformers():
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    ours, _ = compute_inv_freq(_arch(scaling), seq_len=3 * MPE)
    ref, _ = _hf_inv_freq(scaling, seq_len=3 * MPE)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    base, _ = compute_inv_freq(_arch(None))
    assert (ours[1:] < base[1:]).all()  # a larger base: every non-zero-index frequency is lower


@pytest.mark.oracle
@pytest.mark.parametrize("rope_scaling", SCALINGS, ids=lambda s: "default" if s is None else s["rope_type"])
def test_rotation_matches_apply_rotary_pos_emb(rope_scaling):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 2, 7, 63, 64, 200, 255, 1000])
    q = torch.randn(len(positions), 4, HEAD_DIM)   # [T, Hq, D]
    k = torch.randn(len(positions), 2, HEAD_DIM)   # [T, Hkv, D]
    rotary = RotaryEmbedding(_arch(rope_scaling))
    cos, sin = rotary.cos_sin(positions, torch.float32)
    # transformers' cos/sin: emb = cat(freqs, freqs), times the attention factor.
    inv_freq, scale = _hf_inv_freq(rope_scaling)
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    ref_q, ref_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], (emb.cos() * scale)[None], (emb.sin() * scale)[None])
    torch.testing.assert_close(apply_rotary(q, cos, sin), ref_q[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(apply_rotary(k, cos, sin), ref_k[0].transpose(0, 1), rtol=0, atol=0)


def test_rotation_preserves_norm_and_position_zero_is_identity():
    x = torch.randn(3, 2, HEAD_DIM)
    cos, sin = RotaryEmbedding(_arch(None)).cos_sin(torch.tensor([0, 5, 100]), torch.float32)
    out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[0], x[0])
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))


def test_normalize_accepts_old_and_new_spellings():
    assert normalize_rope_scaling({"type": "linear", "factor": 2.0}) == {"rope_type": "linear", "factor": 2.0}
    assert normalize_rope_scaling({"rope_type": "default", "rope_theta": 1e4}) is None
    assert normalize_rope_scaling(None) is None


@pytest.mark.parametrize("bad, match", [
    ({"rope_type": "proportional", "factor": 2.0}, "rope_scaling: rope_type must be one of"),
    ({"rope_type": "linear"}, "rope_scaling: linear scaling needs 'factor'"),
    ({"rope_type": "linear", "factor": -1.0}, "rope_scaling.factor"),
    ({"rope_type": "llama3", "factor": 8.0}, "rope_scaling: llama3 scaling needs 'low_freq_factor'"),
])
def test_bad_rope_scaling_names_the_field(bad, match):
    with pytest.raises(ValueError, match=match):
        _arch(bad)


@pytest.mark.parametrize("rope_scaling", SCALINGS, ids=lambda s: "default" if s is None else s["rope_type"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_table_gives_the_computed_values_alone_and_in_batches(rope_scaling, dtype):
    """cos_sin reads a table of positions on the CPU; each row is what the ops give it on the fly,
    for a position alone or among others, also after the table grew."""
    rotary = RotaryEmbedding(_arch(rope_scaling, 80))
    for positions in (torch.tensor([5]), torch.tensor([300, 2, 299, 0]), torch.arange(1000, 1100),
                      torch.tensor([4000]), torch.tensor([17, 3999])):
        got = rotary.cos_sin(positions, dtype)
        want = rotary._compute(positions, dtype)
        alone = [rotary._compute(p.reshape(1), dtype) for p in positions[:3]]
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == dtype and torch.equal(g, w)
        for i, a in enumerate(alone):
            assert torch.equal(got[0][i], a[0][0]) and torch.equal(got[1][i], a[1][0])
    assert rotary._tables[dtype][0].shape[0] == 4096     # grown by doubling past position 3999
