"""Pick the attention backend: "auto" is triton on CUDA and torch elsewhere; any name can be forced.

A forced backend that cannot run on the device raises ValueError saying why, at engine start
rather than at the first forward.
"""
from __future__ import annotations

import torch

from engine.devices import triton_unavailable_reason
from engine.attention.base import AttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton", "flash_attn")


def _triton_unavailable_reason(device: torch.device) -> str | None:
    return triton_unavailable_reason("attention_backend=triton", device)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend: must be one of {BACKEND_NAMES}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_unavailable_reason(device) is None else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "flash_attn" and device.type != "cuda":
        raise ValueError(f"attention_backend=flash_attn needs a CUDA device, got {device}")
    reason = _triton_unavailable_reason(device)
    if reason is not None:
        raise ValueError(reason if name == "triton" else f"{reason} (flash_attn decodes with Triton)")
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from engine.attention.flash_attn_backend import FlashAttnBackend

    return FlashAttnBackend(device)
