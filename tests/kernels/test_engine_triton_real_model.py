"""The default model (SmolLM2-135M, head_dim 64, GQA 9/3, 30 layers) served the way a GPU serves
it: float16, with the Triton attention and sampler kernels (penalties included), run here by the
Triton interpreter. Its greedy tokens equal the float32 torch path's token for token, which
tests/model/ ties to transformers."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from sluice.engine.llm import LLM
from sluice.engine.loaders import LoadedModel, build_model
from sluice.engine.loaders.gguf_loader import load_gguf
from sluice.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

# Two prompts of different lengths (5 and 2 tokens) in one batch: the kernels' per-sequence
# offsets and lengths are exercised, and the interpreter runs a program per sequence and head,
# so each prompt costs about a third of the test (a third, "def fibonacci(n):", took ~6 s).
PROMPTS = ["The capital of France is", "Rivers flow"]


def _greedy(loaded: LoadedModel, **options) -> list[list[int]]:
    llm = LLM("smollm2", loaded=loaded, block_size=16, **options)
    # One prefill and 2 decode steps: the second decode's penalties also count a generated token,
    # and its attention reads a key the KV-store kernel wrote in the first decode. Every sequence stays
    # inside its first 16-token block either way, so more tokens only repeat the same decode step
    # (each ~4 s of the interpreter here; 8 tokens took ~18 s more than 4).
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, repetition_penalty=1.1)
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]


def _in_float16(smollm2: LoadedModel) -> LoadedModel:
    """The same GGUF weights built in float16 (the session's tokenizer is reused)."""
    arch, weights, _ = load_gguf(smollm2.path)
    return dataclasses.replace(smollm2, model=build_model(arch, weights, torch.float16, smollm2.device),
                               dtype=torch.float16)


def test_float16_triton_kernels_give_the_float32_torch_tokens(smollm2):
    want = _greedy(smollm2, dtype="float32", attention_backend="torch", sampler_backend="torch")
    got = _greedy(_in_float16(smollm2), dtype="float16", attention_backend="triton", sampler_backend="triton")
    assert got == want
