"""Weight formats chosen at start-up (``DeviceConfig.quantization``), for CPU decoding.

Decoding on a CPU streams every weight once per step, so bytes per weight set the speed. The
float32 path (``none``) keeps oneDNN-packed float32 (``llama.packed_linear``). The others keep
the weights smaller and multiply with torch's CPU kernels:

* ``bf16``: bfloat16 weights in oneDNN's packed layout; each projection's input is rounded to
  bfloat16 and its output widened back to float32.
* ``int8``: one int8 per weight with a float32 scale per output row (symmetric). Activations are
  quantized per row to int8 too (dynamic, symmetric, scale = row max / 127) and multiplied by
  ``torch._int_mm`` with int32 accumulation (VNNI), then rescaled. Integer sums are exact, so a
  row's result cannot depend on the other rows in the batch, and one kernel serves every row
  count: measured faster than the float32 path from 1 row to prefill sizes (bench/README.md).
* ``int4``: 4-bit weights in groups of 32 along the input with a bfloat16 scale and zero per
  group (asymmetric; the tinygemm convention ``w = (q - 8) * scale + zero``), multiplied by
  ``torch._weight_int4pack_mm_for_cpu`` with bfloat16 activations. GGUF Q4_0 / Q4_1 blocks map
  onto it directly (``int4_from_q4_0`` / ``int4_from_q4_1``). Fast at a few rows, 1.5-3x
  slower than float32 at prefill sizes; the same kernel runs at every row count, because its
  rows are computed independently (a row's bits do not change with M, measured) while switching
  to another kernel above some M would change them.

Each format is a small class with ``__call__(x [.., K] float32) -> [.., N] float32``,
``dequantize() -> [N, K] float32`` (the weight it multiplies by, for tests and inspection) and a
``*_ref`` reference in plain float arithmetic. Construction checks shapes and dtypes.
"""
from __future__ import annotations

import torch

QUANTIZATIONS = ("none", "bf16", "int8", "int4", "auto")
GROUP = 32                      # int4 group size along the input (= the GGUF block size)
_INT4_ROW_TILE = 64             # the CPU int4 layout interleaves rows in tiles of 64 (see _unpack_int4)
_TINY = torch.finfo(torch.float32).tiny


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


# ---- int8: per-channel int8 weights, per-row dynamic int8 activations --------------------------
def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (int8 [M, K], float32 scale [M]) with x ~ q * scale, symmetric per row."""
    scale = (x.abs().amax(dim=-1) / 127.0).clamp_min(_TINY)          # [M]; an all-zero row gets q = 0
    q = torch.round(x / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear:
    """``qweight`` [N, K] int8 and ``scale`` [N] float32: the weight is ``qweight * scale[:, None]``."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        _check(qweight.dtype == torch.int8 and qweight.dim() == 2, f"int8 weight: expected a 2-D int8 tensor, "
               f"got {qweight.dtype} {tuple(qweight.shape)}")
        _check(tuple(scale.shape) == (qweight.shape[0],), f"int8 weight: scale shape {tuple(scale.shape)}, "
               f"expected ({qweight.shape[0]},)")
        self.qweight = qweight.contiguous()
        self.scale = scale.to(torch.float32).contiguous()
        self.out_features, self.in_features = qweight.shape

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Int8Linear":
        """Symmetric per-output-row int8 (scale = row max / 127)."""
        q, scale = quantize_rows_int8(weight.to(torch.float32))
        return cls(q, scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _check(x.shape[-1] == self.in_features, f"int8 linear: input has {x.shape[-1]} features, "
               f"expected {self.in_features}")
        flat = _rows(x.to(torch.float32))                                 # [M, K]
        xq, xscale = quantize_rows_int8(flat)
        acc = torch._int_mm(xq, self.qweight.t())                        # [M, N] int32, exact
        out = acc.to(torch.float32).mul_(xscale[:, None]).mul_(self.scale)
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.to(torch.float32) * self.scale[:, None]

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scale.nbytes


def int8_linear_ref(x: torch.Tensor, weight: Int8Linear) -> torch.Tensor:
    """What ``Int8Linear`` computes, in float64: both operands rounded to int8 per row, then rescaled."""
    xq, xscale = quantize_rows_int8(_rows(x.to(torch.float32)))
    acc = xq.double() @ weight.qweight.double().t()
    out = acc * xscale.double()[:, None] * weight.scale.double()
    return out.float().reshape(*x.shape[:-1], weight.out_features)


# ---- int4: group-32 asymmetric weights for torch's CPU tinygemm kernel ---------------------------
def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] uint8 in 0..15 (N a multiple of 64) -> torch's CPU int4 layout [N, K/2] uint8."""
    return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_pack_int4``. Byte ``(t, k, i)`` of the layout viewed as [N/64, K, 32] holds
    row ``64t + i`` of column k in its low nibble and row ``64t + 32 + i`` in its high nibble
    (read off the kernel; tests/unit/test_quant_kernels.py checks it round-trips)."""
    n, half_k = packed.shape
    tiles = packed.view(n // _INT4_ROW_TILE, 2 * half_k, _INT4_ROW_TILE // 2)       # [N/64, K, 32]
    lo, hi = tiles & 15, tiles >> 4
    both = torch.cat((lo, hi), dim=2)                                                  # [N/64, K, 64]
    return both.transpose(1, 2).reshape(n, 2 * half_k)


class Int4Linear:
    """``q`` [N, K] in 0..15 with ``scales`` and ``zeros`` [N, K/32]: w = (q - 8) * scale + zero.

    Scales and zeros are stored in bfloat16 (the kernel's dtype for bfloat16 activations; its
    float16 variant measured 20-40x slower here). Rows are zero-padded to a multiple of 64.
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        _check(q.dim() == 2 and q.shape[1] % GROUP == 0, f"int4 weight: expected [N, K] with K a multiple of "
               f"{GROUP}, got {tuple(q.shape)}")
        n, k = q.shape
        groups = (n, k // GROUP)
        _check(tuple(scales.shape) == groups and tuple(zeros.shape) == groups,
               f"int4 weight: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)}, expected {groups}")
        _check(int(q.min()) >= 0 and int(q.max()) <= 15, "int4 weight: values must lie in 0..15")
        pad = -n % _INT4_ROW_TILE
        self.out_features, self.in_features = n, k
        self.packed = _pack_int4(torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad)))     # [Np, K/2]
        sz = torch.stack((scales.t(), zeros.t()), dim=-1).to(torch.bfloat16)                  # [K/32, N, 2]
        self.scales_and_zeros = torch.nn.functional.pad(sz, (0, 0, 0, pad)).contiguous()      # [K/32, Np, 2]

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Int4Linear":
        """Min/max per group of 32: q = round((w - min) / s) with s = (max - min) / 15, so that
        w ~ q * s + min = (q - 8) * s + (min + 8 s)."""
        n, k = weight.shape
        g = weight.to(torch.float32).reshape(n, k // GROUP, GROUP)
        lo, hi = g.amin(-1), g.amax(-1)                                                     # [N, G]
        scale = ((hi - lo) / 15).clamp_min(_TINY)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
        return cls(q.reshape(n, k), scale, lo + 8 * scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _check(x.shape[-1] == self.in_features, f"int4 linear: input has {x.shape[-1]} features, "
               f"expected {self.in_features}")
        flat = _rows(x).to(torch.bfloat16)                                              # [M, K]
        out = torch._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_and_zeros)
        return out[:, :self.out_features].float().reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        n, k = self.out_features, self.in_features
        q = _unpack_int4(self.packed)[:n].to(torch.float32).reshape(n, k // GROUP, GROUP)
        sz = self.scales_and_zeros[:, :n].to(torch.float32)                             # [G, N, 2]
        scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]
        return ((q - 8) * scale + zero).reshape(n, k)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes


def int4_linear_ref(x: torch.Tensor, weight: Int4Linear) -> torch.Tensor:
    """x rounded to bfloat16, times the dequantized weight in float64, rounded to bfloat16."""
    xb = _rows(x).to(torch.bfloat16).double()
    out = (xb @ weight.dequantize().double().t()).to(torch.bfloat16).float()
    return out.reshape(*x.shape[:-1], weight.out_features)


# ---- bf16: oneDNN-packed bfloat16 weights ---------------------------------------------------------
class Bf16Linear:
    def __init__(self, weight: torch.Tensor) -> None:
        from sluice.engine.models.llama import pack_cpu_weight

        _check(weight.dim() == 2, f"bf16 weight: expected [N, K], got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.packed = pack_cpu_weight(weight.to(torch.bfloat16))

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Bf16Linear":
        return cls(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from sluice.engine.models.llama import packed_linear

        _check(x.shape[-1] == self.in_features, f"bf16 linear: input has {x.shape[-1]} features, "
               f"expected {self.in_features}")
        return packed_linear(x.to(torch.bfloat16), self.packed, None).float()

    def dequantize(self) -> torch.Tensor:
        return self.packed.to_dense().float()

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * 2


def bf16_linear_ref(x: torch.Tensor, weight: Bf16Linear) -> torch.Tensor:
    xb = _rows(x).to(torch.bfloat16).double()
    out = (xb @ weight.dequantize().double().t()).to(torch.bfloat16).float()
    return out.reshape(*x.shape[:-1], weight.out_features)


# ---- embeddings: int8 blocks of 32 (GGUF Q8_0 held as stored) -------------------------------------
class BlockInt8Embedding:
    """Rows of ``q`` [V, H] int8 with a float32 scale per block of 32: row r = q[r] * scale[r] per block.

    A Q8_0 ``token_embd`` is exactly this (``embedding_from_q8_0``), so lookups stay exact
    while the table takes a quarter of its float32 size."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor) -> None:
        _check(q.dtype == torch.int8 and q.dim() == 2 and q.shape[1] % GROUP == 0,
               f"int8 embedding: expected [V, H] int8 with H a multiple of {GROUP}, got {q.dtype} {tuple(q.shape)}")
        _check(tuple(scales.shape) == (q.shape[0], q.shape[1] // GROUP),
               f"int8 embedding: scales {tuple(scales.shape)}, expected {(q.shape[0], q.shape[1] // GROUP)}")
        self.q, self.scales = q.contiguous(), scales.to(torch.float32).contiguous()
        self.num_embeddings, self.embedding_dim = q.shape

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.q[ids].to(torch.float32)                                            # [T, H]
        blocks = rows.view(*rows.shape[:-1], -1, GROUP) * self.scales[ids][..., None]
        return blocks.reshape(rows.shape)

    def dequantize(self) -> torch.Tensor:
        return self(torch.arange(self.num_embeddings))

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes


# ---- GGUF blocks -> these formats, without a float32 copy of the tensor ---------------------------
def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian float16 bytes -> [...] float32."""
    return raw.contiguous().view(torch.float16).squeeze(-1).to(torch.float32)


def _q4_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """GGUF 4-bit blocks' 16 bytes [..., 16] -> the 32 values [..., 32]: element j < 16 is the low
    nibble of byte j, element 16 + j the high nibble."""
    return torch.cat((qs & 15, qs >> 4), dim=-1)


Int4Parts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]    # q [N, K] uint8, scale and zero [N, K/32]


def q4_0_to_int4(blocks: torch.Tensor, shape: tuple[int, int]) -> Int4Parts:
    """Q4_0 (18-byte blocks: float16 d, 16 bytes of nibbles; w = (q - 8) d): scale d, zero 0."""
    n, k = shape
    b = blocks.view(n, k // GROUP, 18)
    d = _f16(b[..., 0:2])
    return _q4_nibbles(b[..., 2:]).reshape(n, k), d, torch.zeros_like(d)


def q4_1_to_int4(blocks: torch.Tensor, shape: tuple[int, int]) -> Int4Parts:
    """Q4_1 (20-byte blocks: float16 d, float16 m, 16 bytes of nibbles; w = q d + m): scale d,
    zero m + 8 d. Exact but for the rounding of d and m + 8 d to bfloat16 (2^-8 relative at
    most, so a weight moves by at most (8 d + |m + 8 d|) / 256; test_quant_kernels checks it)."""
    n, k = shape
    b = blocks.view(n, k // GROUP, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    return _q4_nibbles(b[..., 4:]).reshape(n, k), d, m + 8 * d


def float_to_int4(weight: torch.Tensor) -> Int4Parts:
    """Min/max per group of 32: q = round((w - min) / s) with s = (max - min) / 15, so that
    w ~ q s + min = (q - 8) s + (min + 8 s)."""
    n, k = weight.shape
    g = weight.to(torch.float32).reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)                                                     # [N, G]
    scale = ((hi - lo) / 15).clamp_min(_TINY)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, lo + 8 * scale


RAW_INT4 = {"Q4_0": q4_0_to_int4, "Q4_1": q4_1_to_int4}


def int4_from_q4_0(blocks: torch.Tensor, shape: tuple[int, int]) -> Int4Linear:
    return Int4Linear(*q4_0_to_int4(blocks, shape))


def int4_from_q4_1(blocks: torch.Tensor, shape: tuple[int, int]) -> Int4Linear:
    return Int4Linear(*q4_1_to_int4(blocks, shape))


def embedding_from_q8_0(blocks: torch.Tensor, shape: tuple[int, int]) -> BlockInt8Embedding:
    """Q8_0 (34-byte blocks: float16 d, 32 int8; w = q d), held as stored."""
    n, k = shape
    b = blocks.view(n, k // GROUP, 34)
    return BlockInt8Embedding(b[..., 2:].contiguous().view(torch.int8).reshape(n, k), _f16(b[..., 0:2]))


# Per format: the class that holds the transformer's projections, and the one for the LM head.
# The LM head is int8 under int4 too: a Q8_0 head (the usual one) would lose bits as int4, and
# int8 is the faster kernel at that shape from 1 row up (bench/README.md).
LINEAR_CLASSES = {"bf16": Bf16Linear, "int8": Int8Linear, "int4": Int4Linear}
HEAD_CLASSES = {"bf16": Bf16Linear, "int8": Int8Linear, "int4": Int8Linear}
