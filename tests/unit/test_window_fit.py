"""``--mode local`` / ``interactive`` for a model whose every layer slides (issue 43): the mode's
KV capacity (the context window) shrinks to what ``max_num_sequence`` windowed sequences hold,
with the prefill chunk at the window, when that is less; an explicit capacity, memory budget or
chunk stands. Exact sizes for Mistral-7B-v0.1's shape (window 4096, context 32768, blocks of
16), computed by hand below; the per-sequence bound is the KV manager's own."""
from __future__ import annotations

import pytest

from sluice.engine.config import EngineConfig
from sluice.engine.core_builder import _fit_to_window, windowed_blocks
from sluice.engine.kv_cache import KVCacheManager
from sluice.engine.overrides import build_engine_config

CONTEXT, WINDOW, BLOCK = 32768, 4096, 16


def _config(mode: str, overrides: str = "", context: int = CONTEXT) -> EngineConfig:
    return build_engine_config("m.gguf", mode=mode, overrides=overrides, context_window=lambda model: context)


@pytest.mark.parametrize("n, chunk, window, block", [
    (32768, 4096, 4096, 16), (32768, 32768, 4096, 16), (100, 8, 8, 4), (7, 8, 8, 4), (4096, 2047, 2047, 16),
    (33, 1, 5, 1), (1000, 512, 4096, 32)])
def test_the_bound_is_the_kv_managers(n, chunk, window, block):
    kv = KVCacheManager(num_blocks=8, block_size=block, sliding_window=window)
    assert windowed_blocks(n, chunk, window, block) == kv.max_blocks_for(n, chunk)


@pytest.mark.parametrize("mode, overrides, fit", [
    ("local", "", {"max_total_tokens", "max_num_batched_tokens"}),
    ("interactive", "", {"max_total_tokens", "max_num_batched_tokens"}),
    ("local", "prefill_chunk_size=512", {"max_total_tokens"}),
    ("local", "max_total_seq_length=40000", set()),
    ("interactive", "kv_cache_memory_bytes=1GiB", set()),
    ("server", "", set()),
])
def test_only_the_modes_own_choices_may_be_fitted(mode, overrides, fit):
    assert _config(mode, overrides).window_fit == frozenset(fit)


def test_interactive_holds_one_window_and_a_chunk():
    cfg = _config("interactive")
    fitted = _fit_to_window(cfg, WINDOW, CONTEXT)
    # ceil((4095 + 4096) / 16) + 1 = 513 blocks, instead of 2048.
    assert (fitted.cache.max_total_tokens, fitted.scheduler.max_num_batched_tokens) == (513 * BLOCK, WINDOW)
    assert fitted.scheduler.max_num_seqs == 1 and fitted.window_fit == cfg.window_fit


def test_local_keeps_the_context_where_four_windows_need_more():
    cfg = _config("local")
    # 4 * 513 blocks (32832 tokens) >= 32768: the context window, and its chunk, stand.
    assert _fit_to_window(cfg, WINDOW, CONTEXT) is cfg
    assert (cfg.cache.max_total_tokens, cfg.scheduler.max_num_batched_tokens) == (CONTEXT, CONTEXT)


def test_a_given_chunk_stays_and_sizes_the_pool():
    fitted = _fit_to_window(_config("local", "prefill_chunk_size=512"), WINDOW, CONTEXT)
    # ceil((4095 + 512) / 16) + 1 = 289 blocks a sequence, for 4 sequences.
    assert (fitted.cache.max_total_tokens, fitted.scheduler.max_num_batched_tokens) == (4 * 289 * BLOCK, 512)
    fitted = _fit_to_window(_config("local", "prefill_chunk_size=512;block_size=32"), WINDOW, CONTEXT)
    assert fitted.cache.max_total_tokens == 4 * (-(-(4095 + 512) // 32) + 1) * 32


@pytest.mark.parametrize("overrides, window", [
    ("max_total_seq_length=32768", WINDOW),      # explicit: stands, even where it could shrink
    ("kv_cache_memory_bytes=1GiB", WINDOW),      # a memory budget sizes the pool
    ("enable_chunked_prefill=false", WINDOW),    # a whole prompt in one step holds all its blocks
    ("", None),                                  # some layer attends over everything (or no window)
])
def test_what_is_not_the_modes_or_not_windowed_stands(overrides, window):
    cfg = _config("interactive", overrides)
    assert _fit_to_window(cfg, window, CONTEXT) is cfg


def test_a_window_as_long_as_the_context_saves_nothing():
    """Phi-3-mini-4k's shape: window 2047 of 4096; one window and a chunk of it need 257 blocks."""
    cfg = _config("interactive", context=4096)
    assert _fit_to_window(cfg, 2047, 4096) is cfg
    assert _fit_to_window(_config("interactive", "context_window_size=1024"), WINDOW, 1024).cache.max_total_tokens \
        == 1024


def test_window_fit_names_only_what_may_be_fitted():
    with pytest.raises(ValueError, match=r"window_fit: may name only max_total_tokens, max_num_batched_tokens, "
                                         r"got \['max_num_seqs'\]"):
        EngineConfig(window_fit=frozenset({"max_num_seqs"}))
