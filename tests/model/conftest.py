"""The transformers oracle for SmolLM2, loaded once per session and asked each question once.

``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` dequantizes the GGUF itself
(~17 s here), independently of our loader; every module in this folder that compares with
transformers shares this one instance, and its answers are memoised per prompt, so a prompt used
by several tests costs one forward.
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import pytest
import torch


class SmolLM2Oracle:
    def __init__(self, model) -> None:
        self.model = model                        # transformers' LlamaForCausalLM, float32, eval
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}
        self._greedy: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab] float32: one forward over the whole prompt, no cache."""
        key = tuple(ids)
        if key not in self._logits:
            self._logits[key] = self.model(torch.tensor([ids]), use_cache=False).logits[0].float()
        return self._logits[key]

    @torch.inference_mode()
    def greedy(self, ids: list[int], new_tokens: int) -> list[int]:
        """transformers' greedy continuation, ``new_tokens`` long (EOS is a token like any other).

        One prefill, then one token per step through transformers' own KV cache (its standard
        decoding path; it shares no code with our paged cache). On test_engine_vs_hf's 8 prompts x
        32 tokens this gives exactly the tokens of re-running the whole sequence at every step,
        at under half the cost (29 s against 67 s on this 2-core machine)."""
        from transformers import DynamicCache

        key = (tuple(ids), new_tokens)
        if key not in self._greedy:
            cache = DynamicCache()   # filled in place by each forward
            step = {_cache_keyword(self.model): cache, "use_cache": True}
            logits = self.model(torch.tensor([ids]), **step).logits
            toks = [int(logits[0, -1].argmax())]
            while len(toks) < new_tokens:
                logits = self.model(torch.tensor([toks[-1:]]), **step).logits
                toks.append(int(logits[0, -1].argmax()))
            self._greedy[key] = toks
        return self._greedy[key]


def _cache_keyword(model) -> str:
    """transformers 5 renames forward's ``past_key_values`` to ``cache`` (the old name is gone
    in 5.40); older releases know only ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF twice (for the config, then for the weights) and rebuilds
    gguf's tensor-name map for each of the model's ~400 submodules: ~15 of the ~20 s its load
    takes here. Both are pure functions of their arguments, so while the oracle loads each
    answer is computed once and reused, and the file is parsed by the reader sluice uses (the
    same fields as gguf's own reader, ~10x faster: ``plain_array_reader``;
    tests/unit/test_gguf_reader.py). The
    weights are still those transformers dequantizes itself
    (test_gguf_weights_bit_identical_to_transformers compares them with ours)."""
    import gguf

    from sluice.engine.loaders.gguf_loader import plain_array_reader

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    plain = plain_array_reader()   # made (and cached) while gguf.GGUFReader is still the class
    readers: dict = {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = plain(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


@pytest.fixture(scope="session")
def hf_smollm2() -> SmolLM2Oracle:
    from transformers import AutoModelForCausalLM

    from tests.model_files import SMOLLM2_GGUF, smollm2_gguf

    folder = smollm2_gguf().parent
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    return SmolLM2Oracle(model.eval())
