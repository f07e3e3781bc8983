"""Constructing an engine core: device and dtype, the model(s), the KV pool, the scheduler, the
runner(s), the speculative decoder, warm-up, and what the core reports about itself.

``build_core`` runs once; the core (``engine_core.EngineCore``) then only steps. Keeping the
construction here is what lets the core read as schedule → execute → update → emit.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch

from sluice.engine import envs
from sluice.engine.attention.selector import backend_for_models, get_attention_backend
from sluice.engine.config import EngineConfig
from sluice.engine.devices import resolve_device
from sluice.engine.kv_cache import KVCacheManager, num_blocks_for_budget
from sluice.engine.loaders import LoadedModel, load_model, resolve_dtype, resolve_kv_dtype
from sluice.engine.model_runner import ModelRunner
from sluice.engine.parallel.tensor import start_tensor_parallel
from sluice.engine.scheduler import Scheduler
from sluice.engine.spec_decode.factory import (build_spec_decoder, load_draft, load_heads, resolve_tree_width,
                                               shared_num_blocks)
from sluice.engine.structured.manager import StructuredOutputManager

log = logging.getLogger("sluice.engine")


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    architecture: str
    max_model_len: int
    vocab_size: int
    dtype: str
    device: str
    attention_backend: str
    block_size: int
    num_kv_blocks: int
    capabilities: frozenset[str]
    speculative_mode: str = "disable"
    spec_draft_length: int = 0             # K; 0 when speculation is off


@dataclass
class CoreParts:
    """What the core steps with; built once by ``build_core``."""
    loaded: LoadedModel
    draft: LoadedModel | None              # small_draft's model
    heads: object | None                   # EAGLE / Medusa heads
    tp: object | None                      # tensor-parallel ranks
    max_model_len: int
    kv_dtype: torch.dtype
    kv: KVCacheManager
    scheduler: Scheduler
    structured: StructuredOutputManager
    runner: ModelRunner
    spec: object | None                    # SpecDecoder; None: speculation off
    model_info: ModelInfo


def _softcapped(*models) -> list[str]:
    """The models (their names) whose attention is soft-capped (Gemma 2)."""
    return [m.name for m in models if m is not None and m.arch.gemma is not None and m.arch.gemma.attn_softcap]


def build_core(config: EngineConfig, progress: bool = False, loaded: LoadedModel | None = None,
               draft_loaded: LoadedModel | None = None, heads=None) -> CoreParts:
    if config.scheduler.num_speculative_tokens and not config.speculative.enabled:
        raise ValueError("num_speculative_tokens: drafts need a proposer; set speculative_mode "
                         "(and spec_draft_length) instead")
    device = resolve_device(config.device.device)
    dtype = resolve_dtype(config.device.dtype, device)
    threads = config.device.num_threads or envs.num_threads()
    if device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    attn = get_attention_backend(config.device.attention_backend, device)
    quantization = config.device.quantization
    if loaded is not None and quantization not in ("auto", loaded.quantization):
        raise ValueError(f"quantization: the model given was loaded as {loaded.quantization}, "
                         f"the config asks for {quantization}")

    sinks = config.attention_sink_size
    # With attention sinks the window is the KV cache's size, not the model's: every layer attends
    # over the whole (compacted) cache, so the model is built without windows.
    window = None if sinks else config.sliding_window_size
    transform = None if window is None else (lambda arch, weights: (arch.with_sliding_window(window), weights))
    if sinks:
        transform = _without_windows
    if window is not None and (loaded is not None or config.device.tensor_parallel_shards > 1):
        raise ValueError("sliding_window_size: the engine must load the model itself on one rank to apply it")
    if sinks and loaded is not None and loaded.arch.sliding_window is not None:
        raise ValueError("attention_sink_size: the engine must load a sliding-window model itself to apply it")

    def load(name: str) -> LoadedModel:
        return _load(name, dtype, device, progress, quantization, max_seq_len=config.max_model_len)

    tp = None
    if config.device.tensor_parallel_shards > 1:
        if loaded is not None:
            raise ValueError("tensor_parallel_shards: the engine loads its own shards; give a model name")
        tp, loaded = start_tensor_parallel(config, dtype, device, quantization, progress)
    loaded = loaded or _load(config.model, dtype, device, progress, quantization, transform, config.max_model_len)
    draft = load_draft(config.speculative, loaded, load, draft_loaded)
    attn = backend_for_models(attn, config.device.attention_backend, _softcapped(loaded, draft))
    heads = load_heads(config.speculative, loaded, dtype, device, heads)   # eagle / medusa
    arch = loaded.arch
    max_model_len = _max_model_len(config, arch)
    config = _fit_to_window(config, _kv_window(arch, draft), max_model_len)
    block_size = config.cache.block_size
    kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype, device)
    # A byte budget is split between the two models' KV; a capacity in tokens holds for both.
    shared = draft if config.cache.max_total_tokens is None else None
    num_blocks = shared_num_blocks(_num_blocks(config, arch, kv_dtype, device), arch, shared,
                                   torch.tensor([], dtype=kv_dtype).element_size(), block_size)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=config.cache.enable_prefix_caching,
                        sliding_window=_kv_window(arch, draft), sinks=sinks,
                        cache_window=config.sliding_window_size if sinks else None)
    speculative = resolve_tree_width(config.speculative, loaded.model, attn)   # draft trees or chains
    sched_config = replace(config.scheduler, num_speculative_tokens=speculative.num_speculative_tokens)
    _check_drafts_fit_the_window(arch, speculative.spec_draft_length if speculative.enabled else 0)
    scheduler = Scheduler(sched_config, kv, block_size, max_model_len)
    structured = StructuredOutputManager(loaded.tokenizer, arch.vocab_size, config.structured)
    runner = ModelRunner(
        loaded.model, num_layers=arch.num_hidden_layers, num_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim, num_blocks=num_blocks, block_size=block_size, vocab_size=arch.vocab_size,
        device=device, dtype=kv_dtype, attn=attn, sampler_backend=config.device.sampler_backend,
        seed=config.seed, grammar=structured, attention_sinks=sinks,
    )
    draft_runner = None if draft is None else ModelRunner(
        draft.model, num_layers=draft.arch.num_hidden_layers,
        num_kv_heads=draft.arch.num_key_value_heads, head_dim=draft.arch.head_dim,
        num_blocks=num_blocks, block_size=block_size, vocab_size=arch.vocab_size, device=device,
        dtype=kv_dtype, attn=attn, sampler_backend="torch", seed=config.seed)
    spec = build_spec_decoder(speculative, runner, kv, draft_runner, heads, config.seed)   # None: off
    # Every step size's projection primitives compiled now (a few hundred ms on CPU float32),
    # not one by one under load, where each new one costs a stall and resident memory.
    sched = config.scheduler
    logit_rows = min(sched.max_num_batched_tokens, sched.max_num_seqs * (1 + sched_config.num_speculative_tokens))
    for model in (loaded.model, None if draft is None else draft.model):
        if hasattr(model, "warm_up"):
            model.warm_up(sched.max_num_batched_tokens, logit_rows)
    if tp is not None:
        tp.init_kv(num_blocks, block_size, kv_dtype, (sched.max_num_batched_tokens, logit_rows))
    _release_free_heap()
    tokenizer = loaded.tokenizer
    caps = {"generate", "chat"} if getattr(tokenizer, "chat_template", None) else {"generate"}
    caps.add("structured_output")
    if getattr(tokenizer, "fim_tokens", None):
        caps.add("infilling")
    model_info = ModelInfo(
        name=loaded.name, path=str(loaded.path), architecture=arch.architecture,
        max_model_len=max_model_len, vocab_size=arch.vocab_size, dtype=str(dtype).removeprefix("torch."),
        device=str(device), attention_backend=attn.name, block_size=block_size, num_kv_blocks=num_blocks,
        capabilities=frozenset(caps), speculative_mode=config.speculative.speculative_mode,
        spec_draft_length=config.speculative.spec_draft_length if spec is not None else 0,
    )
    return CoreParts(loaded=loaded, draft=draft, heads=heads, tp=tp, max_model_len=max_model_len,
                     kv_dtype=kv_dtype, kv=kv, scheduler=scheduler, structured=structured, runner=runner,
                     spec=spec, model_info=model_info)


def _load(model: str, dtype: torch.dtype, device: torch.device, progress: bool,
          quantization: str = "none", transform=None, max_seq_len: int | None = None) -> LoadedModel:
    """``max_seq_len``: the context the engine serves (``max_model_len``; None: the model's own),
    which a rope whose frequencies depend on it reads: LongRoPE takes its short factors when the
    context fits the original one (exactly transformers' for every sequence then), its long
    factors otherwise; dynamic NTK never goes below the model's own context."""
    if not progress:
        return load_model(model, dtype=dtype, device=device, quantization=quantization, transform=transform,
                          max_seq_len=max_seq_len)
    from tqdm import tqdm

    with tqdm(desc=f"loading {model}", unit="tensor", leave=False) as bar:
        return load_model(model, dtype=dtype, device=device, progress=bar, quantization=quantization,
                          transform=transform, max_seq_len=max_seq_len)


def _max_model_len(config: EngineConfig, arch) -> int:
    own = arch.max_position_embeddings
    asked = config.max_model_len
    if asked is not None and asked > own:
        raise ValueError(f"max_model_len: {asked} exceeds the model's context window ({own})")
    return asked or own


def _check_drafts_fit_the_window(arch, num_drafts: int) -> None:
    """A draft row attends to its ancestors wherever the window starts (the kernels exempt a
    tree's nodes from it), which is right only while a chain or a tree's depth (at most
    ``num_drafts``) is shorter than every window."""
    windows = [w for w in map(arch.layer_window, range(arch.num_hidden_layers)) if w is not None]
    if windows and num_drafts >= min(windows):
        raise ValueError(f"spec_draft_length: {num_drafts} draft tokens must be fewer than the model's "
                         f"sliding window of {min(windows)} tokens")


def _without_windows(arch, weights):
    """Attention sinks' model: no layer windowed (the KV manager bounds the cache instead). A
    model that mixes global and sliding layers is refused: its global layers read whole texts."""
    if arch.sliding_window is not None and arch.kv_window is None:
        raise ValueError(f"attention_sink_size: a {arch.architecture} model that mixes global and "
                         "sliding-window layers is not supported")
    return arch.with_sliding_window(-1), weights


def _kv_window(arch, draft) -> int | None:
    """The window past which the KV manager frees blocks: None unless every layer of the target
    and of a draft model (which reads the same block tables) slides."""
    windows = [arch.kv_window] + ([] if draft is None else [draft.arch.kv_window])
    return None if None in windows else max(windows)


def windowed_blocks(num_tokens: int, chunk: int, window: int, block_size: int) -> int:
    """The most blocks a sequence of up to ``num_tokens`` tokens holds when every layer slides
    and it runs at most ``chunk`` tokens a step: ``KVCacheManager.max_blocks_for``'s rule, here
    without a manager, for sizing the pool before there is one."""
    return min(-(-num_tokens // block_size), -(-(window - 1 + chunk) // block_size) + 1)


def _fit_to_window(config: EngineConfig, window: int | None, max_model_len: int) -> EngineConfig:
    """``--mode local`` and ``interactive`` size the pool for a whole context (max_total_tokens:
    the context window). A model whose every layer slides (``window``, ``_kv_window``) holds at
    most ``windowed_blocks`` of each sequence, so where ``config.window_fit`` says the capacity is
    the mode's, the pool holds what ``max_num_seqs`` such sequences need when that is less. The
    mode's prefill chunk (the context window too) would let a sequence hold all of its blocks, so
    where it is the mode's as well, it drops to the window along with the pool (MLC chunks
    Mistral's prefill at its window likewise); where the pool would not shrink, both stay."""
    cache, sched = config.cache, config.scheduler
    if (window is None or "max_total_tokens" not in config.window_fit or cache.max_total_tokens is None
            or not sched.enable_chunked_prefill):     # unchunked, a prompt holds all its blocks at once
        return config
    chunk = sched.max_num_batched_tokens
    if "max_num_batched_tokens" in config.window_fit:
        chunk = min(chunk, window)
    tokens = sched.max_num_seqs * windowed_blocks(max_model_len, chunk, window, cache.block_size) * cache.block_size
    if tokens >= cache.max_total_tokens:
        return config
    log.info("KV pool fitted to the %d-token sliding window: %d tokens for %d sequences (not %d), "
             "prefill chunk %d", window, tokens, sched.max_num_seqs, cache.max_total_tokens, chunk)
    return replace(config, cache=replace(cache, max_total_tokens=tokens),
                   scheduler=replace(sched, max_num_batched_tokens=chunk))


def _num_blocks(config: EngineConfig, arch, dtype: torch.dtype, device: torch.device) -> int:
    cache = config.cache
    if cache.max_total_tokens is not None:
        return math.ceil(cache.max_total_tokens / cache.block_size)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        used = torch.cuda.memory_allocated(device)
        budget = int((free + used) * cache.gpu_memory_utilization) - used
    else:
        budget = cache.kv_cache_memory_bytes
    return num_blocks_for_budget(
        budget, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
        torch.tensor([], dtype=dtype).element_size(), cache.block_size,
    )


def _release_free_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``): the warm-up's large
    temporaries (~150 MB of activations for SmolLM2) are freed but would stay resident."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: nothing to do
        pass
