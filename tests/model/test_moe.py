"""Mixture-of-experts decoders (issue 43): Mixtral, Qwen2-MoE (shared expert, sigmoid gate),
Qwen3-MoE (per-head q/k norms) and OLMoE (q/k norms over the whole projections, top-k weights not
renormalised), against transformers on the same weights.

Each is a tiny random-weight model written by transformers itself (config, random weights,
``save_pretrained`` as safetensors: the hub's per-expert names), and the same weights written as
a GGUF with the ``gguf`` package in llama.cpp's layout: experts as 3-D ``ffn_{gate,up,down}_exps``
tensors, the router ``ffn_gate_inp`` (F32), Qwen2-MoE's shared expert ``ffn_*_shexp`` and its
gate ``ffn_gate_inp_shexp`` (1-D); Mixtral as a "llama" with ``expert_count`` and Q/K rows
permuted, as llama.cpp's converter writes it.

* float32 logits equal transformers' within test_logits' tolerance, from the folder and the GGUF,
  through the C++ stack (its StackMoE; OLMoE's q/k norms over whole projections with
  StackSpec.qk_norm_full) and the Python layers; the C++ runs fail if a Python layer runs;
* greedy continuations equal transformers', the prompts batched together (chunked prefill), on
  the C++ stack;
* a Q8_0 GGUF, its experts kept as stored (w8a8, one block weight per expert), stays within the
  bounds test_quantization holds SmolLM2's w8a8 to: on average through the C++ stack, and per
  position in the Python layers, where the experts each position runs can be watched.

Each token runs 2 of 6-8 experts; the tests check that the prompts route to several experts.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.engine.errors import ModelLoadError
from sluice.engine.llm import LLM
from sluice.engine.loaders import build_model
from sluice.engine.loaders.gguf_loader import load_gguf
from sluice.engine.loaders.hf_loader import load_hf_folder
from sluice.engine.models.config import ModelArchConfig
from sluice.engine.models.moe import SparseMoE, route
from sluice.engine.sampling_params import SamplingParams
from tests.model import gguf_writing, tiny_archs
from tests.model.test_logits import _assert_logits_match, _prefill_logits
from tests.model.test_quantization import MAX_LOGIT_CHANGE, MEAN_LOGIT_CHANGE

PROMPTS = [[3, 17, 400, 9, 5000, 77], [12, 13], [900, 4, 4, 4, 31, 2000, 8, 1, 65, 101, 7]]
THETA = tiny_archs.MOE_COMMON["rope_theta"]
ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
# Expert counts and whether the top-k weights are renormalised, per architecture.
NUM_EXPERTS = {"mixtral": 6, "qwen2_moe": 6, "qwen3_moe": 8, "olmoe": 6}
NORM_TOPK = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False}


@pytest.fixture(scope="module", params=ARCHS)
def moe(request, tmp_path_factory, smollm2_tokenizer):
    """(folder, transformers model): SmolLM2's tokenizer beside a random MoE model's weights."""
    folder = tmp_path_factory.mktemp(f"tiny_{request.param}")
    smollm2_tokenizer.save_folder(folder)
    torch.manual_seed(0)
    model = tiny_archs.moe_model(request.param, smollm2_tokenizer.vocab_size).eval()
    with torch.no_grad():
        # O(1..10) logits, so that a mistake shows far above the tolerance; norm weights away from 1.
        # Router rows at 0.5: routing probabilities far from uniform, so the top 2 are clear.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row permutation (interleaved RoPE), for Mixtral."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(hf) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names. transformers holds each layer's experts as 3-D
    tensors already (``mlp.experts.gate_up_proj`` [E, 2I, hidden], ``down_proj`` [E, hidden, I]);
    llama.cpp's are the gate, up and down halves of them."""
    config, sd = hf.config, {k: v.numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for i in range(config.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if config.model_type == "mixtral":
            q, k = _permute(q, config.num_attention_heads), _permute(k, config.num_key_value_heads)
        gate, up = np.split(sd[p + "mlp.experts.gate_up_proj"], 2, axis=1)
        out |= {b + "attn_norm.weight": sd[p + "input_layernorm.weight"],
                b + "ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
                b + "attn_q.weight": q, b + "attn_k.weight": k, b + "attn_v.weight": sd[p + "self_attn.v_proj.weight"],
                b + "attn_output.weight": sd[p + "self_attn.o_proj.weight"],
                b + "ffn_gate_inp.weight": sd[p + "mlp.gate.weight"],
                b + "ffn_gate_exps.weight": gate, b + "ffn_up_exps.weight": up,
                b + "ffn_down_exps.weight": sd[p + "mlp.experts.down_proj"]}
        for name in ("q_proj", "k_proj", "v_proj"):
            if p + f"self_attn.{name}.bias" in sd:
                out[f"{b}attn_{name[0]}.bias"] = sd[p + f"self_attn.{name}.bias"]
        for name in ("q_norm", "k_norm"):
            if p + f"self_attn.{name}.weight" in sd:
                out[f"{b}attn_{name}.weight"] = sd[p + f"self_attn.{name}.weight"]
        if p + "mlp.shared_expert_gate.weight" in sd:
            for proj in ("gate", "up", "down"):
                out[f"{b}ffn_{proj}_shexp.weight"] = sd[f"{p}mlp.shared_expert.{proj}_proj.weight"]
            out[b + "ffn_gate_inp_shexp.weight"] = sd[p + "mlp.shared_expert_gate.weight"].reshape(-1)   # [hidden]
    return out


def _write_gguf(path, hf, q8_0: bool = False) -> None:
    """llama.cpp's layout and metadata; ``q8_0``: every 2-D and 3-D weight but the router and the
    shared gate (which llama.cpp keeps F32) in Q8_0 blocks."""
    config = hf.config
    arch = GGUF_ARCH[config.model_type]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf_writing.start(path, arch, config, rope_base=THETA, head_dim=head_dim)
    if config.model_type == "mixtral":
        writer.add_expert_count(config.num_local_experts)
    elif config.model_type == "olmoe":     # llama.cpp's olmoe: feed_forward_length is per expert
        writer.add_expert_count(config.num_experts)
    else:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if config.model_type == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    gguf_writing.finish(writer, _gguf_tensors(hf), lambda name, w: q8_0 and w.ndim >= 2 and "gate_inp" not in name)


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _load(moe, tmp_path, source: str):
    folder, hf = moe
    if source == "gguf":
        _write_gguf(tmp_path / "m.gguf", hf)
        arch, weights, _ = load_gguf(tmp_path / "m.gguf")
    else:
        arch, weights = load_hf_folder(folder)
    return arch, weights


def test_the_config_and_the_gguf_describe_the_same_model(moe, tmp_path):
    folder, hf = moe
    arch, _ = _load(moe, tmp_path, "folder")
    from_gguf, _ = _load(moe, tmp_path, "gguf")
    import dataclasses

    # GGUF stores the epsilon as a float32.
    assert dataclasses.replace(from_gguf, rms_norm_eps=arch.rms_norm_eps) == arch
    assert arch.architecture == hf.config.model_type and arch.num_experts_per_tok == 2
    assert arch.num_experts == NUM_EXPERTS[arch.architecture]
    assert arch.norm_topk_prob == NORM_TOPK[arch.architecture]
    assert arch.shared_expert_intermediate_size == (96 if arch.architecture == "qwen2_moe" else 0)


def _python_layers_refused(model, monkeypatch) -> None:
    """The C++ stack was chosen, and a step that fell back to the Python layers would fail."""
    assert model._cpu_decoder() is not None

    def refused(*args, **kwargs):
        raise AssertionError("a Python decoder layer ran where the C++ stack should have")

    for layer in model.layers:
        monkeypatch.setattr(layer, "forward", refused)


@pytest.mark.parametrize("layers", ["cpp", "python"])
@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_float32_logits_match_transformers(moe, tmp_path, source, layers, monkeypatch):
    _, hf = moe
    model = build_model(*_load(moe, tmp_path, source), torch.float32, torch.device("cpu"))
    assert model.spec.mlp == "moe" and model._cpu_decoder() is not None
    if layers == "python":
        model.use_python_layers()
    else:
        _python_layers_refused(model, monkeypatch)
    for ids in PROMPTS:
        _assert_logits_match(_prefill_logits(model, ids), _reference(hf, ids))


def test_the_prompts_route_to_several_experts_as_transformers_does(moe, tmp_path):
    """Routing itself: our top-k experts and weights are transformers' router's, and the prompts
    reach most experts (so the per-expert grouping is exercised, not one expert)."""
    _, hf = moe
    layer = hf.model.layers[0]
    block = layer.mlp
    x = torch.randn(40, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, their_weights, their_experts = block.gate(x)
    weights, experts = route(torch.nn.functional.linear(x, block.gate.weight), 2, hf.config.norm_topk_prob
                             if hf.config.model_type != "mixtral" else True)
    assert torch.equal(experts, their_experts)
    torch.testing.assert_close(weights, their_weights.float(), rtol=1e-6, atol=1e-7)
    assert len(experts.unique()) >= 5


def test_greedy_batched_matches_transformers(moe, monkeypatch):
    folder, hf = moe
    llm = LLM(str(folder), quantization="none", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=16)
    try:
        _python_layers_refused(llm.engine.runner.model, monkeypatch)
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        ours = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]    # one batch, chunked prefill
    finally:
        llm.close()
    # The attention mask given: OLMoE's config has pad_token_id 1, which PROMPTS[2] holds, and
    # generate would otherwise mask that token out.
    with torch.no_grad():
        theirs = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=10, do_sample=False)[0, len(p):].tolist() for p in PROMPTS]
    assert ours == theirs


def _experts_chosen(monkeypatch, hf, run) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, transformers') experts per position and layer [T, layers, k], sorted, while ``run()``
    runs one prefill through each."""
    from sluice.engine.models import moe as moe_module

    ours, theirs, route_ = [], [], moe_module.route

    def recorded(logits, top_k, norm):
        weights, experts = route_(logits, top_k, norm)
        ours.append(experts.sort(-1).values)
        return weights, experts

    monkeypatch.setattr(moe_module, "route", recorded)
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, i, out: theirs.append(out[2].sort(-1).values))
             for layer in hf.model.layers]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
        monkeypatch.setattr(moe_module, "route", route_)
    return torch.stack(ours, 1), torch.stack(theirs, 1)


def test_a_q8_0_gguf_keeps_its_experts_as_stored_within_the_block_formats_bounds(moe, tmp_path, monkeypatch):
    """Q8_0 rounding may move a token whose 2nd and 3rd experts were nearly tied to another expert
    (llama.cpp's Q8_0 files do the same): such positions are few, and every other position stays
    within w8a8's bounds."""
    _, hf = moe
    _write_gguf(tmp_path / "q.gguf", hf, q8_0=True)
    arch, weights, _ = load_gguf(tmp_path / "q.gguf")
    model = build_model(arch, weights, torch.float32, torch.device("cpu"), quantization="w8a8")
    with monkeypatch.context() as patched:       # the C++ stack, block weights per expert
        _python_layers_refused(model, patched)
        cpp = [(_prefill_logits(model, ids) - _reference(hf, ids)).abs() for ids in PROMPTS]
    assert torch.cat([c.flatten() for c in cpp]).mean() <= MEAN_LOGIT_CHANGE["w8a8"]
    model.use_python_layers()                         # where the routing below can be watched
    experts = model.layers[1].mlp
    assert isinstance(experts, SparseMoE)
    from sluice.engine.models import quant

    assert all(isinstance(e.gate_up_proj.quantized, quant.BlockQLinear) and
               isinstance(e.down_proj.quantized, quant.BlockQLinear) for e in experts.experts)
    changes, moved = [], []
    for ids in PROMPTS:
        out = {}
        ours, theirs = _experts_chosen(monkeypatch, hf, lambda: out.update(
            ours=_prefill_logits(model, ids), theirs=_reference(hf, ids)))
        changes.append((out["ours"] - out["theirs"]).abs())                          # [T, vocab]
        moved.append((ours != theirs).flatten(1).any(1))                             # [T]
    moved_all = torch.cat(moved)
    assert moved_all.float().mean() <= 0.2, "Q8_0 moved too many tokens to other experts"
    kept = torch.cat([c[~m] for c, m in zip(changes, moved)])
    assert kept.max() <= MAX_LOGIT_CHANGE["w8a8"]
    assert torch.cat([c.flatten() for c in changes]).mean() <= MEAN_LOGIT_CHANGE["w8a8"]


QWEN_MOE = {"model_type": "qwen2_moe", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@pytest.mark.parametrize("extra, message", [
    ({"mlp_only_layers": [1]}, r"mlp_only_layers / decoder_sparse_step: a qwen2_moe model with dense layers"),
    ({"decoder_sparse_step": 2}, r"mlp_only_layers / decoder_sparse_step: a qwen2_moe model with dense layers"),
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok: 5 is more than the 4 experts"),
    ({"num_experts": 0}, r"num_experts: must be a positive integer, got 0"),
    ({"moe_intermediate_size": None}, r"moe_intermediate_size: missing from config.json"),
])
def test_what_is_not_supported_is_refused_by_name(extra, message):
    cfg = {k: v for k, v in {**QWEN_MOE, **extra}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        ModelArchConfig.from_hf_config(cfg)


def test_tensor_parallelism_splits_every_expert_and_refuses_what_does_not_divide():
    """Each rank holds a slice of every expert's features (test_tp_architectures serves them)."""
    import dataclasses

    from sluice.engine.parallel.tensor import plan_shard

    arch = ModelArchConfig.from_hf_config(QWEN_MOE)
    assert (arch.num_experts, arch.moe_intermediate_size, arch.norm_topk_prob) == (4, 32, False)
    assert [(s.expert_start, s.expert_inter) for s in (plan_shard(arch, r, 2) for r in range(2))] == [(0, 16), (16, 16)]
    odd = dataclasses.replace(arch, moe_intermediate_size=33)
    with pytest.raises(ValueError, match=r"tensor_parallel_shards: each expert's 33 features do not split evenly"):
        plan_shard(odd, 0, 2)


def test_a_gguf_with_experts_for_a_dense_architecture_is_refused(moe, tmp_path):
    """A file whose metadata has no experts (the dense architecture, no expert_count) but whose
    tensors do: the router and the 3-D experts are named, not read as a dense model's."""
    import gguf

    _, hf = moe
    _write_gguf(tmp_path / "m.gguf", hf)
    sparse = GGUF_ARCH[hf.config.model_type]
    dense = {"llama": "llama", "qwen2moe": "qwen2", "qwen3moe": "qwen3", "olmoe": "llama"}[sparse]
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    writer = gguf.GGUFWriter(str(tmp_path / "dense.gguf"), dense)
    for field in reader.fields.values():
        if field.name.startswith(sparse + ".") and "expert" not in field.name:
            key = dense + field.name[len(sparse):]
            writer.add_key_value(key, field.contents(), field.types[0])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'blk\.0\.ffn_gate_inp\.weight' for a Llama"):
        load_gguf(tmp_path / "dense.gguf")


OLMOE = {**QWEN_MOE, "model_type": "olmoe", "intermediate_size": 32}


def test_olmoe_reads_its_expert_fields_and_refuses_clip_qkv_by_name():
    arch = ModelArchConfig.from_hf_config(OLMOE)
    assert (arch.num_experts, arch.moe_intermediate_size, arch.norm_topk_prob) == (4, 32, False)
    assert ModelArchConfig.from_hf_config({**OLMOE, "norm_topk_prob": True}).norm_topk_prob
    with pytest.raises(ValueError, match=r"clip_qkv: clamping q/k/v \(OLMoE's clip_qkv=8\.0\) is not supported"):
        ModelArchConfig.from_hf_config({**OLMOE, "clip_qkv": 8.0})


@pytest.mark.parametrize("moe", ["olmoe"], indirect=True)
def test_olmoe_whole_projection_norms_of_the_wrong_size_are_refused_by_name(moe, tmp_path):
    """The C++ stack checks OLMoE's q/k norm weights against the whole projections (q_size,
    kv_size) when it is built, rather than reading past them; the flag needs the norms on."""
    from sluice.engine.models.layer_stack import build_decoder_stack
    from sluice.kernels import cpu_ext

    model = build_model(*_load(moe, tmp_path, "folder"), torch.float32, torch.device("cpu"))
    att = model.spec.attention
    assert att.qk_norm_full and model.layers[1].self_attn.k_norm.weight.shape == (att.kv_size,)
    model.layers[1].self_attn.k_norm.weight = torch.nn.Parameter(torch.ones(att.head_dim), requires_grad=False)
    with pytest.raises(RuntimeError, match=r"layer 1: q_norm and k_norm over whole projections must have "
                                           rf"q_size \({att.q_size}\) and kv_size \({att.kv_size}\) weights"):
        build_decoder_stack(model, cpu_ext.module())
    with pytest.raises(RuntimeError, match=r"StackSpec: qk_norm_full needs qk_norm"):
        cpu_ext.module().StackSpec(heads=4, kv_heads=2, head_dim=16, eps=1e-6, scale=0.25, qk_norm=False,
                                   qk_norm_full=True)
