"""Sliding-window attention (issue 43): a Mistral whose window is shorter than its prompts and
generations, served as transformers computes it.

A tiny random-weight Mistral written by transformers itself (``sliding_window`` 8, blocks of 4
tokens), and the same weights as a GGUF in llama.cpp's layout, Q8_0 blocks, with the window in
``llama.attention.sliding_window``.

* float32 logits of prompts three times the window equal transformers' within test_logits'
  tolerance, through the C++ layer stack and through the Python layers;
* greedy continuations past the window equal transformers', several requests batched with
  chunked prefill, through both stacks; meanwhile no request ever holds more than its window's
  blocks plus the step's (the KV manager frees the blocks that left the window), and at the end
  every block is back in the pool;
* a later request with the same prompt hits the prefix cache (released blocks stay cached:
  their K/V depend only on the tokens before them) and gives the same tokens;
* the Q8_0 GGUF stays within the block formats' bounds (test_quantization) on long prompts;
* Qwen2/Qwen3's per-layer windows (``max_window_layers``, ``layer_types``) read as transformers
  reads them; a Qwen2 with a global and a sliding layer equals transformers (logits, greedy
  tokens) through both stacks, and frees nothing (its global layer reads every block);
* speculative decoding (n-gram chains, Medusa draft trees) keeps the greedy tokens past the
  window; MLC's ``sliding_window_size`` (-1: off) gives transformers' tokens for that window
  (``attention_sink_size``, StreamingLLM's sinks over that window: test_attention_sinks).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sluice.engine.llm import LLM
from sluice.engine.loaders import build_model
from sluice.engine.loaders.gguf_loader import load_gguf
from sluice.engine.loaders.hf_loader import load_hf_folder
from sluice.engine.models.config import ModelArchConfig
from sluice.engine.sampling_params import SamplingParams
from tests.model import gguf_writing
from tests.model.test_logits import _assert_logits_match, _prefill_logits
from tests.model.test_quantization import MAX_LOGIT_CHANGE, MEAN_LOGIT_CHANGE

WINDOW, BLOCK, LAYERS, HEADS, KV_HEADS = 8, 4, 2, 4, 2
PROMPTS = [[3, 17, 400, 9, 5000, 77], list(range(100, 121)),
           [900, 4, 4, 4, 31, 2000, 8, 1, 65, 101, 7, 5, 999, 12, 13, 14]]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, smollm2_tokenizer):
    """(folder, transformers model): SmolLM2's tokenizer beside random Mistral weights."""
    from transformers import MistralConfig, MistralForCausalLM

    folder = tmp_path_factory.mktemp("tiny_mistral_window")
    smollm2_tokenizer.save_folder(folder)
    config = MistralConfig(vocab_size=smollm2_tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                           max_position_embeddings=256, sliding_window=WINDOW, rms_norm_eps=1e-6,
                           tie_word_embeddings=False)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.5) if "norm" in name else p.normal_(0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def _reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _theirs(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()


def test_the_window_is_in_the_model_not_a_context_cap(mistral):
    folder, hf = mistral
    arch, weights = load_hf_folder(folder)
    assert (arch.sliding_window, arch.sliding_layers, arch.kv_window) == (WINDOW, None, WINDOW)
    model = build_model(arch, weights, torch.float32, torch.device("cpu"))
    assert [layer.self_attn.sliding_window for layer in model.layers] == [WINDOW] * LAYERS
    # The window matters here: attending over the whole prompt gives other logits.
    full = _reference(hf, PROMPTS[1])
    hf.config.sliding_window = None
    try:
        assert (_reference(hf, PROMPTS[1]) - full).abs().max() > 0.1
    finally:
        hf.config.sliding_window = WINDOW


@pytest.mark.parametrize("layers", ["cpp", "python"])
def test_float32_logits_past_the_window_match_transformers(mistral, monkeypatch, layers):
    folder, hf = mistral
    if layers == "python":
        monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")
    model = build_model(*load_hf_folder(folder), torch.float32, torch.device("cpu"))
    assert (model._cpu_decoder() is not None) == (layers == "cpp")
    for ids in PROMPTS:
        _assert_logits_match(_prefill_logits(model, ids), _reference(hf, ids))


def _watch_blocks(llm: LLM) -> list[int]:
    """Records, after every allocation, the most blocks any request holds."""
    kv, seen = llm.engine.kv, []
    allocate = kv.allocate_slots

    def watched(request, *args, **kwargs):
        out = allocate(request, *args, **kwargs)
        seen.append(max(kv.num_held_blocks(rid) for rid in kv._req_blocks))
        return out

    kv.allocate_slots = watched
    return seen


@pytest.mark.parametrize("layers", ["cpp", "python"])
def test_greedy_batched_past_the_window_matches_transformers_in_a_window_of_blocks(mistral, monkeypatch, layers):
    folder, hf = mistral
    if layers == "python":
        monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")
    budget = 8          # chunked prefill: a 21-token prompt runs in three steps
    llm = LLM(str(folder), quantization="none", block_size=BLOCK, kv_cache_memory_bytes=4 << 20,
              max_num_batched_tokens=budget)
    try:
        assert llm.engine.max_model_len == 256 and llm.engine.kv.sliding_window == WINDOW
        held = _watch_blocks(llm)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        ours = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
        # The window's blocks plus those the step writes: ceil((W - 1 + budget) / block) + 1.
        assert max(held) <= -(-(WINDOW - 1 + budget) // BLOCK) + 1 == 5
        total = -(-(len(PROMPTS[1]) + MAX_TOKENS) // BLOCK)
        assert max(held) < total            # freeing happened: the longest would hold 11
        stats = llm.engine.kv.stats()
        assert stats.in_use == 0 and stats.free + stats.cached == stats.total      # nothing leaked
        llm.engine.kv.check_invariants()
        # The same prompt again: released blocks are still cached, and a hit gives the same tokens.
        again = llm.generate([PROMPTS[1]], params)[0]
        assert again.usage.cached_tokens > 0 and again.outputs[0].token_ids == ours[1]
        assert llm.engine.kv.stats().in_use == 0
    finally:
        llm.close()
    assert ours == [_theirs(hf, p, MAX_TOKENS) for p in PROMPTS]


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}." + {
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight"}[rest]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for the llama architecture (the loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_q8_gguf(path, hf) -> None:
    """The weights in llama.cpp's llama layout, the 2-D ones as Q8_0, the window in its key."""
    config = hf.config
    writer = gguf_writing.start(path, "llama", config, rope_base=10000.0)
    writer.add_sliding_window(WINDOW)
    tensors = {}
    for name, tensor in hf.state_dict().items():
        w = tensor.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            w = _permute(w, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = _permute(w, config.num_key_value_heads)
        tensors[_gguf_name(name)] = w
    gguf_writing.finish(writer, tensors, lambda name, w: w.ndim == 2)


def test_a_q8_0_gguf_with_its_window_stays_within_the_block_formats_bounds(mistral, tmp_path):
    _, hf = mistral
    _write_q8_gguf(tmp_path / "m.gguf", hf)
    arch, weights, _ = load_gguf(tmp_path / "m.gguf")
    assert (arch.sliding_window, arch.kv_window) == (WINDOW, WINDOW)
    model = build_model(arch, weights, torch.float32, torch.device("cpu"), quantization="w8a8")
    assert model._cpu_decoder() is not None          # Q8_0 kept as stored, the C++ stack
    changes = [(_prefill_logits(model, ids) - _reference(hf, ids)).abs() for ids in PROMPTS]
    assert max(c.max() for c in changes) <= MAX_LOGIT_CHANGE["w8a8"]
    assert torch.cat([c.flatten() for c in changes]).mean() <= MEAN_LOGIT_CHANGE["w8a8"]
    # Without the window the same file is another model: the logits move far past those bounds.
    import dataclasses

    whole = build_model(dataclasses.replace(arch, sliding_window=None), load_gguf(tmp_path / "m.gguf")[1],
                        torch.float32, torch.device("cpu"), quantization="w8a8")
    assert (_prefill_logits(whole, PROMPTS[1]) - _reference(hf, PROMPTS[1])).abs().max() > MAX_LOGIT_CHANGE["w8a8"]


BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def test_per_layer_windows_read_as_transformers_reads_them():
    from transformers import Qwen2Config

    qwen = {**BASE, "model_type": "qwen2", "sliding_window": 32, "use_sliding_window": True}
    for extra in ({"max_window_layers": 2}, {"max_window_layers": 0}, {"max_window_layers": 28},
                  {"layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]}):
        arch = ModelArchConfig.from_hf_config({**qwen, **extra})
        theirs = Qwen2Config(**{k: v for k, v in {**qwen, **extra}.items() if k != "model_type"})
        want = [32 if t == "sliding_attention" else None for t in theirs.layer_types]
        assert [arch.layer_window(i) for i in range(4)] == want, extra
        # Blocks are freed only when every layer slides.
        assert arch.kv_window == (32 if all(want) else None)
    assert ModelArchConfig.from_hf_config({**qwen, "max_window_layers": 28}).sliding_window is None
    mistral = {**BASE, "model_type": "mistral"}
    assert ModelArchConfig.from_hf_config({**mistral, "sliding_window": 256}).sliding_window is None   # spans it
    assert ModelArchConfig.from_hf_config({**mistral, "sliding_window": None}).sliding_window is None
    assert ModelArchConfig.from_hf_config({**mistral, "sliding_window": 32}).kv_window == 32
    assert ModelArchConfig.from_hf_config({**qwen, "use_sliding_window": False}).sliding_window is None
    with pytest.raises(ValueError, match="sliding_window: must be a positive integer"):
        ModelArchConfig.from_hf_config({**mistral, "sliding_window": "8"})
    with pytest.raises(ValueError, match="layer_types: must list"):
        ModelArchConfig.from_hf_config({**qwen, "layer_types": ["sliding_attention"]})


@pytest.mark.parametrize("mode", ["ngram", "medusa tree", "medusa tree python"])
def test_speculative_decoding_past_the_window_keeps_the_greedy_tokens(mistral, monkeypatch, mode):
    """Drafts and draft trees verified through the window (tree rows attend by position, accepted
    paths' K/V moved) while blocks are released: the tokens are transformers' greedy ones."""
    from tests.model.test_spec_decode_distribution import random_heads

    folder, hf = mistral
    mode, _, tree = mode.partition(" ")
    tree, _, python = tree.partition(" ")
    if python:                 # the torch backend's tree rows (by index, the window by position)
        monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")
    prompts = PROMPTS + [[300, 301, 302, 303, 304, 305] * 4]     # a prompt n-grams match in
    kw = {}
    if mode == "medusa":
        base = LLM(str(folder), quantization="none")
        loaded = base.engine.loaded
        base.close()
        kw = dict(loaded=loaded, additional_models="random medusa heads", heads=random_heads(loaded, "medusa"),
                  spec_tree_width=3 if tree else 1, spec_min_draft_prob=0.0)
    llm = LLM(str(folder), quantization="none", block_size=BLOCK, kv_cache_memory_bytes=4 << 20,
              max_num_batched_tokens=32, speculative_mode=mode, spec_draft_length=4, spec_max_batch_size=64, **kw)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        ours = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        assert llm.engine.kv.stats().in_use == 0
        stats = llm.engine.spec.stats
        # Drafts ran and some were kept (n-grams match only the repeated prompt's first step).
        assert stats.num_drafts >= (1 if mode == "ngram" else 20) and stats.num_accepted_tokens > 0, stats
    finally:
        llm.close()
    assert ours == [_theirs(hf, p, MAX_TOKENS) for p in prompts]


def test_drafts_as_long_as_the_window_are_refused(mistral):
    folder, _ = mistral
    with pytest.raises(ValueError, match="spec_draft_length: 8 draft tokens must be fewer than the model's sliding "
                                         "window of 8 tokens"):
        LLM(str(folder), quantization="none", speculative_mode="ngram", spec_draft_length=WINDOW)


@pytest.mark.parametrize("size", [-1, 5])
def test_mlc_sliding_window_size_overrides_the_window(mistral, size):
    """MLC's ``sliding_window_size``: -1 turns the window off, a size replaces it; the tokens are
    those of transformers' model with that window (None for off)."""
    from sluice.engine.overrides import build_engine_config

    folder, hf = mistral
    config = build_engine_config(str(folder), overrides=f"sliding_window_size={size};block_size={BLOCK};"
                                 "quantization=none;max_total_seq_length=512")
    llm = LLM(config=config)
    try:
        assert llm.engine.kv.sliding_window == (None if size == -1 else size)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        ours = [r.outputs[0].token_ids for r in llm.generate(PROMPTS[1:], params)]
    finally:
        llm.close()
    hf.config.sliding_window = None if size == -1 else size
    try:
        assert ours == [_theirs(hf, p, MAX_TOKENS) for p in PROMPTS[1:]]
    finally:
        hf.config.sliding_window = WINDOW


def test_window_overrides_are_checked():
    from sluice.engine.overrides import parse_overrides

    assert parse_overrides("sliding_window_size=-1") == {"sliding_window_size": -1}
    assert parse_overrides("attention_sink_size=4") == {"attention_sink_size": 4}   # test_attention_sinks
    mistral = ModelArchConfig.from_hf_config({**BASE, "model_type": "mistral", "sliding_window": 32})
    assert mistral.with_sliding_window(16).sliding_window == 16
    assert mistral.with_sliding_window(-1).kv_window is None
    assert mistral.with_sliding_window(4096).sliding_window is None          # spans the context: none
    qwen = ModelArchConfig.from_hf_config({**BASE, "model_type": "qwen2", "sliding_window": 32,
                                           "use_sliding_window": True, "max_window_layers": 2})
    assert [qwen.with_sliding_window(8).layer_window(i) for i in range(4)] == [None, None, 8, 8]
    with pytest.raises(ValueError, match="sliding_window_size: a llama model with no sliding-window layers"):
        ModelArchConfig.from_hf_config({**BASE, "model_type": "llama"}).with_sliding_window(16)
    with pytest.raises(ValueError, match="sliding_window_size: must be a positive integer"):
        mistral.with_sliding_window(0)
    from sluice.engine.llm import build_config

    with pytest.raises(ValueError, match="sliding_window_size: must be a positive integer"):
        build_config("smollm2", sliding_window_size=-2)


@pytest.fixture(scope="module")
def qwen2_mixed(tmp_path_factory, smollm2_tokenizer):
    """A Qwen2 whose layer 0 attends globally and layer 1 through a window of 8 (transformers'
    max_window_layers = 1): per-layer windows, as Gemma's alternation needs them."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("tiny_qwen2_mixed")
    smollm2_tokenizer.save_folder(folder)
    config = Qwen2Config(vocab_size=smollm2_tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=256, use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=1, rms_norm_eps=1e-6, tie_word_embeddings=False)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.5) if "norm" in name else p.normal_(0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


@pytest.mark.parametrize("layers", ["cpp", "python"])
def test_a_sliding_layer_beside_a_global_one_matches_transformers(qwen2_mixed, monkeypatch, layers):
    folder, hf = qwen2_mixed
    if layers == "python":
        monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")
    model = build_model(*load_hf_folder(folder), torch.float32, torch.device("cpu"))
    assert [layer.self_attn.sliding_window for layer in model.layers] == [None, WINDOW]
    assert (model._cpu_decoder() is not None) == (layers == "cpp")
    for ids in PROMPTS:
        _assert_logits_match(_prefill_logits(model, ids), _reference(hf, ids))
    llm = LLM(str(folder), quantization="none", block_size=BLOCK, kv_cache_memory_bytes=4 << 20,
              max_num_batched_tokens=8)
    try:
        assert llm.engine.kv.sliding_window is None            # a global layer reads every block
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        ours = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
    finally:
        llm.close()
    assert ours == [_theirs(hf, p, MAX_TOKENS) for p in PROMPTS]


def test_the_pool_holds_the_window_and_a_block_through_a_long_generation(mistral):
    """One request decoding 60 tokens past a 21-token prompt: once its prompt is in, the pool's
    used blocks never exceed window / block + 1 (the window's blocks and the one being written)."""
    folder, hf = mistral
    llm = LLM(str(folder), quantization="none", block_size=BLOCK, kv_cache_memory_bytes=4 << 20,
              max_num_batched_tokens=8)
    kv, used = llm.engine.kv, []
    allocate = kv.allocate_slots

    def watched(request, *args, **kwargs):
        out = allocate(request, *args, **kwargs)
        if request.num_computed_tokens >= request.num_prompt_tokens:
            used.append(kv.stats().in_use)
        return out

    kv.allocate_slots = watched
    try:
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        ours = llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids
        assert len(used) >= 59 and max(used) <= WINDOW // BLOCK + 1 == 3
        assert kv.stats().in_use == 0
    finally:
        llm.close()
    assert ours == _theirs(hf, PROMPTS[1], 60)
