"""Shared by the kernels' launchers: argument checks (each raises ``ValueError`` naming the
argument) and the options every launch passes."""
from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)

# Every launch asks for FMA contraction explicitly, so that the kernels' numerics do not follow
# Triton's default, which 3.10 turns off (3.9 warns about it at each first compile).
FP_FUSION = {"enable_fp_fusion": True}


def check_tensor(
    name: str,
    t: object,
    ndim: int,
    dtypes: Sequence[torch.dtype],
    device: torch.device | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(_short(d) for d in dtypes)
        raise ValueError(f"{name}: dtype must be one of ({allowed}), got {_short(t.dtype)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: must be on {device}, got {t.device}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous (stride 1), got stride {t.stride(-1)}")


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(f"{name}: dtype {_short(t.dtype)} differs from {ref_name} dtype {_short(ref.dtype)}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
