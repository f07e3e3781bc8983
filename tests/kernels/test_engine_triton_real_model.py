"""The default model (SmolLM2-135M, head_dim 64, GQA 9/3, 30 layers) served the way a GPU serves
it: float16, with the Triton attention and sampler kernels (penalties included), run here by the
Triton interpreter. Its greedy tokens equal the float32 torch path's token for token, which
tests/model/ ties to transformers."""
from __future__ import annotations

import pytest

from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Rivers flow"]


def _greedy(**options) -> list[list[int]]:
    llm = LLM("smollm2", block_size=16, **options)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.1)
    return [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]


def test_float16_triton_kernels_give_the_float32_torch_tokens():
    want = _greedy(dtype="float32", attention_backend="torch", sampler_backend="torch")
    got = _greedy(dtype="float16", attention_backend="triton", sampler_backend="triton")
    assert got == want
