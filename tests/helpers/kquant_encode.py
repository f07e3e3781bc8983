"""A small encoder of float weights into GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) and IQ4_NL / IQ4_XS
ones, for tests and benchmarks that need such files without llama.cpp's ``llama-quantize``; the ``gguf`` package
encodes Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 itself (``encode`` passes those to it).

The block layouts are llama.cpp's (as ``gguf.quants`` decodes them); the rounding is a plain
min/max one (no search for the best scales like llama-quantize's), so a tensor's error is a
little above a real file's, which only makes the accuracy tests stricter.
"""
from __future__ import annotations

import numpy as np

K_TYPES = ("Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
IQ4_GRID = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


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


def _nearest_grid(x: np.ndarray) -> np.ndarray:
    """Indices of the IQ4 grid values nearest to x (in grid units)."""
    return np.abs(x[..., None] - IQ4_GRID).argmin(-1).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[..., 32] indices -> [..., 16] bytes: element i in the low nibble of byte i, 16 + i in its high one."""
    return (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)


def _iq4_nl(w: np.ndarray) -> np.ndarray:
    """IQ4_NL: w ~ d grid[q] per block of 32, d = the block's largest |w| / 127."""
    d = _f16(np.abs(w).max(-1) / 127)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = _nearest_grid(np.where(df > 0, w / df, 0))
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), _nibbles(q)], axis=1)


def _iq4_xs(w: np.ndarray) -> np.ndarray:
    """IQ4_XS: w ~ d (ls - 32) grid[q] per sub-block of 32 of a block of 256, ls 6-bit."""
    nb = w.shape[0]
    sub = w.reshape(nb, 8, 32)
    scale = np.abs(sub).max(-1) / 127                                               # [nb, 8] >= 0
    d = _f16(scale.max(-1) / 31)
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = (np.where(df > 0, np.rint(scale / df), 0).clip(-32, 31) + 32).astype(np.uint8)
        big_d = df * (ls.astype(np.float32) - 32)
        q = _nearest_grid(np.where(big_d[..., None] != 0, sub / big_d[..., None], 0))
    high = ((ls >> 4).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(-1).astype(np.uint16)
    low = (ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)
    return np.concatenate([d.view(np.uint8).reshape(nb, 2), high.view(np.uint8).reshape(nb, 2), low.astype(np.uint8),
                           _nibbles(q).reshape(nb, 128)], axis=1)


def encode(w: np.ndarray, kind: str) -> np.ndarray:
    """w [rows, K] float -> the GGUF blocks [rows, bytes per row] uint8 of type ``kind``."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if kind not in K_TYPES:
        import gguf

        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    rows, k = w.shape
    if kind == "IQ4_NL":
        if k % 32:
            raise ValueError(f"{kind}: rows of {k} are not whole blocks of 32")
        return _iq4_nl(w.reshape(-1, 32)).reshape(rows, -1)
    if k % 256:
        raise ValueError(f"{kind}: rows of {k} are not whole super-blocks of 256")
    flat = w.reshape(-1, 256)
    if kind == "IQ4_XS":
        return _iq4_xs(flat).reshape(rows, -1)
    blocks = _q6_k(flat) if kind == "Q6_K" else _affine_k(flat, 4 if kind == "Q4_K" else 5)
    return blocks.reshape(rows, -1)
