"""Gemma 2 and Gemma 3 text (issue 43): transformers' ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``
against sluice on the same weights.

Tiny random-weight models written by transformers itself (config, random weights with the norm
weights far from zero, so that (1 + weight) matters; ``save_pretrained`` as safetensors), and the
same weights as a GGUF in llama.cpp's gemma2 / gemma3 layout (its converter's tensor names, the
norm weights stored with 1 added, ``attn_logit_softcapping`` / ``final_logit_softcapping``,
``attention.sliding_window``, a per-layer ``sliding_window_pattern``, ``rope.freq_base_swa``,
linear rope scaling):

* "gemma2": 4 layers alternating sliding (window 8) and global, head_dim 24 (not hidden / heads
  = 16), attention soft-capped at 5 and logits at 8 (small caps, so that the tanh bends);
* "gemma2_scalar": the same with ``query_pre_attn_scalar`` 20 (not head_dim), folder only: a
  GGUF does not carry it (llama.cpp derives it from the model size, ``test_the_gguf_query_scale``);
* "gemma3": 4 layers, layer 2 global, per-head q/k norms, the sliding layers rotating with base
  500, the global one with base 20000 and linear scaling 2, final logits capped at 8.

For each: float32 logits equal transformers' (folder and GGUF), greedy continuations past the
window equal transformers' with several requests batched (chunked prefill), a Q8_0 GGUF within
the bounds test_quantization holds SmolLM2's w8a8 to; through the C++ stack and the Python layers,
with the torch attention backend (Gemma 2's soft-capped attention needs it); Gemma 3 also through
the Triton kernels (under the interpreter here); everything not supported is refused by name.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sluice.engine.llm import LLM
from sluice.engine.loaders import build_model
from sluice.engine.loaders.gguf_loader import load_gguf
from sluice.engine.loaders.hf_loader import load_hf_folder
from sluice.engine.models.config import ModelArchConfig
from sluice.engine.sampling_params import SamplingParams
from tests.model import gguf_writing, tiny_archs
from tests.model.test_logits import _assert_logits_match, _prefill_logits
from tests.model.test_quantization import MAX_LOGIT_CHANGE, MEAN_LOGIT_CHANGE

# The models' shapes (tiny_archs.gemma_config).
LAYERS, HEAD_DIM, WINDOW = tiny_archs.GEMMA_LAYERS, tiny_archs.GEMMA_HEAD_DIM, tiny_archs.GEMMA_WINDOW
GEMMA3_TYPES = tiny_archs.GEMMA3_TYPES
LOCAL_THETA, GLOBAL_THETA = tiny_archs.GEMMA3_LOCAL_THETA, tiny_archs.GEMMA3_GLOBAL_THETA
_gen = torch.Generator().manual_seed(7)
# Past the window (8) and past a block (the engine's 16) several times.
PROMPTS = [[3, 17, 400, 9, 5000, 77]] + [torch.randint(2, 30000, (n,), generator=_gen).tolist() for n in (21, 37)]
VARIANTS = ["gemma2", "gemma2_scalar", "gemma3"]


@pytest.fixture(scope="module", params=VARIANTS)
def gemma(request, tmp_path_factory, smollm2_tokenizer):
    """(variant, folder, transformers model)."""
    from transformers import Gemma2ForCausalLM, Gemma3ForCausalLM

    variant = request.param
    folder = tmp_path_factory.mktemp(f"tiny_{variant}")
    smollm2_tokenizer.save_folder(folder)
    torch.manual_seed(0)
    cls = Gemma2ForCausalLM if variant.startswith("gemma2") else Gemma3ForCausalLM
    model = cls(tiny_archs.gemma_config(variant, smollm2_tokenizer.vocab_size)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5) if "norm" in name else p.normal_(0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return variant, folder, model


# transformers' names -> llama.cpp's (its converter's tensor map for gemma2 / gemma3).
_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _gguf_tensors(hf) -> dict[str, np.ndarray]:
    """llama.cpp's layout: Q/K not permuted (NEOX RoPE), every norm weight with 1 added, tied output."""
    out = {}
    for name, t in hf.state_dict().items():
        w = t.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            w = w + 1.0
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module = rest.removesuffix(".weight")
            out[f"blk.{i}.{_GGUF_LAYER[module]}.weight"] = w
    return out


def _write_gguf(path, hf, q8_0: bool = False, pattern: list[bool] | None = None) -> None:
    import gguf

    config = hf.config
    arch = "gemma2" if config.model_type == "gemma2" else "gemma3"
    writer = gguf_writing.start(path, arch, config, head_dim=config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "gemma2":
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    else:
        writer.add_rope_freq_base(GLOBAL_THETA)
        writer.add_rope_freq_base_swa(LOCAL_THETA)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
        writer.add_sliding_window_pattern(pattern or [t == "sliding_attention" for t in GEMMA3_TYPES])
    gguf_writing.finish(writer, _gguf_tensors(hf), lambda name, w: q8_0 and w.ndim == 2)


@pytest.fixture(scope="module")
def gguf_path(gemma, tmp_path_factory):
    variant, _, hf = gemma
    path = tmp_path_factory.mktemp(f"gguf_{variant}") / "m.gguf"
    _write_gguf(path, hf)
    return path


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def test_the_config_and_the_gguf_describe_the_same_model(gemma, gguf_path):
    variant, folder, hf = gemma
    arch, _ = load_hf_folder(folder)
    g = arch.gemma
    assert arch.head_dim == HEAD_DIM and arch.tie_word_embeddings and arch.sliding_window == WINDOW
    assert g.final_softcap == 8.0
    if variant.startswith("gemma2"):
        assert arch.architecture == "gemma2" and arch.sliding_layers == (0, 2) and g.attn_softcap == 5.0
        assert g.local_rope_theta is None and arch.rope_theta == 10000.0 and arch.rope_scaling is None
        assert g.query_pre_attn_scalar == (20 if variant == "gemma2_scalar" else HEAD_DIM)
    else:
        assert arch.architecture == "gemma3" and arch.sliding_layers == (0, 1, 3) and g.attn_softcap is None
        assert g.local_rope_theta == LOCAL_THETA and g.local_layers == (0, 1, 3)
        assert arch.rope_theta == GLOBAL_THETA and arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    if variant == "gemma2_scalar":
        return                   # a GGUF carries no query_pre_attn_scalar (test_the_gguf_query_scale)
    from_gguf, _, _ = load_gguf(gguf_path)
    # GGUF stores the epsilon as float32.
    assert dataclasses.replace(from_gguf, rms_norm_eps=arch.rms_norm_eps) == arch


def test_the_gguf_query_scale_is_llama_cpps():
    """llama.cpp scales queries by head_dim ** -0.5, by (hidden / heads) ** -0.5 for the 27B
    models (46 gemma2 layers, 62 gemma3 layers): their query_pre_attn_scalar."""
    from sluice.engine.models.gemma_config import gguf_fields

    def meta(key, default=None):
        return {"attention.sliding_window": 4096}.get(key, default)

    for arch, layers in (("gemma2", 46), ("gemma3", 62)):
        assert gguf_fields(meta, arch, layers, 4608, 32, 128, 8192)["gemma"].query_pre_attn_scalar == 144
        assert gguf_fields(meta, arch, layers - 4, 4608, 32, 128, 8192)["gemma"].query_pre_attn_scalar == 128


def test_a_gguf_sliding_window_pattern_of_the_wrong_length_is_refused(gemma, tmp_path):
    from sluice.engine.errors import ModelLoadError

    variant, _, hf = gemma
    if variant != "gemma3":
        pytest.skip("the per-layer pattern is written for gemma3")
    _write_gguf(tmp_path / "p.gguf", hf, pattern=[True, True, False])
    with pytest.raises(ModelLoadError, match=r"gemma3\.attention\.sliding_window_pattern: must give each of the "
                                             r"4 layers, got 3"):
        load_gguf(tmp_path / "p.gguf")


@pytest.mark.parametrize("layers", ["cpp", "python"])
@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_float32_logits_match_transformers(gemma, gguf_path, monkeypatch, source, layers):
    variant, folder, hf = gemma
    if source == "gguf" and variant == "gemma2_scalar":
        pytest.skip("a GGUF carries no query_pre_attn_scalar: llama.cpp derives it (test_the_gguf_query_scale)")
    if layers == "python":
        monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")
    arch, weights = load_hf_folder(folder) if source == "folder" else load_gguf(gguf_path)[:2]
    model = build_model(arch, weights, torch.float32, torch.device("cpu"))
    assert (model._cpu_decoder() is not None) == (layers == "cpp")
    for ids in PROMPTS:
        _assert_logits_match(_prefill_logits(model, ids), _reference(hf, ids))


@pytest.mark.parametrize("layers", ["cpp", "python"])
def test_greedy_batched_matches_transformers(gemma, monkeypatch, layers):
    """Three requests batched, prefill chunked at 16 tokens, 12 generated: past the window on
    the sliding layers, the global layers reading everything."""
    variant, folder, hf = gemma
    if layers == "python":
        monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")
    llm = LLM(str(folder), quantization="none", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=16)
    try:
        assert llm.engine.model_info.attention_backend == "torch"
        assert (llm.engine.runner.model._cpu_decoder() is not None) == (layers == "cpp")
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        ours = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
    finally:
        llm.close()
    with torch.no_grad():
        theirs = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=12, do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    assert ours == theirs


def test_gemma3_through_the_triton_kernels(gemma):
    """Gemma 3 (no attention soft-cap) may run on the Triton backend (CUDA's default; here under
    the interpreter): a prefill through the extend kernel, then decode steps through paged_decode,
    each step's logits transformers'. Past the window on the sliding layers."""
    from sluice.engine.attention.triton_backend import TritonAttentionBackend
    from tests.model.test_logits import _blocks_for, _caches, _meta

    variant, folder, hf = gemma
    if variant != "gemma3":
        pytest.skip("Gemma 2's soft-capped attention is refused on Triton (test_attention_soft_capping_...)")
    ids = PROMPTS[1]                                       # 21 tokens: 18 prefilled, 3 decoded
    arch, weights = load_hf_folder(folder)
    model = build_model(arch, weights, torch.float32, torch.device("cpu"))
    ref, triton = _reference(hf, ids), TritonAttentionBackend()
    table = _blocks_for(len(ids), 1)
    caches = _caches(arch, max(table) + 1)
    steps = [(0, 18)] + [(n, 1) for n in range(18, len(ids))]
    for context, count in steps:
        meta = _meta([context], [count], [table])
        hidden = model(torch.tensor(ids[context:context + count]), torch.arange(context, context + count),
                       caches, meta, triton)
        _assert_logits_match(model.compute_logits(hidden), ref[context:context + count])


def test_a_q8_0_gguf_stays_within_the_block_formats_bounds(gemma, tmp_path):
    variant, _, hf = gemma
    if variant == "gemma2_scalar":
        pytest.skip("a GGUF carries no query_pre_attn_scalar")
    _write_gguf(tmp_path / "q.gguf", hf, q8_0=True)
    arch, weights, _ = load_gguf(tmp_path / "q.gguf")
    model = build_model(arch, weights, torch.float32, torch.device("cpu"), quantization="w8a8")
    assert model._cpu_decoder() is not None          # the C++ stack over the Q8_0 blocks as stored
    changes = [(_prefill_logits(model, ids) - _reference(hf, ids)).abs() for ids in PROMPTS]
    assert max(c.max() for c in changes) <= MAX_LOGIT_CHANGE["w8a8"]
    assert torch.cat([c.flatten() for c in changes]).mean() <= MEAN_LOGIT_CHANGE["w8a8"]


# ------------------------------------------------------------------------------------ refusals
GEMMA2 = {"model_type": "gemma2", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
          "max_position_embeddings": 256, "sliding_window": 8}
GEMMA3 = {**GEMMA2, "model_type": "gemma3_text"}


@pytest.mark.parametrize("cfg, message", [
    ({**GEMMA3, "model_type": "gemma3"}, r"model_type: 'gemma3' is the multimodal Gemma3ForConditionalGeneration"),
    ({**GEMMA2, "model_type": "gemma"}, r"model_type: 'gemma' is not supported \(gemma2 and gemma3_text are\)"),
    ({**GEMMA2, "hidden_activation": "gelu"}, r"hidden_activation: only gelu_pytorch_tanh \(GeGLU\) is supported"),
    ({**GEMMA3, "attention_bias": True}, r"attention_bias: biases on a gemma3 model's projections are not supported"),
    ({**GEMMA3, "use_bidirectional_attention": True}, r"use_bidirectional_attention: bidirectional"),
    ({**GEMMA3, "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                    "full_attention": {"rope_type": "default"}}},
     r"rope_parameters.sliding_attention: RoPE scaling of the sliding layers \('linear'\) is not supported"),
    ({**GEMMA2, "layer_types": ["sliding_attention"] * 3}, r"layer_types: must give each of the 4 layers, got 3"),
    ({**GEMMA2, "attn_logit_softcapping": -1.0}, r"attn_softcap: must be a positive finite number"),
])
def test_what_is_not_supported_is_refused_by_name(cfg, message):
    with pytest.raises(ValueError, match=message):
        ModelArchConfig.from_hf_config(cfg)


def test_the_hub_spellings_read_as_transformers_reads_them():
    """Older config.json files: Gemma 3's rope_theta / rope_local_base_freq / rope_scaling and
    sliding_window_pattern at the top level; Gemma 2 without layer_types (even layers slide)."""
    arch = ModelArchConfig.from_hf_config({**GEMMA3, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                           "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                                           "sliding_window_pattern": 2})
    assert arch.sliding_layers == (0, 2) and arch.gemma.local_layers == (0, 2)
    assert arch.rope_theta == 1e6 and arch.gemma.local_rope_theta == 1e4
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert ModelArchConfig.from_hf_config(GEMMA2).sliding_layers == (0, 2)
    # transformers reads hidden_activation; the hidden_act hub configs carry beside it is ignored.
    assert ModelArchConfig.from_hf_config({**GEMMA2, "hidden_act": "gelu"}).gemma is not None
    # A window spanning the context: no layer slides, but Gemma 3's sliding-type layers keep their RoPE.
    wide = ModelArchConfig.from_hf_config({**GEMMA3, "sliding_window": 512})
    assert wide.sliding_window is None and wide.gemma.local_layers == (0, 1, 2, 3)


def test_attention_soft_capping_is_never_served_by_a_backend_without_it():
    from sluice.engine.attention.flash_attn_backend import FlashAttnBackend
    from sluice.engine.attention.selector import backend_for_models
    from sluice.engine.attention.torch_backend import TorchAttentionBackend
    from sluice.engine.attention.triton_backend import TritonAttentionBackend

    triton = TritonAttentionBackend()
    assert not FlashAttnBackend.supports_softcap and not triton.supports_softcap
    assert backend_for_models(triton, "triton", []) is triton            # no cap: unchanged
    assert isinstance(backend_for_models(triton, "auto", ["g2"]), TorchAttentionBackend)
    for name in ("triton", "flash_attn"):
        with pytest.raises(ValueError, match=rf"attention_backend={name}: g2 soft-caps its attention scores "
                                             rf"\(attn_logit_softcapping\), which the triton backend cannot apply"):
            backend_for_models(triton, name, ["g2"])
    with pytest.raises(ValueError, match=r"attention_backend=triton: attention soft-capping is not supported"):
        triton.forward(None, None, None, (None, None), None, 1.0, None, softcap=5.0)


def test_tensor_parallelism_splits_gemma_and_refuses_what_does_not_divide():
    """Gemma's heads and GeGLU features split as Llama's (test_tp_architectures serves them)."""
    from sluice.engine.parallel.tensor import plan_shard

    arch = ModelArchConfig.from_hf_config(GEMMA2)
    assert [(s.q_heads, s.kv_heads, s.inter) for s in (plan_shard(arch, r, 2) for r in range(2))] == [(2, 1, 48)] * 2
    with pytest.raises(ValueError, match=r"tensor_parallel_shards: 4 ranks need at least 4 key/value heads"):
        plan_shard(arch, 0, 4)
