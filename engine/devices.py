"""Device questions asked in more than one place: which device "auto" means, and whether the
Triton kernels can run on a given device (CUDA, or any device under the Triton interpreter)."""
from __future__ import annotations

import importlib.util

import torch

from engine import envs


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {name} was asked for but CUDA is not available")
    return torch.device(name)


def triton_unavailable_reason(option: str, device: torch.device) -> str | None:
    """None when Triton kernels can run on ``device``; else why not, naming ``option`` (e.g.
    "attention_backend=triton") so the error says which setting asked for them."""
    if importlib.util.find_spec("triton") is None:
        return f"{option} needs the triton package (pip install 'sluice[triton]')"
    if device.type == "cuda" or envs.triton_interpret():
        return None
    return f"{option} needs a CUDA device or TRITON_INTERPRET=1, got device {device}"
