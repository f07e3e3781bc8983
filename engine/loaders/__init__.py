"""``load_model``: a ``.gguf`` file, a Hugging Face folder or a short name → model + tokenizer.

Every failure a user can cause (missing path, corrupt or truncated file, unsupported
architecture, a missing or misshapen tensor) raises ``ModelLoadError`` naming the path and why.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.engine import envs
from sluice.engine.errors import ModelLoadError
from sluice.engine.heap import drop_weight_arena, huge_page_allocations, release_freed_heap, weight_arena
from sluice.engine.models.config import ARCHITECTURES, ModelArchConfig
from sluice.engine.models.gemma import GemmaForCausalLM
from sluice.engine.models.llama import LlamaForCausalLM
from sluice.engine.models.registry import resolve_path
from sluice.engine.tokenizer import Tokenizer

ProgressFn = Callable[[int, int], None]   # (steps done, steps total)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArchConfig
    tokenizer: Tokenizer
    name: str                 # what the caller asked for (short name or path)
    path: Path                # the file or folder actually read
    dtype: torch.dtype
    device: torch.device
    quantization: str = "none"   # the weight format in use (models.quant); never "auto"


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto": float32 on CPU (no fast bf16 matmul there), bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: must be auto or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's element type: "auto" is the model's dtype. float16 under a float32 model is
    a CPU feature (the torch attention backend and the C++ layers read it); the CUDA kernels read
    a cache of the model's own dtype only."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in ("float32", "float16"):
        raise ValueError(f"kv_cache_dtype: must be auto, float32 or float16, got {kv_cache_dtype!r}")
    want = _DTYPES[kv_cache_dtype]
    if device.type == "cuda" and want != model_dtype:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype} under a {str(model_dtype).removeprefix('torch.')} "
                         "model runs on CPU only; on CUDA the cache holds the model's dtype (auto)")
    if want == torch.float32 and model_dtype != torch.float32:
        raise ValueError(f"kv_cache_dtype: float32 needs a float32 model, got {str(model_dtype).removeprefix('torch.')}")
    return want


def _progress_fn(progress) -> ProgressFn | None:
    """Accept a callback ``(done, total)`` or a tqdm-like bar (``total`` + ``update``)."""
    if progress is None or not hasattr(progress, "update"):
        return progress

    def advance(done: int, total: int) -> None:
        if progress.total != total:
            progress.total = total
            progress.refresh()
        progress.update(done - progress.n)

    return advance


def build_model(
    arch: ModelArchConfig, weights, dtype: torch.dtype, device: torch.device, max_seq_len: int | None = None,
    quantization: str = "none",
) -> LlamaForCausalLM:
    """Allocate uninitialised parameters (no random init), copy the HF-named weights in, eval mode.

    ``quantization`` is a concrete format (``resolve_quantization`` decides ``auto``): ``none``
    packs float32 for oneDNN; the others build ``models.quant`` weights instead."""
    from sluice.engine.loaders.quantized import Quantizer

    model_class = GemmaForCausalLM if ARCHITECTURES[arch.architecture].gemma else LlamaForCausalLM
    model = model_class(arch, max_seq_len, dtype=dtype, device=device)
    with weight_arena():   # the weights built here onto pages faulted in ahead (heap.prefault_weights)
        model.load_hf_weights(weights, quantizer=None if quantization == "none" else Quantizer(quantization))
    model = model.eval().requires_grad_(False)
    if quantization == "none" and envs.cpu_packed_weights():
        model.pack_for_cpu()
    return model


def load_model(
    path_or_name: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    progress=None,
    max_seq_len: int | None = None,
    quantization: str = "none",
    transform=None,
) -> LoadedModel:
    """``quantization``: none | bf16 | int8 | int4 | auto (``loaders.quantized`` says what auto picks).
    ``transform``: (arch, weights) -> (arch, weights) applied before the model is built (a
    tensor-parallel rank's slice: ``engine.parallel.tensor.sharder``)."""
    try:
        return _load(path_or_name, dtype, device, progress, max_seq_len, quantization, transform)
    finally:
        drop_weight_arena()   # memory heap.prefault_weights mapped for a load that did not take it


def _load(path_or_name, dtype, device, progress, max_seq_len, quantization, transform) -> LoadedModel:
    from sluice.engine.loaders.quantized import check_quantization, resolve_quantization

    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    check_quantization(quantization, device, dtype)
    path = resolve_path(path_or_name)
    report = _progress_fn(progress)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: a model file must be a .gguf (or give a Hugging Face folder)")
        from sluice.engine.loaders.gguf_loader import drop_vocabulary, load_gguf

        arch, weights, reader = load_gguf(path, report)
        tokenizer = Tokenizer.from_gguf(reader, path)
        drop_vocabulary(reader)
    else:
        from sluice.engine.loaders.hf_loader import load_hf_folder

        arch, weights = load_hf_folder(path, report)
        tokenizer = Tokenizer.from_folder(path)
    if transform is not None:
        arch, weights = transform(arch, weights)
    fmt = resolve_quantization(quantization, weights, device)
    if fmt == "none" or device.type != "cpu":
        drop_weight_arena()   # no block weights to take it: let it go before the float weights are built
    # CPU weights are written onto huge pages as they are built (heap.huge_page_allocations).
    pages = huge_page_allocations() if device.type == "cpu" else contextlib.nullcontext()
    try:
        with pages:
            model = build_model(arch, weights, dtype, device, max_seq_len, quantization=fmt)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    del weights
    release_freed_heap(collect=True)   # the load's float32 staging and file buffers
    return LoadedModel(model=model, arch=arch, tokenizer=tokenizer, name=str(path_or_name),
                       path=path, dtype=dtype, device=device, quantization=fmt)


__all__ = ["LoadedModel", "ModelLoadError", "build_model", "load_model", "resolve_dtype", "resolve_path"]
