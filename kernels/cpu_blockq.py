"""Block-quantized CPU linear layers (``cpu_blockq.cpp``): weights as GGUF stores them, int8 dot products.

The weight of a projection is held as unsigned integers ``u`` (4 or 8 bits) in blocks of 32 along
the input with a float16 scale ``d`` and offset ``m`` per row and block, ``w = d u + m`` (GGUF's
own precision for them; the float32 product of a float16 and an up-to-8-bit integer is exact); the
input is quantized to int8 per row and block of 32 (``x ~ s a``, ``s = max|x| / 127``) and each
block's integer dot product is exact (AVX512-VNNI, AVX2, or the same arithmetic in portable C++:
bit for bit the same results on all three). This is the arithmetic of llama.cpp's CPU kernels
for these files, with a layout of our own.

The C++ source is built with the other CPU ops on first use (``cpu_ext``); ``available()`` says
whether that worked and ``unavailable_reason()`` why not. Nothing here falls back silently:
``quantization=w4a8`` / ``w8a8`` fail with that reason, and ``auto`` picks another format.
"""
from __future__ import annotations

import torch

from sluice.kernels import cpu_ext

BLOCK = 32
TILE = 16
available = cpu_ext.available
unavailable_reason = cpu_ext.unavailable_reason


def isa() -> str | None:
    """The integer dot-product path compiled for this CPU: ``avx512vnni``, ``avx2`` or
    ``portable`` (plain C++, correct but slow); None when the kernels are not available."""
    return str(cpu_ext.module().blockq_isa()) if cpu_ext.available() else None


def vectorized() -> bool:
    """Whether the block kernels run a vector path here (AVX2 or AVX512-VNNI): only then are they
    faster than float32, so only then does anything choose them by itself."""
    return isa() not in (None, "portable")


# ---- packing ------------------------------------------------------------------------------------
def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[0] % TILE
    return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t


def pack_weights(u: torch.Tensor, bits: int) -> torch.Tensor:
    """u [N, K] integers in 0..2^bits - 1 -> the kernel's layout (flat uint8)."""
    if bits not in (4, 8):
        raise ValueError(f"blockq: bits must be 4 or 8, got {bits}")
    n, k = u.shape
    if k % BLOCK:
        raise ValueError(f"blockq: K must be a multiple of {BLOCK}, got {k}")
    q = _pad_rows(u.to(torch.uint8))
    tiles, nb = q.shape[0] // TILE, k // BLOCK
    if bits == 8:
        # [t, r, b, g, j] -> [t, b, g, r, j]
        return q.view(tiles, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4).contiguous().view(-1)
    if int(u.max()) > 15:
        raise ValueError("blockq: 4-bit values must lie in 0..15")
    v = q.view(tiles, TILE, nb, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)          # [t, b, p, h, r, j]
    return (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).contiguous().view(-1)


def pack_scales(x: torch.Tensor) -> torch.Tensor:
    """d or m [N, K/32], float16 values (ValueError otherwise: nothing is rounded here) ->
    [tiles, K/32, 16] float16 (padded rows are 0)."""
    h = x.to(torch.float16)
    if not torch.equal(h.to(x.dtype), x):
        raise ValueError("blockq: block scales and offsets must be float16 values (GGUF's precision); "
                         "round them first (models.quant.float_to_block does)")
    p = _pad_rows(h)
    return p.view(p.shape[0] // TILE, TILE, p.shape[1]).transpose(1, 2).contiguous()


# GGML type ids of the GGUF block types ``pack_gguf`` reads.
GGML_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def pack_gguf(parts: list[tuple[str, torch.Tensor]], bits: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_0 / Q4_1 / Q8_0 tensors [rows, K / 32 * block bytes] uint8, stacked by rows (a fused
    projection's parts may differ in type) -> (packed, d, m), in one C++ pass over the file's
    bytes: ``pack_weights`` / ``pack_scales`` of ``models.quant.block_parts``' (u, d, m), bit for bit.
    ValueError where an offset (-8 d, -128 d) leaves float16's range, as ``pack_scales``."""
    for kind, _ in parts:
        if kind not in GGML_TYPES:
            raise ValueError(f"blockq: {kind} is not one of {sorted(GGML_TYPES)}")
    try:
        packed, d, m = cpu_ext.module().blockq_pack_gguf([b.contiguous() for _, b in parts],
                                                         [GGML_TYPES[kind] for kind, _ in parts], bits, k)
    except RuntimeError as exc:
        if "float16 values" in str(exc):
            raise ValueError(str(exc).splitlines()[0]) from None
        raise
    return packed, d, m


def unpack_weights(packed: torch.Tensor, bits: int, n: int, k: int) -> torch.Tensor:
    """Inverse of ``pack_weights``: [N, K] uint8."""
    tiles, nb = -(-n // TILE), k // BLOCK
    if bits == 8:
        u = packed.view(tiles, nb, 8, TILE, 4).permute(0, 3, 1, 2, 4)
    else:
        v = packed.view(tiles, nb, 4, TILE, 4)
        u = torch.stack((v & 15, v >> 4), dim=3).permute(0, 4, 1, 2, 3, 5)   # [t, r, b, p, h, j]
    return u.reshape(tiles * TILE, k)[:n]


def unpack_scales(x: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``pack_scales``: [N, K/32] float32."""
    return x.transpose(1, 2).reshape(-1, x.shape[1])[:n].float()


def kernel():
    """The compiled ``linear(x, packed, d, m, bits, n)`` itself (no Python wrapper), for hot loops."""
    return cpu_ext.module().blockq_linear


def rows_kernel():
    """The compiled ``rows(ids [T] int64, packed, d, m, bits, n, k) -> [T, k] float32``: weight
    rows dequantized (a tied model's embedding lookups from its LM head)."""
    return cpu_ext.module().blockq_rows


def linear(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int,
           n: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) -> [M, n] float32."""
    return cpu_ext.module().blockq_linear(x, packed, d, m, bits, n)


# ---- the reference ------------------------------------------------------------------------------
def quantize_input(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (a [M, K] int values as float, s [M, K/block]) with the kernel's rounding
    (per 32; cpu_kquant's formats with sub-block scales round the same way per 256)."""
    rows, k = x.shape
    xb = x.to(torch.float32).view(rows, k // block, block)
    amax = xb.abs().amax(-1)
    # torch.div, not ``127.0 / amax``: torch computes a scalar over a tensor as a reciprocal times
    # the scalar, which rounds differently from the kernel's true division.
    inv = torch.where(amax > 0, torch.div(torch.full_like(amax, 127.0), amax), torch.zeros_like(amax))
    a = torch.round(xb * inv[..., None]).clamp_(-127, 127)
    return a.view(rows, k), amax / 127.0


def linear_ref(x: torch.Tensor, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The kernel's product in float64: sum over blocks of d s (u . a) + m s (sum a)."""
    a, s = quantize_input(x)
    rows, k = a.shape
    nb = k // BLOCK
    ab = a.double().view(rows, nb, BLOCK)
    ub = u.double().view(u.shape[0], nb, BLOCK)
    dots = torch.einsum("mbi,nbi->mnb", ab, ub)                                   # [M, N, nb]
    sums = ab.sum(-1)                                                             # [M, nb]
    sd = s.double()
    out = (dots * d.double()[None] * sd[:, None]).sum(-1) + ((m.double()[None] * (sd * sums)[:, None]).sum(-1))
    return out.float()
