"""Phi-3 / Phi-4 (issue 43): transformers' ``Phi3ForCausalLM`` against sluice on the same weights.

Two tiny random-weight models written by transformers itself (config, random weights,
``save_pretrained`` as safetensors: fused ``qkv_proj`` and ``gate_up_proj``), and the same
weights as a GGUF in llama.cpp's phi3 layout (``attn_qkv``, ``ffn_up`` holding gate and up
stacked, ``rope_factors_long`` / ``rope_factors_short``, ``rope.scaling.original_context_length``
and ``attn_factor``, Q/K unpermuted):

* "longrope": LongRoPE with original_max_position_embeddings 32 and max_position_embeddings
  256 (attention factor sqrt(1 + ln 8 / ln 32)). The short factors are checked with the model
  built for a context of 32 (``max_seq_len``) on prompts that fit it, the long factors with the
  model built for 256 on prompts past 32, where transformers switches to them too;
* "window": a sliding window of 16 on every layer, no rope scaling.

For each: float32 logits equal transformers' (folder and GGUF, C++ stack and Python layers),
greedy continuations equal transformers' batched together, a Q8_0 GGUF stays within the bounds
test_quantization holds SmolLM2's w8a8 to; the variants we do not run are refused by name.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from sluice.engine.errors import ModelLoadError
from sluice.engine.llm import LLM
from sluice.engine.loaders import build_model
from sluice.engine.loaders.gguf_loader import load_gguf
from sluice.engine.loaders.hf_loader import load_hf_folder
from sluice.engine.models.config import ModelArchConfig
from sluice.engine.models.rope import compute_inv_freq
from sluice.engine.sampling_params import SamplingParams
from tests.model import gguf_writing, tiny_archs
from tests.model.test_logits import _assert_logits_match, _prefill_logits
from tests.model.test_quantization import MAX_LOGIT_CHANGE, MEAN_LOGIT_CHANGE

# The models' shapes (tiny_archs.phi3_config).
THETA, ORIGINAL, MAX_POS, WINDOW = 10000.0, tiny_archs.PHI3_ORIGINAL, 256, tiny_archs.PHI3_WINDOW
HEAD_DIM = tiny_archs.PHI3_HEAD_DIM
PROMPTS = [[3, 17, 400, 9, 5000, 77], [12, 13], [900, 4, 4, 4, 31, 2000, 8, 1, 65, 101, 7]]
# Past ORIGINAL (long factors) and past WINDOW.
_gen = torch.Generator().manual_seed(3)
LONG_PROMPTS = [torch.randint(2, 30000, (n,), generator=_gen).tolist() for n in (34, 40, 47)]
VARIANTS = ["longrope", "window"]


@pytest.fixture(scope="module", params=VARIANTS)
def phi3(request, tmp_path_factory, smollm2_tokenizer):
    """(variant, folder, transformers model)."""
    from transformers import Phi3ForCausalLM

    folder = tmp_path_factory.mktemp(f"tiny_phi3_{request.param}")
    smollm2_tokenizer.save_folder(folder)
    torch.manual_seed(0)
    model = Phi3ForCausalLM(tiny_archs.phi3_config(request.param, smollm2_tokenizer.vocab_size)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.5) if "norm" in name else p.normal_(0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return request.param, folder, model


def _gguf_tensors(hf) -> dict[str, np.ndarray]:
    sd = {k: v.numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for i in range(hf.config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out |= {b + "attn_norm.weight": sd[p + "input_layernorm.weight"],
                b + "ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
                b + "attn_qkv.weight": sd[p + "self_attn.qkv_proj.weight"],
                b + "attn_output.weight": sd[p + "self_attn.o_proj.weight"],
                b + "ffn_up.weight": sd[p + "mlp.gate_up_proj.weight"],          # gate then up
                b + "ffn_down.weight": sd[p + "mlp.down_proj.weight"]}
    return out


def _write_gguf(path, hf, q8_0: bool = False, rope_dims: int | None = None, drop: str | None = None) -> None:
    """llama.cpp's phi3 layout and metadata (its converter's Phi3MiniModel)."""
    config = hf.config
    writer = gguf_writing.start(path, "phi3", config, rope_base=THETA)
    writer.add_rope_dimension_count(rope_dims or HEAD_DIM)
    tensors = _gguf_tensors(hf)
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
    rope = config.rope_parameters
    if rope.get("rope_type") == "longrope":
        scale = config.max_position_embeddings / ORIGINAL
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(ORIGINAL)))
        writer.add_rope_scaling_orig_ctx_len(ORIGINAL)
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    tensors.pop(drop, None)
    gguf_writing.finish(writer, tensors, lambda name, w: q8_0 and w.ndim == 2)


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _cases(variant: str) -> list[tuple[int | None, list[list[int]]]]:
    """(the context the model is built for, the prompts that agree with transformers there)."""
    if variant == "longrope":
        return [(ORIGINAL, PROMPTS), (None, LONG_PROMPTS)]       # short factors; long factors
    return [(None, PROMPTS + LONG_PROMPTS)]


def test_the_config_and_the_gguf_describe_the_same_model(phi3, tmp_path):
    variant, folder, hf = phi3
    arch, _ = load_hf_folder(folder)
    _write_gguf(tmp_path / "m.gguf", hf)
    from_gguf, _, _ = load_gguf(tmp_path / "m.gguf")
    assert arch.architecture == "phi3" and not arch.attention_bias and arch.head_dim == HEAD_DIM
    # GGUF stores the epsilon and the factors as float32, and the attention factor explicitly.
    assert dataclasses.replace(from_gguf, rms_norm_eps=arch.rms_norm_eps, rope_scaling=arch.rope_scaling) == arch
    if variant == "window":
        assert arch.sliding_window == WINDOW and arch.sliding_layers is None and arch.rope_scaling is None
        return
    assert arch.rope_scaling["original_max_position_embeddings"] == ORIGINAL
    for seq_len in (None, ORIGINAL, ORIGINAL + 1):
        ours, scale = compute_inv_freq(arch, seq_len)
        theirs, their_scale = compute_inv_freq(from_gguf, seq_len)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
        assert math.isclose(scale, their_scale, rel_tol=1e-6)


def test_longrope_frequencies_are_transformers(phi3):
    """Short factors up to the original length, long ones past it, and the attention factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    variant, folder, hf = phi3
    arch, _ = load_hf_folder(folder)
    if variant != "longrope":       # no rope scaling: transformers' default frequencies, unscaled
        ours, scale = compute_inv_freq(arch, None)
        rotary = hf.model.rotary_emb
        assert torch.equal(ours, rotary.inv_freq) and scale == rotary.attention_scaling == 1.0
        return
    for seq_len, theirs_len in ((ORIGINAL, ORIGINAL), (ORIGINAL + 1, ORIGINAL + 1), (None, MAX_POS)):
        ours, scale = compute_inv_freq(arch, seq_len)
        theirs, their_scale = ROPE_INIT_FUNCTIONS["longrope"](hf.config, None, seq_len=theirs_len)
        assert torch.equal(ours, theirs) and scale == their_scale
    assert not torch.equal(compute_inv_freq(arch, ORIGINAL)[0], compute_inv_freq(arch, ORIGINAL + 1)[0])


@pytest.mark.parametrize("layers", ["cpp", "python"])
@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_float32_logits_match_transformers(phi3, tmp_path, monkeypatch, layers, source):
    variant, folder, hf = phi3
    if layers == "python":
        monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")
    if source == "gguf":
        _write_gguf(tmp_path / "m.gguf", hf)
    for max_seq_len, prompts in _cases(variant):
        if source == "gguf":
            arch, weights, _ = load_gguf(tmp_path / "m.gguf")
        else:
            arch, weights = load_hf_folder(folder)
        model = build_model(arch, weights, torch.float32, torch.device("cpu"), max_seq_len)
        assert (model._cpu_decoder() is not None) == (layers == "cpp")
        for ids in prompts:
            _assert_logits_match(_prefill_logits(model, ids), _reference(hf, ids))


@pytest.mark.parametrize("layers", ["cpp", "python"])
def test_greedy_batched_matches_transformers(phi3, monkeypatch, layers):
    """The engine builds the model for its whole context (256 > 32: long factors), so the prompts
    run past the original length, where transformers' generate uses the long factors too."""
    variant, folder, hf = phi3
    if layers == "python":
        monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")
    llm = LLM(str(folder), quantization="none", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=16)
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        ours = [r.outputs[0].token_ids for r in llm.generate(LONG_PROMPTS, params)]   # one batch, chunked prefill
    finally:
        llm.close()
    with torch.no_grad():
        theirs = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=10, do_sample=False)[0, len(p):].tolist() for p in LONG_PROMPTS]
    assert ours == theirs


def test_an_engine_serving_the_original_context_takes_the_short_factors(phi3):
    """max_model_len within original_max_position_embeddings: the engine builds its model for
    that context, so LongRoPE takes its short factors, as transformers does for every sequence
    that fits it (a model built for 256 would take the long ones and answer differently). The
    window variant has no rope scaling: the shorter context changes nothing there."""
    _variant, folder, hf = phi3
    llm = LLM(str(folder), quantization="none", kv_cache_memory_bytes=8 << 20, max_model_len=ORIGINAL)
    try:
        params = SamplingParams(max_tokens=ORIGINAL - 12, temperature=0.0, ignore_eos=True)
        ours = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
    finally:
        llm.close()
    with torch.no_grad():
        theirs = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=ORIGINAL - 12, do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    assert ours == theirs


def test_a_q8_0_gguf_stays_within_the_block_formats_bounds(phi3, tmp_path):
    variant, _, hf = phi3
    _write_gguf(tmp_path / "q.gguf", hf, q8_0=True)
    changes = []
    for max_seq_len, prompts in _cases(variant):
        arch, weights, _ = load_gguf(tmp_path / "q.gguf")
        model = build_model(arch, weights, torch.float32, torch.device("cpu"), max_seq_len, quantization="w8a8")
        assert model._cpu_decoder() is not None          # the C++ stack over the fused blocks as stored
        changes += [(_prefill_logits(model, ids) - _reference(hf, ids)).abs() for ids in prompts]
    assert max(c.max() for c in changes) <= MAX_LOGIT_CHANGE["w8a8"]
    assert torch.cat([c.flatten() for c in changes]).mean() <= MEAN_LOGIT_CHANGE["w8a8"]


PHI3 = {"model_type": "phi3", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256}
LONGROPE = {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}


@pytest.mark.parametrize("extra, message", [
    ({"partial_rotary_factor": 0.75}, r"partial_rotary_factor: RoPE over part of each head \(got 0\.75"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     r"partial_rotary_factor: RoPE over part of each head \(got 0\.5"),
    ({"hidden_act": "gelu"}, r"hidden_act: only silu is supported for phi3, got 'gelu'"),
    (LONGROPE, r"original_max_position_embeddings: longrope scaling needs it"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}, "original_max_position_embeddings": 32},
     r"rope_scaling: longrope scaling needs 'long_factor'"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [0.0] * 8},
      "original_max_position_embeddings": 32}, r"rope_scaling.long_factor: must be a list of positive"),
])
def test_what_is_not_supported_is_refused_by_name(extra, message):
    with pytest.raises(ValueError, match=message):
        ModelArchConfig.from_hf_config({**PHI3, **extra})


def test_su_is_longrope():
    """Early Phi-3 128k configs call LongRoPE "su", with the original length at the top level."""
    arch = ModelArchConfig.from_hf_config({**PHI3, **LONGROPE, "original_max_position_embeddings": 32})
    su = ModelArchConfig.from_hf_config({**PHI3, "original_max_position_embeddings": 32, "rope_scaling": {
        **LONGROPE["rope_scaling"], "type": "su"}})
    assert su == arch and arch.rope_scaling["rope_type"] == "longrope"
    assert arch.rope_scaling["original_max_position_embeddings"] == 32


def test_longrope_factors_of_the_wrong_length_are_refused_by_name():
    arch = ModelArchConfig.from_hf_config({**PHI3, "original_max_position_embeddings": 32, "rope_scaling": {
        "type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 7}})
    assert compute_inv_freq(arch, 32)[0].shape == (8,)
    with pytest.raises(ValueError, match=r"rope_scaling.long_factor: 7 factors for head_dim 16 \(expected 8\)"):
        compute_inv_freq(arch, 33)


def test_a_gguf_with_partial_rotary_or_half_its_factors_is_refused(phi3, tmp_path):
    variant, _, hf = phi3
    _write_gguf(tmp_path / "p.gguf", hf, rope_dims=HEAD_DIM // 2)
    with pytest.raises(ModelLoadError, match=r"phi3\.rope\.dimension_count: RoPE over 8 of each head's 16"):
        load_gguf(tmp_path / "p.gguf")
    if variant == "longrope":
        _write_gguf(tmp_path / "h.gguf", hf, drop="rope_factors_short.weight")
        with pytest.raises(ModelLoadError, match=r"LongRoPE needs both .*found only rope_factors_long\.weight"):
            load_gguf(tmp_path / "h.gguf")


def test_tensor_parallelism_splits_fused_checkpoints_and_refuses_what_does_not_divide():
    """The fused q/k/v and gate/up are sliced per part (test_tp_architectures serves them)."""
    from sluice.engine.parallel.tensor import plan_shard

    arch = ModelArchConfig.from_hf_config(PHI3)
    assert [(s.q_heads, s.kv_heads, s.inter) for s in (plan_shard(arch, r, 2) for r in range(2))] == [(2, 1, 48)] * 2
    with pytest.raises(ValueError, match=r"tensor_parallel_shards: 4 ranks need at least 4 key/value heads"):
        plan_shard(arch, 0, 4)
