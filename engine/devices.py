"""Device questions asked in more than one place: which device "auto" means, and whether the
Triton kernels can run on a given device (CUDA, or any device under the Triton interpreter)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import re

import torch

from sluice.engine import envs


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {name} was asked for but CUDA is not available")
    return torch.device(name)


# The oldest Triton the kernels are verified to compile with (tests/kernels/cuda_lowering.py was
# run against 3.4, 3.6 and 3.9); keep equal to the bound in pyproject.toml's triton extras.
MIN_TRITON = (3, 4)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:2])


def _triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:   # e.g. shipped as "pytorch-triton"
        import triton

        return triton.__version__


def triton_unavailable_reason(option: str, device: torch.device) -> str | None:
    """None when Triton kernels can run on ``device``; else why not, naming ``option`` (e.g.
    "attention_backend=triton") so the error says which setting asked for them."""
    if importlib.util.find_spec("triton") is None:
        return f"{option} needs the triton package (pip install 'sluice-llm[triton]')"
    version = _triton_version()
    if _version_tuple(version) < MIN_TRITON:
        floor = ".".join(map(str, MIN_TRITON))
        return f"{option} needs triton>={floor}, found triton {version} (pip install -U 'sluice-llm[triton]')"
    if device.type == "cuda" or envs.triton_interpret():
        return None
    return f"{option} needs a CUDA device or TRITON_INTERPRET=1, got device {device}"
