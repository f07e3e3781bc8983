"""Tensor parallelism over the architectures that once refused it (issue 40): Phi-3 (q/k/v and
gate/up stored fused), the mixtures of experts (Mixtral, Qwen2-MoE with its shared expert,
Qwen3-MoE, OLMoE with its whole-projection q/k norms) and Gemma 2 / Gemma 3, each split over 2
gloo ranks on this CPU against the same model on one.

The tiny random-weight models are the per-architecture tests' own (``test_phi3``, ``test_moe``,
``test_gemma`` build them; built once per module here), served from their Hugging Face folders in
float32 and from a Q8_0 GGUF in llama.cpp's layout (Phi-3's ``attn_qkv`` / ``ffn_up`` fused in
blocks, the experts' 3-D stacks), SmolLM2's vocabulary copied in so that an engine can serve it.

Proves: the shards hold exactly the whole model's weights (a fused tensor's pieces, every
expert's slice); 6 mixed requests (several prompt lengths, chunked prefill beside decodes) give
greedy outputs token-identical to one shard, with logprobs within float32 tolerance in float32
and equal to the last bit in Q8_0 (the exact split: the C++ stack gathers, every number is one
rank's); the row-parallel split (the Python layers, ``SLUICE_CPU_CPP_LAYERS=0``) stays
token-identical in float32.
"""
from __future__ import annotations

import pytest
import torch

from sluice.engine.llm import LLM
from sluice.engine.loaders.gguf_loader import gguf_metadata, load_gguf, open_gguf
from sluice.engine.loaders.hf_loader import load_hf_folder
from sluice.engine.parallel.tensor import ShardedWeights, plan_shard
from sluice.engine.sampling_params import SamplingParams
from tests.model import gguf_writing
from tests.model_files import smollm2_gguf

pytestmark = pytest.mark.slow

_gen = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(2, 30000, (n,), generator=_gen).tolist() for n in (3, 9, 14, 21, 30, 5)]


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=5 + i % 4, temperature=0.0, ignore_eos=True, logprobs=2)


def _run(model: str, quantization: str, shards: int) -> list:
    llm = LLM(model, quantization=quantization, tensor_parallel_shards=shards, kv_cache_memory_bytes=8 << 20,
              max_num_batched_tokens=16)
    try:
        return [r.outputs[0] for r in llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])]
    finally:
        llm.close()


def _same_as_one_shard(model: str, quantization: str, tolerance: float) -> None:
    whole, split = _run(model, quantization, 1), _run(model, quantization, 2)
    for a, b in zip(whole, split, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert abs(x.logprob - y.logprob) <= tolerance and x.top[0][0] == y.top[0][0]


def _splits(monkeypatch, path: str, split: str) -> None:
    """float32 over the exact split (the C++ stack) or the row-parallel one (the Python layers;
    the workers inherit the environment), or Q8_0 over the exact split."""
    if split == "row-parallel":
        monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")
    if split == "q8_0":
        _same_as_one_shard(path, "w8a8", 0.0)
    else:
        _same_as_one_shard(path, "none", 1e-3)


def _with_vocabulary(write, path, *args, **kwargs) -> str:
    """A test module's GGUF writer with SmolLM2's tokenizer keys added (its models use that
    vocabulary), so that an engine can serve the file."""
    reader = open_gguf(smollm2_gguf())
    start = gguf_writing.start

    def start_with_vocabulary(*a, **k):
        writer = start(*a, **k)
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                sub = field.types[1] if len(field.types) > 1 else None
                writer.add_key_value(key, gguf_metadata(reader, key), field.types[0], sub)
        return writer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_writing, "start", start_with_vocabulary)
        write(path, *args, **kwargs)
    return str(path)


# ---- Phi-3: q/k/v and gate/up fused -------------------------------------------------------------
@pytest.fixture(scope="module")
def phi3(tmp_path_factory, smollm2_tokenizer):
    """(folder, Q8_0 GGUF, transformers model): test_phi3's LongRoPE model."""
    from transformers import Phi3ForCausalLM

    from tests.model import test_phi3

    folder = tmp_path_factory.mktemp("tp_phi3")
    smollm2_tokenizer.save_folder(folder)
    torch.manual_seed(0)
    hf = Phi3ForCausalLM(test_phi3._config("longrope", smollm2_tokenizer.vocab_size)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0, 0.5) if "norm" in name else p.normal_(0, 0.15)
    hf.save_pretrained(folder, safe_serialization=True)
    gguf = _with_vocabulary(test_phi3._write_gguf, folder / "q8_0.gguf", hf, q8_0=True)
    return str(folder), gguf, hf


def test_phi3_fused_shards_hold_each_ranks_heads_and_features(phi3):
    folder, gguf, hf = phi3
    arch, weights = load_hf_folder(folder)
    q, kv, inter = arch.q_size, arch.kv_size, arch.intermediate_size
    qkv = weights["model.layers.1.self_attn.qkv_proj.weight"]
    gate_up = weights["model.layers.1.mlp.gate_up_proj.weight"]
    for exact in (True, False):
        shards = [plan_shard(arch, r, 2, exact) for r in range(2)]
        pieces = [ShardedWeights(weights, arch, s) for s in shards]
        got = [p["model.layers.1.self_attn.qkv_proj.weight"] for p in pieces]
        # Rank r: its 2 query heads, then its key head, then its value head (head_dim 16 each).
        for r, t in enumerate(got):
            assert torch.equal(t, torch.cat([qkv[r * q // 2:(r + 1) * q // 2], qkv[q + r * kv // 2:q + (r + 1) * kv // 2],
                                             qkv[q + kv + r * kv // 2:q + kv + (r + 1) * kv // 2]]))
            up = pieces[r]["model.layers.1.mlp.gate_up_proj.weight"]
            half = inter // 2
            assert torch.equal(up, torch.cat([gate_up[r * half:(r + 1) * half],
                                              gate_up[inter + r * half:inter + (r + 1) * half]]))
    # The GGUF's Q8_0 blocks: whole rows of the fused tensors, the same rows as the float32 cut.
    arch, weights, _ = load_gguf(gguf)
    blocks = weights.blocks("model.layers.0.self_attn.qkv_proj.weight")[1]
    pieces = [ShardedWeights(weights, arch, plan_shard(arch, r, 2, True)) for r in range(2)]
    cut = [p.blocks("model.layers.0.self_attn.qkv_proj.weight")[1] for p in pieces]
    assert [p.shape("model.layers.0.self_attn.qkv_proj.weight") for p in pieces] == [(64, 64)] * 2
    assert torch.equal(cut[0], torch.cat([blocks[0:32], blocks[64:80], blocks[96:112]]))
    assert torch.equal(cut[1], torch.cat([blocks[32:64], blocks[80:96], blocks[112:128]]))


@pytest.mark.parametrize("split", ["exact", "row-parallel", "q8_0"])
def test_phi3_two_ranks_match_one(phi3, split, monkeypatch):
    folder, gguf, _ = phi3
    _splits(monkeypatch, gguf if split == "q8_0" else folder, split)


# ---- mixtures of experts: every rank a slice of every expert -------------------------------------
@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def moe(request, tmp_path_factory, smollm2_tokenizer):
    """(architecture, folder, Q8_0 GGUF): test_moe's models (its weight scales: a clear top 2)."""
    from tests.model import test_moe

    folder = tmp_path_factory.mktemp(f"tp_{request.param}")
    smollm2_tokenizer.save_folder(folder)
    torch.manual_seed(0)
    hf = test_moe._hf_model(request.param, smollm2_tokenizer.vocab_size).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.5)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.15)
    hf.save_pretrained(folder, safe_serialization=True)
    gguf = _with_vocabulary(test_moe._write_gguf, folder / "q8_0.gguf", hf, q8_0=True)
    return request.param, str(folder), gguf


def test_moe_shards_hold_a_slice_of_every_expert(moe):
    """Routed and shared experts: gate/up by features, down by its input (row-parallel) or output
    rows (exact); the router, the shared gate and everything else whole; OLMoE's q/k norm weights
    cut with their heads. From the GGUF too (its 3-D stacks read one expert at a time)."""
    name, folder, gguf = moe
    for arch, weights in (load_hf_folder(folder), load_gguf(gguf)[:2]):
        for exact in (True, False):
            pieces = [ShardedWeights(weights, arch, plan_shard(arch, r, 2, exact)) for r in range(2)]
            for key in weights:
                whole = weights[key]
                if ".experts." in key or ".shared_expert." in key:
                    dim = 1 if key.endswith(("down_proj.weight", "w2.weight")) and not exact else 0
                    assert torch.equal(torch.cat([p[key] for p in pieces], dim), whole), key
                    assert pieces[0][key].shape[dim] * 2 == whole.shape[dim], key
                elif ("q_norm" in key or "k_norm" in key) and name == "olmoe":
                    assert torch.equal(torch.cat([p[key] for p in pieces]), whole), key
                elif ".gate." in key or "shared_expert_gate" in key or "norm" in key or "embed" in key:
                    assert all(p[key] is whole or torch.equal(p[key], whole) for p in pieces), key


@pytest.mark.parametrize("split", ["exact", "row-parallel", "q8_0"])
def test_moe_two_ranks_match_one(moe, split, monkeypatch):
    _, folder, gguf = moe
    _splits(monkeypatch, gguf if split == "q8_0" else folder, split)


# ---- Gemma 2 / Gemma 3 ------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory, smollm2_tokenizer):
    """(folder, Q8_0 GGUF): test_gemma's models (soft-caps, sliding and global layers, Gemma 3's
    local RoPE and per-head q/k norms, head_dim 24 unlike hidden / heads)."""
    from transformers import Gemma2ForCausalLM, Gemma3ForCausalLM

    from tests.model import test_gemma

    folder = tmp_path_factory.mktemp(f"tp_{request.param}")
    smollm2_tokenizer.save_folder(folder)
    torch.manual_seed(0)
    cls = Gemma2ForCausalLM if request.param == "gemma2" else Gemma3ForCausalLM
    hf = cls(test_gemma._config(request.param, smollm2_tokenizer.vocab_size)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.5) if "norm" in name else p.normal_(0, 0.15)
    hf.save_pretrained(folder, safe_serialization=True)
    gguf = _with_vocabulary(test_gemma._write_gguf, folder / "q8_0.gguf", hf, q8_0=True)
    return str(folder), gguf


@pytest.mark.parametrize("split", ["exact", "row-parallel", "q8_0"])
def test_gemma_two_ranks_match_one(gemma, split, monkeypatch):
    folder, gguf = gemma
    _splits(monkeypatch, gguf if split == "q8_0" else folder, split)
