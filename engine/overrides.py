"""MLC-LLM style ``--mode`` and ``--overrides "k=v;k=v"`` turned into an ``EngineConfig``.

Semantics follow ``mlc_llm serve``: the mode picks the defaults of the batch size
(``max_num_sequence``), the KV capacity (``max_total_seq_length``) and the prefill chunk
(``prefill_chunk_size``); an override replaces a mode default or any other option. An explicit
memory budget (``kv_cache_memory_bytes`` / ``gpu_memory_utilization``) without
``max_total_seq_length`` sizes the KV pool instead of the mode's capacity.

* ``local``: at most 4 sequences; KV capacity and prefill chunk = the context window.
* ``interactive``: 1 sequence; KV capacity and prefill chunk = the context window.
* For both: a model whose every layer slides (Mistral's sliding window; not Gemma's alternating
  layers) never holds more of a sequence than ceil((window - 1 + chunk) / block) + 1 blocks, as
  the KV manager frees what falls behind the window. Its KV capacity becomes the smaller of the
  context window and what ``max_num_sequence`` such sequences hold, and when that is smaller
  with a chunk of the window, the prefill chunk becomes the window (unless it was given). An
  explicit ``max_total_seq_length`` or memory budget always stands
  (``EngineConfig.window_fit``, ``core_builder._fit_to_window``).
* ``server``: as many sequences as the KV pool holds (up to 128 per step); KV capacity from
  memory (``gpu_memory_utilization`` on CUDA, ``kv_cache_memory_bytes`` on CPU); prefill chunk
  = min(context window, 2048).

``attention_sink_size`` S (StreamingLLM) needs ``sliding_window_size`` W, which then is each
sequence's KV cache size, sinks included: the cache keeps the first S tokens and the most recent
ones, at most ceil(W / block_size) blocks, dropping a whole block at a time, and positions are
positions in that cache. S must be a multiple of ``block_size`` (the cache drops whole blocks after
the sinks) and W must leave two blocks after them; 0 turns sinks off (engine/DESIGN.md).

``parse_overrides`` checks every key and value before any model file is opened; an unknown key or
a bad value raises ``ValueError`` that names the key.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from sluice.engine.config import EngineConfig

MODES = ("local", "interactive", "server")
_SERVER_MAX_SEQS = 128
_SERVER_PREFILL_CHUNK = 2048


def _int(text: str) -> int:
    return int(text.replace("_", ""), 10)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _bytes(text: str) -> int:
    """A byte count: ``1073741824``, ``512MiB``, ``1.5G``."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError("expected a byte count such as 1073741824, 512MiB or 2G")
    unit = (m.group(2) or "").upper()[:1]
    return int(float(m.group(1)) * _UNITS[unit])


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


@dataclass(frozen=True)
class _Key:
    option: str                      # the flat option name that sluice.engine.llm.build_config takes
    parse: Callable[[str], Any]
    help: str


# MLC's names first, then sluice's own. Each maps to one field of the per-subsystem configs.
KEYS: dict[str, _Key] = {
    "max_num_sequence": _Key("max_num_seqs", _int, "sequences running per step (batch size)"),
    "max_total_seq_length": _Key("max_total_tokens", _int, "KV cache capacity in tokens"),
    "prefill_chunk_size": _Key("max_num_batched_tokens", _int, "token budget of one step (prefill chunk)"),
    "gpu_memory_utilization": _Key("gpu_memory_utilization", float, "fraction of GPU memory for weights + KV"),
    "context_window_size": _Key("max_model_len", _int, "context window in tokens (<= the model's)"),
    "sliding_window_size": _Key("sliding_window_size", _int,
                                "window of the model's sliding-window layers in tokens (-1: off, whole contexts)"),
    "attention_sink_size": _Key("attention_sink_size", _int,
                                "StreamingLLM sinks: with sliding_window_size W, each sequence's KV cache keeps its "
                                "first S tokens and its latest, W in all, positions counted in the cache "
                                "(S a multiple of block_size; 0: off)"),
    "block_size": _Key("block_size", _int, "tokens per KV block"),
    "kv_cache_memory_bytes": _Key("kv_cache_memory_bytes", _bytes, "KV pool size on CPU (e.g. 512MiB)"),
    "kv_cache_dtype": _Key("kv_cache_dtype", str, "KV cache elements: auto (the model's dtype) | float32 | float16"),
    "enable_prefix_caching": _Key("enable_prefix_caching", _bool, "reuse KV blocks of shared prefixes"),
    "enable_chunked_prefill": _Key("enable_chunked_prefill", _bool, "split long prompts across steps"),
    "max_waiting": _Key("max_waiting", _int, "bound of the waiting queue (beyond: RESOURCE_EXHAUSTED)"),
    "attention_backend": _Key("attention_backend", str, "auto | torch | triton | flash_attn"),
    "sampler_backend": _Key("sampler_backend", str, "auto | torch | triton"),
    "dtype": _Key("dtype", str, "auto | float32 | float16 | bfloat16"),
    "num_threads": _Key("num_threads", _int, "torch intra-op threads on CPU"),
    "tensor_parallel_shards": _Key("tensor_parallel_shards", _int,
                                   "ranks the model is split across (tensor parallelism over torch.distributed, CPU)"),
    "quantization": _Key("quantization", str, "weights in memory: none | bf16 | int8 | int4 | w8a8 | w4a8 | auto (CPU)"),
    "num_speculative_tokens": _Key("num_speculative_tokens", _int, "draft tokens per step"),
    # Speculative decoding (--speculative-mode); MLC's spec_draft_length, then sluice's own.
    "spec_draft_length": _Key("spec_draft_length", _int, "draft tokens proposed per request and step (K)"),
    "spec_ngram_max": _Key("spec_ngram_max", _int, "ngram mode: longest suffix matched"),
    "spec_ngram_min": _Key("spec_ngram_min", _int, "ngram mode: shortest suffix matched"),
    "spec_max_batch_size": _Key("spec_max_batch_size", _int, "no drafts above this many running requests"),
    "spec_min_draft_prob": _Key("spec_min_draft_prob", float,
                                "eagle/medusa: a chain ends below this head probability (0.35); a tree keeps paths above it (0.1)"),
    "spec_head_format": _Key("spec_head_format", str, "eagle/medusa: drafting weights: auto | float32 | w8a8 (CPU)"),
    "spec_tree_width": _Key("spec_tree_width", _int, "eagle: children per draft node (1: a chain; default 3 on the CPU stack)"),
    "spec_tree_nodes": _Key("spec_tree_nodes", _int, "eagle/medusa: tree nodes verified per step by score "
                            "(default: what the target runs at one row's cost, 5 on the float32 CPU stack)"),
    "seed": _Key("seed", _int, "the engine's base random seed"),
    # Request caps (engine.config.LimitsConfig); over a cap a request is INVALID_ARGUMENT.
    "max_n": _Key("max_n", _int, "choices per request"),
    "max_stop_strings": _Key("max_stop_strings", _int, "stop strings per request"),
    "max_stop_length": _Key("max_stop_length", _int, "characters in one stop string"),
    "max_logit_bias": _Key("max_logit_bias", _int, "logit_bias entries per request"),
    "max_logprobs": _Key("max_logprobs", _int, "top logprob alternatives per token"),
    "max_prompt_bytes": _Key("max_prompt_bytes", _bytes, "UTF-8 bytes of a prompt or a chat's messages"),
    "max_chat_messages": _Key("max_chat_messages", _int, "messages in one chat"),
    "max_tools_bytes": _Key("max_tools_bytes", _bytes, "JSON bytes of a chat's tools and tool calls"),
}
# MLC options with no sluice equivalent: named, so the error says so rather than "unknown".
_UNSUPPORTED_MLC = ("pipeline_parallel_stages", "max_history_size",
                    "prefix_cache_max_num_recycling_seqs", "max_single_sequence_length")
_WHY_UNSUPPORTED: dict[str, str] = {}


def parse_overrides(text: str | None) -> dict[str, Any]:
    """``"max_num_sequence=32;max_total_seq_length=4096"`` -> {MLC key: typed value}."""
    result: dict[str, Any] = {}
    for item in (text or "").split(";"):
        item = item.strip()
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key or not raw:
            raise ValueError(f"overrides: expected key=value, got {item!r}")
        if key in _UNSUPPORTED_MLC:
            why = f": {_WHY_UNSUPPORTED[key]}" if key in _WHY_UNSUPPORTED else ""
            raise ValueError(f"overrides: {key} is an MLC-LLM option that sluice does not support{why}")
        spec = KEYS.get(key)
        if spec is None:
            raise ValueError(f"overrides: unknown key {key!r}; known keys: {', '.join(KEYS)}")
        if key in result:
            raise ValueError(f"overrides: {key} is given twice")
        try:
            result[key] = spec.parse(raw)
        except ValueError as exc:
            raise ValueError(f"overrides: {key}={raw!r} is not valid: {exc}") from None
    return result


def mode_defaults(mode: str, context_window: int) -> dict[str, Any]:
    """The MLC keys a mode fixes, for a model with this context window."""
    if mode == "local":
        return {"max_num_sequence": 4, "max_total_seq_length": context_window, "prefill_chunk_size": context_window}
    if mode == "interactive":
        return {"max_num_sequence": 1, "max_total_seq_length": context_window, "prefill_chunk_size": context_window}
    if mode == "server":
        return {"max_num_sequence": _SERVER_MAX_SEQS,
                "prefill_chunk_size": min(context_window, _SERVER_PREFILL_CHUNK)}
    raise ValueError(f"mode: must be one of {', '.join(MODES)}, got {mode!r}")


def check_speculative(speculative_mode: str | None, additional_models: str | None,
                      overrides: dict[str, Any]) -> None:
    """``--speculative-mode``, ``--additional-models`` and the spec_* overrides, checked before
    the model's metadata is read (``SpeculativeConfig`` raises ValueError naming the field)."""
    from sluice.engine.spec_decode.config import SpeculativeConfig

    spec = {KEYS[k].option: v for k, v in overrides.items() if KEYS[k].option.startswith("spec_")}
    SpeculativeConfig(speculative_mode=speculative_mode or "disable", additional_models=additional_models, **spec)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: must be one of {', '.join(MODES)}, got {mode!r}")


def build_engine_config(model: str, *, mode: str = "local", overrides: str | dict[str, Any] | None = None,
                        device: str = "auto", context_window: Callable[[str], int] | None = None,
                        speculative_mode: str = "disable", additional_models: str | None = None,
                        ) -> EngineConfig:
    """Mode defaults, then overrides, into a validated ``EngineConfig``.

    ``context_window(model)`` reads the model's context length from its metadata (no weights);
    it is called only when the mode needs it and ``context_window_size`` was not overridden.
    """
    from sluice.engine.llm import build_config   # the one place that splits flat options per subsystem

    check_mode(mode)
    given = parse_overrides(overrides) if not isinstance(overrides, dict) else dict(overrides)
    check_speculative(speculative_mode, additional_models, given)
    window = given.get("context_window_size")
    if window is None:
        window = (context_window or model_context_window)(model)
    defaults = mode_defaults(mode, window)
    if given.keys() & {"kv_cache_memory_bytes", "gpu_memory_utilization"}:
        defaults.pop("max_total_seq_length", None)   # an explicit memory budget sizes the pool
    values = {**defaults, **given}
    options = {KEYS[k].option: v for k, v in values.items()}
    options["window_fit"] = _window_fit(defaults, given)
    options |= {"speculative_mode": speculative_mode or "disable", "additional_models": additional_models}
    try:
        return build_config(model, device=device, **options)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"overrides: {_mlc_name(str(exc))}") from None


def _window_fit(defaults: dict[str, Any], given: dict[str, Any]) -> frozenset[str]:
    """The options a model whose every layer slides may lower (``EngineConfig.window_fit``): the
    mode's KV capacity, and its prefill chunk with it, each only where the mode chose it."""
    if "max_total_seq_length" not in defaults or "max_total_seq_length" in given:
        return frozenset()
    chunk = {"max_num_batched_tokens"} if "prefill_chunk_size" not in given else set()
    return frozenset({"max_total_tokens"} | chunk)


def _mlc_name(message: str) -> str:
    """Say the MLC key in a config error that names the internal field."""
    field_name = message.split(":", 1)[0]
    for key, spec in KEYS.items():
        if spec.option == field_name and key != field_name:
            return f"{key} ({message})"
    return message


def model_context_window(model: str) -> int:
    """The model's own context window, read from its metadata without loading weights."""
    from sluice.engine.errors import ModelLoadError
    from sluice.engine.loaders import resolve_path
    from sluice.engine.loaders.gguf_loader import gguf_architecture, gguf_metadata, open_gguf
    from sluice.engine.loaders.hf_loader import arch_from_folder

    path = resolve_path(model)
    if not path.is_file():
        return arch_from_folder(path).max_position_embeddings
    reader = open_gguf(path, arrays=False)   # the scalars only: the vocabulary is read when loading
    window = gguf_metadata(reader, f"{gguf_architecture(reader, path)}.context_length")
    if window is None:
        raise ModelLoadError(f"{path}: GGUF metadata lacks the context length")
    return int(window)
