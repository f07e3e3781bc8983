"""The whole engine (LLM offline API) on a tiny random-weight Llama gives the same greedy tokens
with attention_backend="triton" (run by the Triton interpreter on CPU) as with "torch"; in
float32, and in the half precisions a GPU serves in: fp16 with the Triton attention and sampler
kernels together, bf16 with the Triton sampler (the interpreter cannot run bf16 ``tl.dot``, see
tests/kernels/conftest.py).

Prompts are sized so that a step mixes a prefill, a chunked prefill (token budget 16) and
decodes, and decode steps run the split-KV decode kernel over blocks of 4 tokens. Speculation
with draft trees (eagle and medusa) keeps greedy output on the Triton kernels too.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from sluice.engine.llm import LLM
from sluice.engine.loaders import LoadedModel
from sluice.engine.models.config import ModelArchConfig
from sluice.engine.models.llama import LlamaForCausalLM
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.tokenizer import Tokenizer

VOCAB = 96


def _tokenizer(folder: Path) -> Tokenizer:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="t0"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{VOCAB - 1}"}))
    return Tokenizer.from_folder(folder)


def _tiny_llama(dtype: torch.dtype = torch.float32, device="cpu") -> LlamaForCausalLM:
    arch = ModelArchConfig(
        architecture="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=128, tie_word_embeddings=True)
    model = LlamaForCausalLM(arch, max_seq_len=128, dtype=dtype, device=device)   # as the loaders build it
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():   # allocated uninitialised: fill every one
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    return model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> tuple[Tokenizer, Path]:
    folder = tmp_path_factory.mktemp("tiny_llama")
    return _tokenizer(folder), folder


def _greedy(tokenizer, device, dtype: torch.dtype, attention: str, sampler: str) -> list[list[int]]:
    tok, folder = tokenizer
    model = _tiny_llama(dtype, device)
    loaded = LoadedModel(model=model, arch=model.arch, tokenizer=tok, name="tiny-llama", path=folder,
                         dtype=dtype, device=device)
    llm = LLM("tiny-llama", loaded=loaded, device=str(device), dtype=str(dtype).removeprefix("torch."),
              attention_backend=attention, sampler_backend=sampler,
              block_size=4, max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20)
    prompts = [[5, 17, 3, 9, 22, 41, 8], [60, 2, 33, 33, 12, 7, 1, 19, 44, 50, 3, 3, 6, 71, 15], [4]]
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # Greedy rows skip the sampling kernel; penalties and a bias send the middle row through the
    # penalties kernel (the Triton sampler's only kernel with exact, comparable output).
    penalised = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3,
                               presence_penalty=0.4, frequency_penalty=0.3, logit_bias={42: 1.5, 23: -3.0})
    params = [plain, penalised, plain]
    info = llm.engine.model_info
    assert (info.attention_backend, info.dtype) == (attention, str(dtype).removeprefix("torch."))
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params)]


@pytest.mark.parametrize("dtype,attention,sampler", [
    (torch.float32, "triton", "torch"),
    (torch.float16, "triton", "triton"),
    (torch.bfloat16, "torch", "triton"),
])
def test_triton_backend_gives_torch_backend_greedy_tokens(tokenizer, device, dtype, attention, sampler):
    want = _greedy(tokenizer, device, dtype, "torch", "torch")
    assert all(len(t) == 6 for t in want)
    assert _greedy(tokenizer, device, dtype, attention, sampler) == want


@pytest.mark.parametrize("mode", ["eagle", "medusa"])
def test_draft_trees_through_the_triton_kernels_keep_greedy_output(tmp_path, mode):
    """Speculation with draft trees (width 3, every node kept) on attention_backend="triton": the
    tree's rows attend through paged_prefill's tree mask, and greedy output is the output of the
    same engine without speculation, with branches other than the first accepted."""
    from sluice.engine.loaders import load_model
    from sluice.engine.spec_decode import tree
    from tests.tiny_model import prompt, write_tiny_folder
    from tests.unit.test_spec_heads import eagle_state, medusa_state, write_eagle, write_medusa

    loaded = load_model(str(write_tiny_folder(tmp_path / "tiny")))
    heads = (write_eagle(tmp_path / "eagle", eagle_state()) if mode == "eagle"
             else write_medusa(tmp_path / "medusa", medusa_state(lm_heads=False)))
    opts = dict(device="cpu", block_size=4, max_total_tokens=512, num_threads=1, attention_backend="triton")
    llm = LLM(loaded=loaded, speculative_mode=mode, additional_models=str(heads), spec_max_batch_size=8,
              spec_min_draft_prob=0.0, spec_tree_width=3, **opts)
    assert llm.engine.model_info.attention_backend == "triton" and llm.engine.spec.proposer.tree_width == 3
    branches = []
    inner = tree.accepted_moves

    def moves(accepted):
        branches.append(bool(accepted) and accepted[0] != 0)
        return inner(accepted)

    tree.accepted_moves, saved = moves, inner
    try:
        # The bias sends the output through w7, where even random heads' drafts are accepted.
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logit_bias={7: 4.0})
        prompts = [prompt(11), "w9 w9 w9 w9", prompt(5) + " w1 w2 w1 w2"]
        got = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    finally:
        tree.accepted_moves = saved
    want = [r.outputs[0].token_ids for r in LLM(loaded=loaded, **opts).generate(prompts, params)]
    assert got == want and any(branches)
