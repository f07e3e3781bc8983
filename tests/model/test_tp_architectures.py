"""Tensor parallelism over the architectures that once refused it (issue 40): Phi-3 (q/k/v and
gate/up stored fused), the mixtures of experts (Mixtral, Qwen2-MoE with its shared expert,
Qwen3-MoE, OLMoE with its whole-projection q/k norms) and Gemma 2 / Gemma 3, each split over 2
gloo ranks on this CPU against the same model on one.

The tiny random-weight models are the per-architecture tests' own (``test_phi3``, ``test_moe``,
``test_gemma`` build them; built once per module here), served from their Hugging Face folders in
float32 and from a Q8_0 GGUF in llama.cpp's layout (Phi-3's ``attn_qkv`` / ``ffn_up`` fused in
blocks, the experts' 3-D stacks), SmolLM2's vocabulary copied in so that an engine can serve it.

Proves: the shards hold exactly the whole model's weights (a fused tensor's pieces, whole
block rows of a GGUF's; every expert's slice, the router whole, OLMoE's norm weights cut with
their heads); 6 mixed requests (several prompt lengths, chunked prefill beside decodes) give
greedy outputs token-identical to one shard, with logprobs within float32 tolerance in float32
and equal to the last bit in Q8_0 (the exact split: the C++ stack gathers, every number is one
rank's), for every architecture (Q8_0: each with its own GGUF block path); the row-parallel split (the Python layers,
``SLUICE_CPU_CPP_LAYERS=0``) stays token-identical in float32 where a rank's Python layers run
code of their own.
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


# ---- the models: test_phi3's, test_moe's and test_gemma's, built once each ---------------------
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
ARCHS = ["phi3", *MOE, "gemma2", "gemma3"]


def _hf_model(name: str, vocab: int):
    """The per-architecture test's random model (tests/model/tiny_archs.py), with its weight scales
    (norm weights away from their neutral value; MoE routers at 0.5: a clear top 2)."""
    from tests.model import tiny_archs

    torch.manual_seed(0)
    if name == "phi3":
        from transformers import Phi3ForCausalLM

        hf, scales = Phi3ForCausalLM(tiny_archs.phi3_config("longrope", vocab)), {"norm": 1.0}
    elif name in MOE:
        hf, scales = tiny_archs.moe_model(name, vocab), {"norm": 1.0, "router": 0.5}
    else:
        from transformers import Gemma2ForCausalLM, Gemma3ForCausalLM

        cls = Gemma2ForCausalLM if name == "gemma2" else Gemma3ForCausalLM
        hf, scales = cls(tiny_archs.gemma_config(name, vocab)), {"norm": 0.0}
    with torch.no_grad():
        for key, p in hf.named_parameters():
            if "norm" in key:
                p.normal_(scales["norm"], 0.5)
            elif key.endswith("mlp.gate.weight") and "router" in scales:
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.15)
    return hf.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_tokenizer):
    """``models(name)``: (Hugging Face folder, Q8_0 GGUF) of that architecture's tiny model,
    written on first use (SmolLM2's tokenizer beside the weights; its vocabulary in the GGUF)."""
    from tests.model import test_gemma, test_moe, test_phi3

    built: dict[str, tuple[str, str]] = {}

    def get(name: str) -> tuple[str, str]:
        if name not in built:
            folder = tmp_path_factory.mktemp(f"tp_{name}")
            smollm2_tokenizer.save_folder(folder)
            hf = _hf_model(name, smollm2_tokenizer.vocab_size)
            hf.save_pretrained(folder, safe_serialization=True)
            write = test_phi3._write_gguf if name == "phi3" else test_moe._write_gguf if name in MOE \
                else test_gemma._write_gguf
            built[name] = str(folder), _with_vocabulary(write, folder / "q8_0.gguf", hf, q8_0=True)
        return built[name]

    return get


# ---- the shards hold the whole model ------------------------------------------------------------
def test_phi3_fused_shards_hold_each_ranks_heads_and_features(models):
    folder, gguf = models("phi3")
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
            rows = [(r * q // 2, (r + 1) * q // 2), (q + r * kv // 2, q + (r + 1) * kv // 2),
                    (q + kv + r * kv // 2, q + kv + (r + 1) * kv // 2)]
            assert torch.equal(t, torch.cat([qkv[i:j] for i, j in rows]))
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


@pytest.mark.parametrize("name", MOE)
def test_moe_shards_hold_a_slice_of_every_expert(models, name):
    """Routed and shared experts: gate/up by features, down by its input (row-parallel) or output
    rows (exact); the router, the shared gate and everything else whole; OLMoE's q/k norm weights
    cut with their heads. From the GGUF too (its 3-D stacks read one expert at a time)."""
    folder, gguf = models(name)
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


# ---- 2 ranks against 1 ------------------------------------------------------------------------
# The exact split in float32 for every architecture; Q8_0 for each but Mixtral and Qwen3-MoE
# (their experts' blocks are cut as Qwen2-MoE's and OLMoE's); the row-parallel split where a
# rank's Python layers run code of their own (Phi-3's fused slices, the MoE all-reduce and
# Qwen2-MoE's shared expert, OLMoE's gathered norm statistics, Gemma's sandwich norms). Each case
# costs ~3 s, most of it the worker's start: the file stays near a minute.
CASES = [(name, "exact") for name in ARCHS] + \
    [(name, "q8_0") for name in ARCHS if name not in ("mixtral", "qwen3_moe")] + \
    [(name, "row-parallel") for name in ("phi3", "qwen2_moe", "olmoe", "gemma2")]


@pytest.mark.parametrize("name, split", CASES)
def test_two_ranks_give_one_shards_outputs(models, name, split, monkeypatch):
    folder, gguf = models(name)
    _splits(monkeypatch, gguf if split == "q8_0" else folder, split)


def test_a_row_parallel_cut_inside_a_block_is_refused_by_name(models):
    """Gemma's head_dim 24: a rank's o_proj input columns (2 heads, 48) end inside a Q8_0 block of
    32. The exact split (where the C++ stack runs) cuts whole rows; the row-parallel one, for a
    block format without the C++ kernels, cannot and says which tensor."""
    from sluice.engine.errors import ModelLoadError

    arch, weights, _ = load_gguf(models("gemma2")[1])
    row_parallel = ShardedWeights(weights, arch, plan_shard(arch, 0, 2))
    with pytest.raises(ModelLoadError, match=r"tensor_parallel_shards: tensor 'model\.layers\.0\.self_attn\.o_proj"
                                             r"\.weight' \(Q8_0, blocks of 32\) cannot be split at column 48"):
        row_parallel.blocks("model.layers.0.self_attn.o_proj.weight")
    exact = ShardedWeights(weights, arch, plan_shard(arch, 0, 2, exact=True))
    assert exact.blocks("model.layers.0.self_attn.o_proj.weight")[1].shape[0] == 32      # 32 of 64 rows
