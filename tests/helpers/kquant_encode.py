"""A small encoder of float weights into GGUF K-quant blocks (Q4_K, Q5_K, Q6_K), for tests and
benchmarks that need K-quant files without llama.cpp's ``llama-quantize``; the ``gguf`` package
encodes Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 itself (``encode`` passes those to it).

The block layouts are llama.cpp's (as ``gguf.quants`` decodes them); the rounding is a plain
min/max one (no search for the best scales like llama-quantize's), so a tensor's error is a
little above a real file's, which only makes the accuracy tests stricter.
"""
from __future__ import annotations

import numpy as np

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _affine_k(w: np.ndarray, bits: int) -> np.ndarray:
    """Q4_K / Q5_K: w ~ d sc q - dmin mn per sub-block of 32, sc and mn 6-bit."""
    nb = w.shape[0]
    sub = w.reshape(nb, 8, 32)
    offset = np.maximum(0.0, -sub.min(-1))                                          # [nb, 8] >= 0
    scale = (sub.max(-1) + offset) / (2 ** bits - 1)
    d, dmin = _f16(scale.max(-1) / 63), _f16(offset.max(-1) / 63)                   # [nb]
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(0, 63).astype(np.uint8)
        mn = np.where(dminf > 0, np.rint(offset / dminf), 0).clip(0, 63).astype(np.uint8)
        big_d, big_m = df * sc, dminf * mn
        q = np.where(big_d[..., None] > 0, np.rint((sub + big_m[..., None]) / big_d[..., None]), 0)
    q = q.clip(0, 2 ** bits - 1).astype(np.uint8).reshape(nb, 256)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    runs = q.reshape(nb, 4, 2, 32)
    qs = ((runs[:, :, 0] & 15) | ((runs[:, :, 1] & 15) << 4)).reshape(nb, 128)
    parts = [d.view(np.uint8).reshape(nb, 2), dmin.view(np.uint8).reshape(nb, 2), scales]
    if bits == 5:
        hi = ((q.reshape(nb, 8, 32) >> 4) & 1).astype(np.uint8)                     # [nb, j, i]
        parts.append((hi << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8))
    return np.concatenate(parts + [qs], axis=1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K: w ~ d sc (q - 32) per sub-block of 16, sc int8."""
    nb = w.shape[0]
    sub = w.reshape(nb, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _f16(scale.max(-1) / 127)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(scale / df), 0).clip(-128, 127).astype(np.int8)
        big_d = df * sc
        q = np.where(big_d[..., None] != 0, np.rint(sub / big_d[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(nb, 2, 128)
    ql = ((q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)).reshape(nb, 128)
    hi = ((q.reshape(nb, 2, 4, 32) >> 4) & 3).astype(np.uint8)
    qh = (hi << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(2).astype(np.uint8).reshape(nb, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(nb, 2)], axis=1)


def encode(w: np.ndarray, kind: str) -> np.ndarray:
    """w [rows, K] float -> the GGUF blocks [rows, bytes per row] uint8 of type ``kind``."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if kind not in K_TYPES:
        import gguf

        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    rows, k = w.shape
    if k % 256:
        raise ValueError(f"{kind}: rows of {k} are not whole super-blocks of 256")
    flat = w.reshape(-1, 256)
    blocks = _q6_k(flat) if kind == "Q6_K" else _affine_k(flat, 4 if kind == "Q4_K" else 5)
    return blocks.reshape(rows, -1)
