"""``--mode`` / ``--overrides`` follow ``mlc_llm serve``: the mode picks the batch size, KV
capacity and prefill chunk; overrides replace them; an unknown key or a bad value is a clear
error that names the key, raised before any weights load."""
from __future__ import annotations

import pytest

from sluice.engine.overrides import build_engine_config, mode_defaults, parse_overrides

WINDOW = 8192


def _window(model: str) -> int:
    return WINDOW


def _no_window(model: str) -> int:
    raise AssertionError("the model's metadata must not be read")


def test_parse_types_each_key() -> None:
    got = parse_overrides(" max_num_sequence=32; max_total_seq_length=4_096;gpu_memory_utilization=0.5;"
                          "enable_prefix_caching=false;kv_cache_memory_bytes=512MiB;attention_backend=torch;")
    assert got == {"max_num_sequence": 32, "max_total_seq_length": 4096, "gpu_memory_utilization": 0.5,
                   "enable_prefix_caching": False, "kv_cache_memory_bytes": 512 << 20, "attention_backend": "torch"}
    assert parse_overrides("") == {} and parse_overrides(None) == {}


@pytest.mark.parametrize("text, words", [
    ("max_num_seqs=4", ["unknown key 'max_num_seqs'", "max_num_sequence"]),
    ("pipeline_parallel_stages=2", ["pipeline_parallel_stages", "does not support"]),
    ("tensor_parallel_shards=two", ["tensor_parallel_shards", "not valid"]),
    ("max_num_sequence=abc", ["max_num_sequence='abc'", "not valid"]),
    ("enable_prefix_caching=maybe", ["enable_prefix_caching", "true or false"]),
    ("kv_cache_memory_bytes=lots", ["kv_cache_memory_bytes", "byte count"]),
    ("max_num_sequence", ["key=value"]),
    ("max_num_sequence=", ["key=value"]),
    ("block_size=16;block_size=32", ["block_size is given twice"]),
])
def test_parse_errors_name_the_key(text: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        parse_overrides(text)
    for w in words:
        assert w in str(info.value)


@pytest.mark.parametrize("mode, seqs, capacity, chunk", [
    ("local", 4, WINDOW, WINDOW),
    ("interactive", 1, WINDOW, WINDOW),
    ("server", 128, None, 2048),
])
def test_mode_picks_the_defaults(mode: str, seqs: int, capacity: int | None, chunk: int) -> None:
    cfg = build_engine_config("smollm2", mode=mode, context_window=_window)
    assert cfg.scheduler.max_num_seqs == seqs
    assert cfg.cache.max_total_tokens == capacity
    assert cfg.scheduler.max_num_batched_tokens == chunk
    assert cfg.max_model_len is None   # the model's own window


def test_overrides_replace_mode_defaults_and_reach_every_subsystem() -> None:
    cfg = build_engine_config(
        "smollm2", mode="interactive", device="cpu", context_window=_window,
        overrides="max_num_sequence=8;prefill_chunk_size=512;block_size=32;max_waiting=3;"
                  "attention_backend=torch;enable_prefix_caching=0;gpu_memory_utilization=0.7")
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_waiting) == (8, 512, 3)
    assert (cfg.cache.block_size, cfg.cache.enable_prefix_caching, cfg.cache.gpu_memory_utilization) == (32, False, 0.7)
    assert (cfg.device.device, cfg.device.attention_backend) == ("cpu", "torch")
    # An explicit memory budget sizes the pool instead of the mode's capacity.
    assert cfg.cache.max_total_tokens is None


def test_context_window_override_drives_the_mode_without_reading_the_model() -> None:
    cfg = build_engine_config("smollm2", mode="local", overrides="context_window_size=1024", context_window=_no_window)
    assert cfg.max_model_len == 1024
    assert cfg.cache.max_total_tokens == 1024 and cfg.scheduler.max_num_batched_tokens == 1024


@pytest.mark.parametrize("overrides, words", [
    ("max_num_sequence=0", ["max_num_sequence", "positive"]),
    ("gpu_memory_utilization=1.5", ["gpu_memory_utilization", "(0, 1]"]),
    ("attention_backend=cudnn", ["attention_backend"]),
    ("prefill_chunk_size=-4", ["prefill_chunk_size", "positive"]),
])
def test_bad_values_are_rejected_by_the_configs_naming_the_key(overrides: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        build_engine_config("smollm2", overrides=overrides, context_window=_window)
    for w in words:
        assert w in str(info.value)


def test_bad_mode_and_device() -> None:
    with pytest.raises(ValueError, match="mode: must be one of local, interactive, server"):
        build_engine_config("smollm2", mode="turbo", context_window=_no_window)
    with pytest.raises(ValueError, match="device"):
        build_engine_config("smollm2", device="tpu", context_window=_window)
    with pytest.raises(ValueError, match="mode"):
        mode_defaults("batch", WINDOW)


def test_context_window_is_read_from_the_default_models_metadata() -> None:
    """No injected reader: the GGUF header of the packaged SmolLM2 says 8192 tokens."""
    cfg = build_engine_config("smollm2", mode="local")
    assert cfg.cache.max_total_tokens == 8192
