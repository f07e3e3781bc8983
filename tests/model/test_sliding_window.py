"""A model with sliding-window attention is never served wrong (issue 43's first point).

sluice attends over whole contexts, which is what a sliding window of W does for sequences of at
most W tokens. So a Mistral (or Qwen2 with ``use_sliding_window``) whose window is shorter than
its context has its context window capped at the window: within it, greedy outputs equal
transformers' own; a prompt that does not fit is refused (OUT_OF_RANGE), and a generation stops
at the window with ``length``. A window that spans the whole context changes nothing.
"""
from __future__ import annotations

import pytest
import torch

from sluice.engine.errors import ContextLengthError
from sluice.engine.llm import LLM
from sluice.engine.models.config import ModelArchConfig
from sluice.engine.sampling_params import SamplingParams

WINDOW = 12


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, smollm2_tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    folder = tmp_path_factory.mktemp("tiny_mistral")
    smollm2_tokenizer.save_folder(folder)
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=smollm2_tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, sliding_window=WINDOW, tie_word_embeddings=False)
    model = MistralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10)       # logits of O(1): a clear argmax for greedy
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def test_the_context_window_is_the_sliding_window_and_outputs_match_transformers(mistral):
    folder, hf = mistral
    llm = LLM(str(folder), quantization="none")
    try:
        assert llm.engine.max_model_len == WINDOW
        prompt = llm.tokenizer.encode("The sea is")
        assert len(prompt) + 4 <= WINDOW
        ours = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt):]
        assert ours.outputs[0].token_ids == theirs.tolist()
        long = llm.generate([prompt], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0].outputs[0]
        assert long.finish_reason == "length" and len(prompt) + len(long.token_ids) == WINDOW
        with pytest.raises(ContextLengthError, match=f"context window of {WINDOW} tokens"):
            llm.generate([list(range(1, WINDOW + 5))], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match=f"exceeds the model's context window \\({WINDOW}: its sliding window"):
            LLM(str(folder), quantization="none", max_model_len=64)
    finally:
        llm.close()


def test_a_window_that_spans_the_context_or_is_off_changes_nothing():
    base = {"model_type": "mistral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    assert ModelArchConfig.from_hf_config({**base, "sliding_window": 256}).sliding_window is None
    assert ModelArchConfig.from_hf_config({**base, "sliding_window": None}).sliding_window is None
    assert ModelArchConfig.from_hf_config({**base, "sliding_window": 32}).sliding_window == 32
    qwen = {**base, "model_type": "qwen2", "sliding_window": 32}
    assert ModelArchConfig.from_hf_config(qwen).sliding_window is None               # use_sliding_window off
    assert ModelArchConfig.from_hf_config({**qwen, "use_sliding_window": True}).sliding_window == 32
    with pytest.raises(ValueError, match="sliding_window: must be a positive integer"):
        ModelArchConfig.from_hf_config({**base, "sliding_window": "8"})
