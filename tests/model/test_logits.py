"""Our Llama-family model computes the same logits as Hugging Face transformers.

* The default model (SmolLM2-135M-Instruct, Q4_1 GGUF), loaded by our GGUF loader, against
  ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` in float32, on several
  prompts: one-shot prefill, token-by-token decode through the paged KV cache, and two
  sequences flattened into one varlen batch.
* Tiny random-weight Hugging Face folders written by transformers itself: a Qwen2-style model
  (QKV bias, untied head) and Llama models with llama3 / yarn / linear / dynamic rope scaling,
  loaded by our safetensors loader, against the transformers class that wrote them.

Tolerance. Both sides run float32 on identical weights (the GGUF test first proves the
dequantized tensors are bit-identical), so differences come only from summation order: our
fused QKV and gate/up matmuls and paged attention group the dot products differently from
transformers' separate matmuls and SDPA. float32 has a 6e-8 unit roundoff; over 30 layers with
residual growth that leaves ~1e-5 relative error in the hidden state, and the logits (|x| up to
~40) carry about 1e-4..1e-3 absolute. We allow atol=2e-3, rtol=1e-4, an order of magnitude
under any change that matters: a wrong RoPE pairing, a missing bias or a mis-ordered fusion
moves logits by 0.1 or more, and argmax must agree wherever the top-2 margin exceeds atol.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sluice.engine.attention.base import AttentionMetadata
from sluice.engine.attention.torch_backend import TorchAttentionBackend
from sluice.engine.loaders import build_model
from sluice.engine.loaders.gguf_loader import load_gguf
from sluice.engine.loaders.hf_loader import load_hf_folder
from tests.model_files import smollm2_gguf

ATOL, RTOL = 2e-3, 1e-4
BLOCK = 4   # small blocks, so that sequences span several non-contiguous blocks
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "東京は日本の首都です。 Emoji 🚀 and digits 12345!",
]


# ---------------------------------------------------------------------------------- helpers
def _caches(arch, num_blocks: int):
    shape = (num_blocks, BLOCK, arch.num_key_value_heads, arch.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_hidden_layers)]


def _meta(context_lens: list[int], query_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    """Metadata for sequences whose new tokens are positions context_len .. context_len+query_len-1."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    slots = [tables[i][p // BLOCK] * BLOCK + p % BLOCK
             for i, (c, s) in enumerate(zip(context_lens, seq_lens)) for p in range(c, s)]
    width = max(len(t) for t in tables)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=BLOCK, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens), seq_lens_cpu=tuple(seq_lens),
    )


def _blocks_for(n: int, first: int) -> list[int]:
    # Non-contiguous, descending block ids: a wrong slot or table lookup cannot pass by accident.
    count = -(-n // BLOCK)
    return [first + 2 * (count - 1 - i) for i in range(count)]


@torch.inference_mode()
def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """One-shot prefill of one sequence; logits at every position [T, vocab]."""
    table = _blocks_for(len(ids), 1)
    caches = _caches(model.arch, max(table) + 1)
    meta = _meta([0], [len(ids)], [table])
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), caches, meta, TorchAttentionBackend())
    return model.compute_logits(hidden)


def _assert_logits_match(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=RTOL)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * ATOL
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])


# ------------------------------------------------------------------------- the default model
# Both loaded once per session (tests/conftest.py, tests/model/conftest.py); the oracle's
# logits are memoised per prompt.
@pytest.fixture(scope="module")
def smollm(smollm2):
    return smollm2


@pytest.fixture(scope="module")
def oracle(hf_smollm2):
    return hf_smollm2


@pytest.mark.slow
def test_gguf_weights_bit_identical_to_transformers(oracle):
    """First, last layer and embedding (all layers go through the same code): dequantization and
    the Q/K un-permutation reproduce transformers' tensors exactly."""
    _, weights, _ = load_gguf(smollm2_gguf())
    ref = oracle.model.state_dict()
    last = oracle.model.config.num_hidden_layers - 1
    names = [n for n in weights if n.startswith(("model.layers.0.", f"model.layers.{last}.")) or "layers" not in n]
    assert len(names) == 2 * 9 + 2
    for name in names:
        assert torch.equal(weights[name], ref[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_logits_match_transformers(smollm, oracle, prompt):
    ids = smollm.tokenizer.encode(prompt)
    _assert_logits_match(_prefill_logits(smollm.model, ids), oracle.logits(ids))


@pytest.mark.slow
def test_chat_prompt_logits_match_transformers(smollm, oracle):
    text = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    ids = smollm.tokenizer.encode(text)
    _assert_logits_match(_prefill_logits(smollm.model, ids), oracle.logits(ids))


@pytest.mark.slow
@torch.inference_mode()
def test_paged_decode_matches_full_forward(smollm, oracle):
    """Prefill 5 tokens, then feed the rest one by one through the cache (positions 5..T-1)."""
    model, ids = smollm.model, smollm.tokenizer.encode(PROMPTS[1])
    table = _blocks_for(len(ids), 3)
    caches, attn = _caches(model.arch, max(table) + 1), TorchAttentionBackend()
    rows = []
    hidden = model(torch.tensor(ids[:5]), torch.arange(5), caches, _meta([0], [5], [table]), attn)
    rows.append(model.compute_logits(hidden))
    for pos in range(5, len(ids)):
        hidden = model(torch.tensor([ids[pos]]), torch.tensor([pos]), caches, _meta([pos], [1], [table]), attn)
        rows.append(model.compute_logits(hidden))
    _assert_logits_match(torch.cat(rows), oracle.logits(ids))


@pytest.mark.slow
@torch.inference_mode()
def test_varlen_batch_matches_per_sequence(smollm, oracle):
    """Two prompts flattened into one forward; each row equals transformers on that prompt alone."""
    model = smollm.model
    a, b = (smollm.tokenizer.encode(p) for p in PROMPTS[:2])
    ta, tb = _blocks_for(len(a), 1), _blocks_for(len(b), 2)
    caches = _caches(model.arch, max(ta + tb) + 1)
    meta = _meta([0, 0], [len(a), len(b)], [ta, tb])
    positions = torch.cat([torch.arange(len(a)), torch.arange(len(b))])
    logits = model.compute_logits(model(torch.tensor(a + b), positions, caches, meta, TorchAttentionBackend()))
    _assert_logits_match(logits[:len(a)], oracle.logits(a))
    _assert_logits_match(logits[len(a):], oracle.logits(b))


# ------------------------------------------------------------------ tiny random HF folders
def _tiny_folder(tmp_path: Path, config) -> tuple[Path, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        # Larger-than-init weights give O(1..10) logits, so that any mistake shows far above atol;
        # random biases and norm weights, so that skipping either would show too.
        for name, p in ref.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.5)
            else:
                p.normal_(0, 0.15)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path, ref


def _tiny_common(**extra) -> dict:
    return dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                rms_norm_eps=1e-6, **extra)


def _check_tiny(folder: Path, ref) -> None:
    # 80 tokens > max_position_embeddings=64: dynamic NTK then stretches, in transformers (for
    # this one forward) and in ours (fixed at max_seq_len=80); the other kinds ignore the length.
    arch, weights = load_hf_folder(folder)
    model = build_model(arch, weights, torch.float32, torch.device("cpu"), max_seq_len=80)
    ids = torch.randint(0, arch.vocab_size, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        want = ref(torch.tensor([ids])).logits[0].float()
    _assert_logits_match(_prefill_logits(model, ids), want)


def test_tiny_qwen2_with_qkv_bias_matches_transformers(tmp_path):
    from transformers import Qwen2Config

    folder, ref = _tiny_folder(tmp_path, Qwen2Config(**_tiny_common(tie_word_embeddings=False), rope_theta=10000.0))
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    arch, _ = load_hf_folder(folder)
    assert arch.attention_bias and not arch.tie_word_embeddings
    _check_tiny(folder, ref)


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
])
def test_tiny_llama_with_rope_scaling_matches_transformers(tmp_path, rope):
    from transformers import LlamaConfig

    config = LlamaConfig(**_tiny_common(tie_word_embeddings=True), rope_parameters={**rope, "rope_theta": 500.0})
    folder, ref = _tiny_folder(tmp_path, config)
    arch, _ = load_hf_folder(folder)
    assert arch.rope_scaling["rope_type"] == rope["rope_type"] and arch.rope_theta == 500.0
    _check_tiny(folder, ref)
