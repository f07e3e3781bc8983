"""Attention sinks (issue 43; MLC's ``attention_sink_size``, StreamingLLM): with a sliding window
of W tokens and S sinks, a sequence's KV cache keeps its first S tokens and its most recent ones,
at most ceil(W / block) blocks, and positions are positions in that cache.

The oracle is a dense decoder written here over a tiny random-weight Llama's own weights (float32,
transformers' modules for the norms, projections and MLP): it keeps every layer's *unrotated*
keys and rotates each at its current cache index at every step, so it shares nothing with the
engine's re-rotation of cached keys. It drops the oldest block after the sinks at the engine's
granularity (when a step's tokens would need a block past the cache's size) and runs a long
prompt in the same chunks as the engine (at most ``max_step_tokens`` a step).

* greedy continuations past several drops, three requests batched (one prompt longer than the
  window), equal the oracle's, through the C++ layer stack and through the Python layers, and
  differ from transformers' whole-context ones; no request holds more than ceil(W / block)
  blocks, the pool gets every block back, and no prefix is cached;
* re-rotated keys equal keys rotated at the earlier position (float32 and float16 caches);
* what sinks do not combine with is refused by name.
"""
from __future__ import annotations

import pytest
import torch

from sluice.engine.llm import LLM, build_config
from sluice.engine.sampling_params import SamplingParams

BLOCK, SINKS, WINDOW, LAYERS = 4, 4, 20, 2
CACHE_BLOCKS = -(-WINDOW // BLOCK)                              # 5
MAX_STEP = CACHE_BLOCKS * BLOCK - SINKS - BLOCK + 1              # 13: a step's tokens always fit
PROMPTS = [[3, 17, 400, 9, 5000, 77], list(range(100, 121)),
           [900, 4, 4, 4, 31, 2000, 8, 1, 65, 101, 7, 5, 999, 12, 13, 14]]
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def llama(tmp_path_factory, smollm2_tokenizer):
    """(folder, transformers model): SmolLM2's tokenizer beside random Llama weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_llama_sinks")
    smollm2_tokenizer.save_folder(folder)
    config = LlamaConfig(vocab_size=smollm2_tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.5) if "norm" in name else p.normal_(0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


class StreamingReference:
    """One sequence decoded with StreamingLLM's cache over ``hf``'s weights, densely in float32."""

    def __init__(self, hf) -> None:
        self.hf = hf
        self.keys = [torch.empty(0, 2, 16) for _ in range(LAYERS)]     # unrotated, [L, kv_heads, D]
        self.values = [torch.empty(0, 2, 16) for _ in range(LAYERS)]
        self.dropped = 0                                                  # blocks dropped so far

    def step(self, ids: list[int]) -> torch.Tensor:
        """Runs ``ids`` (one chunk); returns the last one's logits [vocab]."""
        length = self.keys[0].shape[0]
        drop = max(0, -(-(length + len(ids)) // BLOCK) - CACHE_BLOCKS)
        assert drop == 0 or drop <= length // BLOCK - SINKS // BLOCK
        if drop:   # the oldest blocks after the sinks leave; later keys take their cache positions
            keep = torch.cat([torch.arange(SINKS), torch.arange(SINKS + drop * BLOCK, length)])
            self.keys = [k[keep] for k in self.keys]
            self.values = [v[keep] for v in self.values]
            self.dropped += drop
        m = self.hf.model
        h = m.embed_tokens(torch.tensor(ids))                              # [T, hidden]
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(len(ids), 4, 16)
            self.keys[i] = torch.cat([self.keys[i], a.k_proj(x).view(len(ids), 2, 16)])
            self.values[i] = torch.cat([self.values[i], a.v_proj(x).view(len(ids), 2, 16)])
            n = self.keys[i].shape[0]
            cos, sin = m.rotary_emb(h[None], torch.arange(n)[None])         # every key at its cache index
            k = _rope(self.keys[i], cos[0], sin[0]).repeat_interleave(2, dim=1)     # [n, 4, 16]
            qr = _rope(q, cos[0, n - len(ids):], sin[0, n - len(ids):])
            v = self.values[i].repeat_interleave(2, dim=1)
            scores = torch.einsum("thd,nhd->htn", qr, k) / 4.0              # [4, T, n]
            mask = torch.arange(n)[None, :] > torch.arange(n - len(ids), n)[:, None]
            probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
            h = h + a.o_proj(torch.einsum("htn,nhd->thd", probs, v).reshape(len(ids), 64))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.hf.lm_head(m.norm(h))[-1]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        with torch.inference_mode():
            for at in range(0, len(prompt), MAX_STEP):     # the engine's chunks
                logits = self.step(prompt[at:at + MAX_STEP])
            out = []
            for _ in range(n):
                out.append(int(logits.argmax()))
                logits = self.step(out[-1:])
        return out


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with cos/sin [T, D] (transformers' rotate_half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _theirs(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()


def test_the_reference_drops_blocks_and_matters(llama):
    """The oracle's cache is what StreamingLLM keeps, and it changes the tokens."""
    _, hf = llama
    ref = StreamingReference(hf)
    tokens = ref.greedy(PROMPTS[0], MAX_TOKENS)
    assert ref.keys[0].shape[0] <= CACHE_BLOCKS * BLOCK and ref.dropped >= 3     # several drops
    assert tokens != _theirs(hf, PROMPTS[0], MAX_TOKENS)


@pytest.mark.parametrize("layers", ["cpp", "python"])
def test_greedy_past_several_drops_equals_the_streaming_reference(llama, monkeypatch, layers):
    folder, hf = llama
    if layers == "python":
        monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")
    llm = LLM(str(folder), quantization="none", block_size=BLOCK, kv_cache_memory_bytes=4 << 20,
              max_num_batched_tokens=256, sliding_window_size=WINDOW, attention_sink_size=SINKS)
    try:
        kv = llm.engine.kv
        assert (kv.sinks, kv.cache_window, kv.sliding_window, kv.enable_prefix_caching) == (SINKS, WINDOW, None, False)
        assert kv.max_step_tokens == MAX_STEP
        model = llm.engine.runner.model
        assert (model._cpu_decoder() is not None) == (layers == "cpp")
        assert all(layer.self_attn.sliding_window is None for layer in model.layers)
        held, allocate = [], kv.allocate_slots

        def watched(request, *args, **kwargs):
            out = allocate(request, *args, **kwargs)
            held.append(max(kv.num_held_blocks(rid) for rid in kv._req_blocks))
            return out

        kv.allocate_slots = watched
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        ours = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
        assert max(held) == CACHE_BLOCKS          # the cache's blocks, never more
        stats = kv.stats()
        assert stats.in_use == 0 and stats.cached == 0 and stats.free == stats.total     # nothing leaked
        kv.check_invariants()
        again = llm.generate([PROMPTS[1]], params)[0]        # no prefix hit: blocks were re-rotated
        assert again.usage.cached_tokens == 0 and again.outputs[0].token_ids == ours[1]
    finally:
        llm.close()
    assert ours == [StreamingReference(hf).greedy(p, MAX_TOKENS) for p in PROMPTS]


def test_what_sinks_do_not_combine_with_is_refused(llama):
    from sluice.engine.overrides import parse_overrides

    assert parse_overrides("attention_sink_size=4;sliding_window_size=64") == {
        "attention_sink_size": 4, "sliding_window_size": 64}
    from sluice.engine.overrides import build_engine_config

    config = build_engine_config(str(llama[0]), overrides="attention_sink_size=4;sliding_window_size=20;block_size=4")
    assert (config.attention_sink_size, config.sliding_window_size, config.cache.block_size) == (4, 20, 4)
    with pytest.raises(ValueError, match="overrides: attention_sink_size: 4 sinks are not a whole number of KV "
                                         "blocks of 16 tokens"):
        build_engine_config(str(llama[0]), overrides="attention_sink_size=4;sliding_window_size=64")
    cases = [
        (dict(attention_sink_size=4), "attention_sink_size: attention sinks need a sliding window"),
        (dict(attention_sink_size=4, sliding_window_size=-1), "need a sliding window"),
        (dict(attention_sink_size=4, sliding_window_size=64), "not a whole number of KV blocks of 16 tokens"),
        (dict(attention_sink_size=16, sliding_window_size=32), "must hold the 16 sinks and two KV blocks"),
        (dict(attention_sink_size=-1, sliding_window_size=64), "attention_sink_size: must be a positive integer"),
        (dict(attention_sink_size=16, sliding_window_size=64, speculative_mode="ngram", spec_draft_length=2),
         "speculative decoding with attention sinks is not supported"),
        (dict(attention_sink_size=16, sliding_window_size=64, tensor_parallel_shards=2),
         "tensor parallelism with attention sinks is not supported"),
    ]
    for options, words in cases:
        with pytest.raises(ValueError, match=words):
            build_config("smollm2", **options)
    # A model whose RoPE scales cos/sin (YaRN's attention factor) cannot have its keys re-rotated.
    from sluice.engine.loaders import build_model
    from sluice.engine.loaders.hf_loader import load_hf_folder
    from sluice.engine.models.rope import sink_rotation

    folder, _ = llama
    arch, weights = load_hf_folder(folder)
    assert sink_rotation(build_model(arch, weights, torch.float32, torch.device("cpu"))) is not None
    import dataclasses

    yarn = dataclasses.replace(arch, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64})
    with pytest.raises(ValueError, match=r"attention_sink_size: the model's RoPE \(yarn\) scales cos/sin"):
        sink_rotation(build_model(yarn, load_hf_folder(folder)[1], torch.float32, torch.device("cpu")))


def test_a_model_mixing_global_and_sliding_layers_is_refused(tmp_path, smollm2_tokenizer):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    smollm2_tokenizer.save_folder(tmp_path)
    config = Qwen2Config(vocab_size=smollm2_tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, use_sliding_window=True, sliding_window=8,
                         max_window_layers=1)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="attention_sink_size: a qwen2 model that mixes global and sliding"):
        LLM(str(tmp_path), quantization="none", block_size=BLOCK, kv_cache_memory_bytes=4 << 20,
            sliding_window_size=WINDOW, attention_sink_size=SINKS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_re_rotated_keys_equal_keys_rotated_at_the_earlier_position(llama, dtype):
    from sluice.engine.loaders import build_model
    from sluice.engine.loaders.hf_loader import load_hf_folder
    from sluice.engine.models.rope import apply_rotary, rotate_keys, sink_rotation

    model = build_model(*load_hf_folder(llama[0]), torch.float32, torch.device("cpu"))
    torch.manual_seed(1)
    x = torch.randn(37, 2, 16)                                            # [T, kv_heads, D]
    positions = torch.arange(40, 77)
    at = apply_rotary(x, *model.rotary.cos_sin(positions, torch.float32)).to(dtype)
    earlier = apply_rotary(x, *model.rotary.cos_sin(positions - 24, torch.float32))
    shifted = rotate_keys(at.clone(), -24, sink_rotation(model))
    assert shifted.dtype == dtype
    torch.testing.assert_close(shifted.float(), earlier, **({} if dtype == torch.float32 else
                                                          dict(atol=2e-3, rtol=2e-3)))
    assert (at.float() - earlier).abs().max() > 0.1                     # the shift matters
