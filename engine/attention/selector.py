"""Pick the attention backend; any name can be forced.

"auto" is torch on CPU. On CUDA it is triton, or flash_attn when the flash-attn package is
installed and imports (fresh prefills then run on flash-attn, everything else on Triton); an
installed flash-attn that fails to import is logged and auto serves with Triton.
A forced backend that cannot run on the device raises ValueError saying why, at engine start
rather than at the first forward.
"""
from __future__ import annotations

import importlib.util
import logging

import torch

from sluice.engine.devices import triton_unavailable_reason
from sluice.engine.attention.base import AttentionBackend
from sluice.engine.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "triton", "flash_attn")


def _triton_unavailable_reason(device: torch.device) -> str | None:
    return triton_unavailable_reason("attention_backend=triton", device)


def _auto_cuda_backend(device: torch.device) -> AttentionBackend:
    from sluice.engine.attention.triton_backend import TritonAttentionBackend

    if importlib.util.find_spec("flash_attn") is not None:
        from sluice.engine.attention.flash_attn_backend import FlashAttnBackend

        try:
            return FlashAttnBackend(device)
        except ValueError as exc:
            logger.warning("attention_backend=auto: flash-attn is installed but cannot be used (%s); "
                           "prefill runs on the Triton kernels", exc)
    return TritonAttentionBackend()


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend: must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        if device.type == "cuda" and _triton_unavailable_reason(device) is None:
            return _auto_cuda_backend(device)
        return TorchAttentionBackend()
    if name == "torch":
        return TorchAttentionBackend()
    if name == "flash_attn" and device.type != "cuda":
        raise ValueError(f"attention_backend=flash_attn needs a CUDA device, got {device}")
    reason = _triton_unavailable_reason(device)
    if reason is not None:
        raise ValueError(reason if name == "triton" else f"{reason} (flash_attn decodes with Triton)")
    if name == "triton":
        from sluice.engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from sluice.engine.attention.flash_attn_backend import FlashAttnBackend

    return FlashAttnBackend(device)


def backend_for_models(attn: AttentionBackend, name: str, softcapped: list[str]) -> AttentionBackend:
    """``attn`` (chosen by ``get_attention_backend(name, ...)``) checked against the models it
    serves: ``softcapped`` names those whose attention is soft-capped (Gemma 2). A backend that
    cannot apply the cap is replaced by torch's under ``auto`` and refused when forced."""
    if not softcapped or attn.supports_softcap:
        return attn
    if name == "auto":
        logger.info("attention_backend=auto: %s soft-caps its attention scores, which the %s backend cannot; "
                    "serving with the torch backend", softcapped[0], attn.name)
        return TorchAttentionBackend()
    raise ValueError(f"attention_backend={name}: {softcapped[0]} soft-caps its attention scores "
                     f"(attn_logit_softcapping), which the {attn.name} backend cannot apply; use torch or auto")
