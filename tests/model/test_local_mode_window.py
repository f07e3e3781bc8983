"""``--mode local`` for a model whose every layer slides (issue 43): the KV pool holds what four
windowed sequences need, not the context window, and still serves prompts longer than the whole
pool, four at a time, with transformers' greedy tokens and no preemption.

The tiny random-weight Mistral of test_sliding_window (window 8, blocks of 4 tokens, context 256):
a sequence holds at most ceil((8 - 1 + 8) / 4) + 1 = 5 blocks with the mode's chunk fitted to the
window, so the pool is 4 * 5 blocks = 80 tokens instead of 256.
"""
from __future__ import annotations

from sluice.engine.llm import LLM
from sluice.engine.overrides import build_engine_config
from sluice.engine.sampling_params import SamplingParams
from tests.model.test_sliding_window import BLOCK, WINDOW, _theirs, mistral  # noqa: F401  (mistral: the fixture)

POOL_BLOCKS = 4 * 5
PROMPTS = [list(range(200, 300)), [7, 5, 999] * 30, list(range(1000, 1033)), [3, 17, 400, 9, 5000, 77]]
MAX_TOKENS = 12


def test_local_mode_sizes_the_pool_for_windows_and_serves_prompts_longer_than_it(mistral):  # noqa: F811
    folder, hf = mistral
    config = build_engine_config(str(folder), mode="local", device="cpu",
                                 overrides=f"block_size={BLOCK};quantization=none")
    assert config.cache.max_total_tokens == hf.config.max_position_embeddings == 256   # the mode's default
    llm = LLM(config=config)
    try:
        assert llm.engine.kv.sliding_window == WINDOW
        assert llm.engine.kv.num_total_blocks == POOL_BLOCKS                    # 80 tokens, not 256
        assert llm.engine.scheduler.config.max_num_batched_tokens == WINDOW   # the chunk fitted with it
        assert max(map(len, PROMPTS[:2])) > POOL_BLOCKS * BLOCK               # longer than the whole pool
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        ours = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]   # all four at once
        assert llm.engine.scheduler.num_preemptions == 0                      # four windows fit, as sized
        stats = llm.engine.kv.stats()
        assert stats.in_use == 0 and stats.free + stats.cached == POOL_BLOCKS
    finally:
        llm.close()
    assert ours == [_theirs(hf, p, MAX_TOKENS) for p in PROMPTS]
