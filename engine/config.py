"""Configuration, one frozen dataclass per subsystem, each validated in ``__post_init__``.

Each component receives only its own slice. Environment variables are read in ``engine.envs``
and nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from sluice.engine.spec_decode.config import SpeculativeConfig
from sluice.engine.structured.spec import StructuredOutputConfig

_DTYPES = ("auto", "float32", "float16", "bfloat16")
# The KV cache's element type: auto = the model's dtype; float16 halves a CPU cache (and the
# bytes attention reads per token) against float32.
_KV_DTYPES = ("auto", "float32", "float16")
_BACKENDS = ("auto", "torch", "triton", "flash_attn")
# Weight formats (engine.models.quant): none = float32; the others are CPU-only.
QUANTIZATIONS = ("none", "bf16", "int8", "int4", "w8a8", "w4a8", "auto")
# What EngineConfig.window_fit may name: the KV capacity in tokens and the prefill chunk.
WINDOW_FIT = ("max_total_tokens", "max_num_batched_tokens")


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # CPU: the KV pool's size in bytes. GPU: ignored in favour of gpu_memory_utilization.
    kv_cache_memory_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
    # An explicit KV capacity in tokens (MLC's max_total_seq_length); overrides the byte budget.
    max_total_tokens: int | None = None
    kv_cache_dtype: str = "auto"           # auto | float32 | float16 (_KV_DTYPES)

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        if self.kv_cache_dtype not in _KV_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {', '.join(_KV_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.max_total_tokens is not None:
            _positive("max_total_tokens", self.max_total_tokens)
        _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32                 # running sequences per step
    max_num_batched_tokens: int = 2048     # the token budget of one step
    max_waiting: int = 1024                # bound of the waiting queue; beyond it add fails
    enable_chunked_prefill: bool = True
    # Upper bound on draft tokens a request may carry in a step (speculative decoding).
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_waiting", self.max_waiting)
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens: must be >= 0, got {self.num_speculative_tokens}")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"                   # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                    # auto: float32 on CPU, bfloat16 on CUDA
    attention_backend: str = "auto"        # auto: triton (+ flash-attn prefill if installed) on CUDA, torch on CPU
    sampler_backend: str = "auto"          # auto: triton on CUDA, torch on CPU
    num_threads: int | None = None         # torch intra-op threads on CPU
    # Weights as stored in memory: none (float32) | bf16 | int8 | int4 | w8a8 | w4a8 (CPU only)
    # | auto: the fastest format that keeps the file's weights as stored (w4a8 for a Q4_0/Q4_1
    # GGUF on CPU, none for float checkpoints and on CUDA; engine.loaders.quantized).
    quantization: str = "auto"
    # Ranks one model is split across (engine.parallel.tensor; MLC's tensor_parallel_shards).
    tensor_parallel_shards: int = 1

    def __post_init__(self) -> None:
        d = self.device
        _positive("tensor_parallel_shards", self.tensor_parallel_shards)
        if not (d in ("auto", "cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit())):
            raise ValueError(f"device: must be auto, cpu, cuda or cuda:N, got {d!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype: must be one of {_DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in _BACKENDS:
            raise ValueError(f"attention_backend: must be one of {_BACKENDS}, got {self.attention_backend!r}")
        if self.sampler_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"sampler_backend: must be auto, torch or triton, got {self.sampler_backend!r}")
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization not in ("none", "auto") and d.startswith("cuda"):
            raise ValueError(f"quantization: {self.quantization} runs on CPU only; use none (or auto) "
                             f"with device {d}")


@dataclass(frozen=True)
class LimitsConfig:
    """Caps on what one request may ask for, checked before the engine allocates or tokenizes
    anything for it (a request over a cap is INVALID_ARGUMENT naming the parameter). The HTTP
    facade checks the same caps with its own copy (``http_facade.limits``), so that it allocates
    no per-choice state either; gRPC clients meet these."""
    max_n: int = 128                       # choices per request (OpenAI's bound)
    max_stop_strings: int = 16             # stop strings per request
    max_stop_length: int = 256             # characters in one stop string
    max_logit_bias: int = 1024             # logit_bias entries
    max_logprobs: int = 20                 # top alternatives per sampled token
    max_prompt_bytes: int = 1 << 20        # UTF-8 bytes of a text prompt, or of a chat's messages
    max_chat_messages: int = 4096          # messages in one chat
    max_tools_bytes: int = 256 << 10       # JSON of a chat's tool definitions and tool calls

    def __post_init__(self) -> None:
        for f in fields(self):
            _positive(f.name, getattr(self, f.name))


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2"                 # a .gguf path, a Hugging Face folder or a short name
    max_model_len: int | None = None       # context window; None: the model's own
    # MLC's sliding_window_size: the window of the model's sliding layers (None: the model's own;
    # -1: off, every layer attends over the whole context).
    sliding_window_size: int | None = None
    # The options (WINDOW_FIT) whose values are a --mode's defaults, not the user's, and which the
    # engine may lower for a model whose every layer slides (core_builder._fit_to_window):
    # max_total_tokens, and with it max_num_batched_tokens. Empty: every value stands as given.
    window_fit: frozenset[str] = frozenset()
    # MLC's attention_sink_size (StreamingLLM): with sliding_window_size W, each sequence's KV
    # cache keeps its first S tokens (the sinks) and its most recent ones, at most W in all, and
    # positions are positions in that cache (engine.kv_cache.block_manager). 0: off.
    attention_sink_size: int = 0
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    structured: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: must name a .gguf file, a Hugging Face folder or a known short name")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.sliding_window_size is not None and self.sliding_window_size != -1:
            _positive("sliding_window_size", self.sliding_window_size)
        if not set(self.window_fit) <= set(WINDOW_FIT):
            raise ValueError(f"window_fit: may name only {', '.join(WINDOW_FIT)}, got {sorted(self.window_fit)}")
        if self.attention_sink_size:
            self._check_sinks()

    def _check_sinks(self) -> None:
        """What attention sinks combine with; what they do not is refused by name."""
        sinks, window, bs = self.attention_sink_size, self.sliding_window_size, self.cache.block_size
        _positive("attention_sink_size", sinks)
        if window is None or window == -1:
            raise ValueError("attention_sink_size: attention sinks need a sliding window (sliding_window_size), "
                             "the KV cache's size per sequence, sinks included")
        if sinks % bs:
            raise ValueError(f"attention_sink_size: {sinks} sinks are not a whole number of KV blocks of "
                             f"{bs} tokens (block_size); the cache evicts whole blocks after the sinks")
        if -(-window // bs) < sinks // bs + 2:
            raise ValueError(f"attention_sink_size: a sliding window of {window} tokens must hold the {sinks} "
                             f"sinks and two KV blocks of {bs} tokens after them")
        if self.speculative.enabled or self.scheduler.num_speculative_tokens:
            raise ValueError("attention_sink_size: speculative decoding with attention sinks is not supported")
        if self.device.tensor_parallel_shards > 1:
            raise ValueError("attention_sink_size: tensor parallelism with attention sinks is not supported")
