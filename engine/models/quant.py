"""Weight formats chosen at start-up (``DeviceConfig.quantization``), for CPU decoding.

Decoding on a CPU streams every weight once per step, so bytes per weight set the speed. The
float32 path (``none``) keeps oneDNN-packed float32 (``cpu_linear.packed_linear``). The others keep
the weights smaller and multiply with torch's CPU weight-only kernels; activations, norms,
attention and the KV cache stay float32, and each projection's input is rounded to bfloat16:

* ``bf16``: bfloat16 weights in oneDNN's packed layout.
* ``int8``: one int8 per weight with a float32 scale per output row (symmetric), multiplied by
  ``torch._weight_int8pack_mm``.
* ``int4``: 4-bit weights in groups of 32 along the input with a bfloat16 scale and zero per
  group (asymmetric; the tinygemm convention ``w = (q - 8) * scale + zero``), multiplied by
  ``torch._weight_int4pack_mm_for_cpu``. GGUF Q4_0 / Q4_1 blocks map onto it directly
  (``q4_0_to_int4`` / ``q4_1_to_int4``). The LM head is int8 (``HEAD_CLASSES``).
* ``w4a8`` / ``w8a8`` (``BlockQLinear``): GGUF-style blocks of 32 with a float32 scale and
  offset each (Q4_0 / Q4_1 / Q8_0 exactly as stored), multiplied by sluice's own C++ kernel
  (``kernels/cpu_blockq.cpp``) with the input rounded to int8 per block of 32 instead of to
  bfloat16: integer dot products, fast at every row count. The LM head is 8-bit blocks. GGUF
  K-quants and 5-bit blocks are held as stored by ``models.kquant`` in these formats (w8a8: all
  of them; w4a8: Q4_K), with the same input rounding (``kernels/cpu_kquant.cpp``).

The int8 and int4 kernels compute every row on its own: a row's bits are the same alone and
among any number of rows (tests/unit/test_quant_kernels.py), so one kernel serves every row
count and batching cannot change a token. They are fast at a few rows and slower than float32
at prefill sizes; switching to another kernel above some row count would make a row's bits
depend on the batch, so they do not (bench/README.md has the costs, and what was tried: int8
activations through ``torch._int_mm`` are faster at every row count but cost 2% perplexity).
oneDNN's float32 and bfloat16 products are not row-independent at every shape.

Each format is a small class with ``__call__(x [.., K] float32) -> [.., N] float32``,
``dequantize() -> [N, K] float32`` (the weight it multiplies by, for tests and inspection) and a
``*_ref`` reference in plain float arithmetic. Construction checks shapes and dtypes.
"""
from __future__ import annotations

import functools

import torch

from sluice.engine.models.cpu_linear import pack_cpu_weight, packed_linear

GROUP = 32                      # int4 group size along the input (= the GGUF block size)
_INT8_K_MULTIPLE = 16           # _weight_int8pack_mm's row length granule (see Int8Linear)
_INT4_ROW_PAD = 64              # int4 rows are zero-padded to a multiple of every row tile below
_TINY = torch.finfo(torch.float32).tiny
_HALF_TINY = 2.0 ** -24        # float16's smallest (subnormal) value: the scale of an all-zero block


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_groups(what: str, q: torch.Tensor, top: int, *per_group: tuple[str, torch.Tensor]) -> tuple[int, int]:
    """q [N, K] (K a multiple of GROUP) with values in 0..top, and each per-group tensor [N, K/32]."""
    _check(q.dim() == 2 and q.shape[1] % GROUP == 0, f"{what}: expected [N, K] with K a multiple of "
           f"{GROUP}, got {tuple(q.shape)}")
    n, k = q.shape
    groups = (n, k // GROUP)
    for name, t in per_group:
        _check(tuple(t.shape) == groups, f"{what}: {name} {tuple(t.shape)}, expected {groups}")
    _check(int(q.min()) >= 0 and int(q.max()) <= top, f"{what}: values must lie in 0..{top}")
    return n, k


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


# ---- int8: per-channel int8 weights ----------------------------------------------------------------
def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (int8 [N, K], float32 scale [N]) with w ~ q * scale, symmetric per row."""
    scale = (w.abs().amax(dim=-1) / 127.0).clamp_min(_TINY)          # [N]; an all-zero row gets q = 0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear:
    """``qweight`` [N, K] int8 and ``scale`` [N] float32: the weight is ``qweight * scale[:, None]``.

    ``torch._weight_int8pack_mm`` multiplies bfloat16 activations by the int8 weight. It is given
    unit scales and the float32 scales are applied to its output, so that they are not rounded
    to bfloat16 (a per-channel gain error that every token would share). The kernel reads past
    the end of a row whose length is not a multiple of 16 (it crashed at K=33 and K=40), so such
    weights are zero-padded along K, and inputs with them.
    """

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        _check(qweight.dtype == torch.int8 and qweight.dim() == 2, f"int8 weight: expected a 2-D int8 tensor, "
               f"got {qweight.dtype} {tuple(qweight.shape)}")
        _check(tuple(scale.shape) == (qweight.shape[0],), f"int8 weight: scale shape {tuple(scale.shape)}, "
               f"expected ({qweight.shape[0]},)")
        self.out_features, self.in_features = qweight.shape
        self._pad_k = -self.in_features % _INT8_K_MULTIPLE
        self.qweight = torch.nn.functional.pad(qweight, (0, self._pad_k)).contiguous()     # [N, K + pad]
        self.scale = scale.to(torch.float32).contiguous()
        self._ones = torch.ones(self.out_features, dtype=torch.bfloat16)

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Int8Linear":
        """Symmetric per-output-row int8 (scale = row max / 127)."""
        return cls(*quantize_rows_int8(weight.to(torch.float32)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _check(x.shape[-1] == self.in_features, f"int8 linear: input has {x.shape[-1]} features, "
               f"expected {self.in_features}")
        flat = _rows(x).to(torch.bfloat16)                                              # [M, K]
        if self._pad_k:
            flat = torch.nn.functional.pad(flat, (0, self._pad_k))
        out = torch._weight_int8pack_mm(flat, self.qweight, self._ones).float().mul_(self.scale)
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        return self.qweight[:, :self.in_features].to(torch.float32) * self.scale[:, None]

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.scale.nbytes


def int8_linear_ref(x: torch.Tensor, weight: Int8Linear) -> torch.Tensor:
    """x rounded to bfloat16 times the int8 values in float64, rounded to bfloat16, then scaled."""
    xb = _rows(x).to(torch.bfloat16).double()
    acc = (xb @ weight.qweight[:, :weight.in_features].double().t()).to(torch.bfloat16).float()
    return (acc * weight.scale).reshape(*x.shape[:-1], weight.out_features)


# ---- int4: group-32 asymmetric weights for torch's CPU tinygemm kernel ---------------------------
def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] uint8 in 0..15 (N a multiple of 64) -> torch's CPU int4 layout [N, K/2] uint8."""
    return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)


def _unpack_int4_tiled(packed: torch.Tensor, tile: int) -> torch.Tensor:
    """``packed`` read as torch's CPU int4 layout with row tiles of ``tile``: byte ``(t, k, i)`` of
    the layout viewed as [N/tile, K, tile/2] holds row ``tile*t + i`` of column k in its low nibble
    and row ``tile*t + tile/2 + i`` in its high nibble."""
    n, half_k = packed.shape
    tiles = packed.view(n // tile, 2 * half_k, tile // 2)                            # [N/tile, K, tile/2]
    lo, hi = tiles & 15, tiles >> 4
    both = torch.cat((lo, hi), dim=2)                                                  # [N/tile, K, tile]
    return both.transpose(1, 2).reshape(n, 2 * half_k)


@functools.cache
def _int4_row_tile() -> int:
    """The row tile of torch's CPU int4 layout on this machine. It follows the vector width of the
    ATen kernels torch dispatches to: 64 rows with AVX512, 32 with AVX2 or none (four vectors of
    floats). Read off the packing itself, once, rather than guessed from the CPU's name."""
    q = (torch.arange(_INT4_ROW_PAD * GROUP) * 7 % 16).reshape(_INT4_ROW_PAD, GROUP).to(torch.uint8)
    packed = _pack_int4(q)
    fits = [t for t in (64, 32) if torch.equal(_unpack_int4_tiled(packed, t), q)]
    if len(fits) != 1:
        raise RuntimeError("torch's CPU int4 weight layout is not one sluice knows (row tiles of 64 or 32)")
    return fits[0]


def _unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_pack_int4`` (tests/unit/test_quant_kernels.py checks it round-trips)."""
    return _unpack_int4_tiled(packed, _int4_row_tile())


class Int4Linear:
    """``q`` [N, K] in 0..15 with ``scales`` and ``zeros`` [N, K/32]: w = (q - 8) * scale + zero.

    Scales and zeros are stored in bfloat16 (the kernel's dtype for bfloat16 activations; its
    float16 variant measured 20-40x slower here). Rows are zero-padded to a multiple of 64
    (torch's row tile is 64 or 32).
    """

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        n, k = _check_groups("int4 weight", q, 15, ("scales", scales), ("zeros", zeros))
        pad = -n % _INT4_ROW_PAD
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
def _onednn_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_unavailable_reason() -> str | None:
    """Why ``bf16`` cannot run on this CPU, or None. oneDNN packs and multiplies bfloat16 weights
    only with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2 CPU its reorder raises."""
    if _onednn_bf16():
        return None
    return (f"bf16 weights need oneDNN's bfloat16 support, which this CPU lacks (torch's CPU "
            f"capability: {torch.backends.cpu.get_cpu_capability()}; it needs AVX512BW/VL/DQ or "
            "AVX-NE-CONVERT)")


class Bf16Linear:
    def __init__(self, weight: torch.Tensor) -> None:
        reason = bf16_unavailable_reason()
        _check(reason is None, f"bf16 weight: {reason}")
        _check(weight.dim() == 2, f"bf16 weight: expected [N, K], got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.packed = pack_cpu_weight(weight.to(torch.bfloat16))

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Bf16Linear":
        return cls(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
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


# ---- w4a8 / w8a8: GGUF-style blocks of 32 with int8 activations (kernels/cpu_blockq) -------------
class BlockQLinear:
    """``u`` [N, K] unsigned ``bits``-bit values with ``d`` and ``m`` [N, K/32] (float16 values,
    held as float16): w = d u + m per block of 32. The input is quantized to int8 per row and block of 32 and each
    block's dot product is an exact integer sum (``kernels.cpu_blockq``). GGUF Q4_0, Q4_1 and
    Q8_0 blocks are exactly this form (``block_parts``), so their weights are used unrounded.
    """

    def __init__(self, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int) -> None:
        from sluice.kernels import cpu_blockq

        _check(bits in (4, 8), f"block weight: bits must be 4 or 8, got {bits}")
        n, k = _check_groups("block weight", u, 2 ** bits - 1, ("d", d), ("m", m))
        self.out_features, self.in_features, self.bits = n, k, bits
        self.packed = cpu_blockq.pack_weights(u, bits)
        self.d, self.m = cpu_blockq.pack_scales(d), cpu_blockq.pack_scales(m)
        self._kernel = cpu_blockq.kernel()
        self._rows_kernel = cpu_blockq.rows_kernel()

    @classmethod
    def from_float(cls, weight: torch.Tensor, bits: int) -> "BlockQLinear":
        return cls(*float_to_block(weight, bits), bits)

    @classmethod
    def from_gguf(cls, parts: list[tuple[str, torch.Tensor]], bits: int, k: int) -> "BlockQLinear":
        """GGUF Q4_0 / Q4_1 / Q8_0 tensors (type, [rows, bytes per row] uint8), stacked by rows,
        packed straight from the file's bytes (``cpu_blockq.pack_gguf``): the weight
        ``cls(*block_parts(...), bits)`` of the stacked parts would be, without the (u, d, m) detour."""
        from sluice.kernels import cpu_blockq

        _check(bits in (4, 8), f"block weight: bits must be 4 or 8, got {bits}")
        self = cls.__new__(cls)
        self.packed, self.d, self.m = cpu_blockq.pack_gguf(parts, bits, k)
        self.out_features, self.in_features, self.bits = sum(b.shape[0] for _, b in parts), k, bits
        self._kernel = cpu_blockq.kernel()
        self._rows_kernel = cpu_blockq.rows_kernel()
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Called ~120 times per decode step: the common case (a contiguous float32 [M, K]) goes
        # straight to the kernel, which checks shapes and dtypes itself.
        if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            return self._kernel(x, self.packed, self.d, self.m, self.bits, self.out_features)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"block linear: input has {x.shape[-1]} features, expected {self.in_features}")
        flat = _rows(x).to(torch.float32).contiguous()
        out = self._kernel(flat, self.packed, self.d, self.m, self.bits, self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows ``ids`` [T] dequantized, [T, K] float32: a tied LM head serves the token
        embedding's lookups from its own blocks, so the table is not held twice. One kernel call
        (``cpu_blockq.cpp``'s blockq_rows); equal to ``rows_ref`` bit for bit."""
        return self._rows_kernel(ids.reshape(-1).long().contiguous(), self.packed, self.d, self.m,
                                 self.bits, self.out_features, self.in_features)

    def rows_ref(self, ids: torch.Tensor) -> torch.Tensor:
        """``rows`` in torch ops. d u + m is exact in float32 for Q8_0's and Q4's blocks (a float16
        d times at most 8 bits, and an m that is a multiple of d's last bit or a float16), so the
        rows are the file's values."""
        from sluice.kernels.cpu_blockq import TILE

        ids = ids.reshape(-1).long()
        tile, r = ids // TILE, ids % TILE
        nb = self.in_features // GROUP
        if self.bits == 8:
            u = self.packed.view(-1, nb, 8, TILE, 4)[tile, :, :, r]                       # [T, nb, 8, 4]
        else:
            v = self.packed.view(-1, nb, 4, TILE, 4)[tile, :, :, r]                  # [T, nb, 4, 4]
            u = torch.stack((v & 15, v >> 4), dim=3)                                       # [T, nb, 4, 2, 4]
        u = u.reshape(len(ids), nb, GROUP).to(torch.float32)
        w = u * self.d[tile, :, r].float()[..., None] + self.m[tile, :, r].float()[..., None]
        return w.reshape(len(ids), self.in_features)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(u [N, K] uint8, d, m [N, K/32]) as given."""
        from sluice.kernels import cpu_blockq

        n, k = self.out_features, self.in_features
        return (cpu_blockq.unpack_weights(self.packed, self.bits, n, k),
                cpu_blockq.unpack_scales(self.d, n), cpu_blockq.unpack_scales(self.m, n))

    def dequantize(self) -> torch.Tensor:
        u, d, m = self.parts()
        n, k = u.shape
        w = u.to(torch.float32).view(n, k // GROUP, GROUP) * d[..., None] + m[..., None]
        return w.reshape(n, k)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.d.nbytes + self.m.nbytes


def blockq_linear_ref(x: torch.Tensor, weight: BlockQLinear) -> torch.Tensor:
    from sluice.kernels import cpu_blockq

    rows = _rows(x)
    out = cpu_blockq.linear_ref(rows, *weight.parts())
    return out.reshape(*x.shape[:-1], weight.out_features)


BlockParts = tuple[torch.Tensor, torch.Tensor, torch.Tensor]      # u [N, K] uint8, d and m [N, K/32]


def _half(x: torch.Tensor, what: str) -> torch.Tensor:
    """x rounded to float16 values (held as float32); ValueError past float16's range."""
    h = x.to(torch.float16)
    _check(bool(torch.isfinite(h).all()), f"block weight: a block's {what} is beyond float16's range")
    return h.to(torch.float32)


def float_to_block(weight: torch.Tensor, bits: int) -> BlockParts:
    """8 bits: symmetric per block (Q8_0's rule: q = round(w / d), d = max|w| / 127, held as
    u = q + 128, m = -128 d). 4 bits: min/max per block (u = round((w - m) / d), m = min). d and
    m are float16 values, as GGUF stores them, rounded before the weights are.

    Rows go through in slices of about ``_ROUND_SLICE`` values: each block is rounded on its own,
    so slicing changes no bit, and the rounding's float32 temporaries (three of the slice's size)
    stay small beside a large tensor (a 128k x 4096 table's would be 2 GiB each)."""
    n, k = weight.shape
    _check(k % GROUP == 0, f"block weight: {k} inputs is not a multiple of {GROUP}")
    u = torch.empty((n, k), dtype=torch.uint8)
    d, m = torch.empty((n, k // GROUP)), torch.empty((n, k // GROUP))
    step = max(1, _ROUND_SLICE // k)
    for start in range(0, n, step):
        rows = slice(start, start + step)
        u[rows], d[rows], m[rows] = _rows_to_block(weight[rows], bits)
    return u, d, m


_ROUND_SLICE = 1 << 20


def _rows_to_block(weight: torch.Tensor, bits: int) -> BlockParts:
    """``float_to_block`` of a slice of rows."""
    n, k = weight.shape
    g = weight.to(torch.float32).reshape(n, k // GROUP, GROUP)
    if bits == 8:
        d = _half(g.abs().amax(-1) / 127, "scale").clamp_min(_HALF_TINY)
        q = torch.round(g / d[..., None]).clamp_(-127, 127) + 128
        return q.to(torch.uint8).reshape(n, k), d, -128 * d
    lo = _half(g.amin(-1), "minimum")
    d = _half((g.amax(-1) - lo) / 15, "scale").clamp_min(_HALF_TINY)
    u = torch.round((g - lo[..., None]) / d[..., None]).clamp_(0, 15).to(torch.uint8)
    return u.reshape(n, k), d, lo


def _gguf_block_parts(kind: str, blocks: torch.Tensor, shape: tuple[int, int]) -> BlockParts:
    """GGUF Q4_0 / Q4_1 / Q8_0 blocks -> (u, d, m) with w = d u + m, exactly."""
    n, k = shape
    if kind == "Q8_0":
        b = blocks.view(n, k // GROUP, 34)
        d = _f16(b[..., 0:2])
        q = b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128
        return q.to(torch.uint8).reshape(n, k), d, -128 * d
    if kind == "Q4_1":
        b = blocks.view(n, k // GROUP, 20)
        return _q4_nibbles(b[..., 4:]).reshape(n, k), _f16(b[..., 0:2]), _f16(b[..., 2:4])
    b = blocks.view(n, k // GROUP, 18)
    d = _f16(b[..., 0:2])
    return _q4_nibbles(b[..., 2:]).reshape(n, k), d, -8 * d


BLOCK_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}


def block_parts(kind: str, blocks: torch.Tensor, shape: tuple[int, int], bits: int) -> BlockParts | None:
    """The parts of a GGUF tensor for a ``bits``-bit block weight, None if that would round it
    (an 8-bit tensor for a 4-bit weight): a 4-bit file tensor fits 8 bits as it is."""
    if kind not in BLOCK_BITS or BLOCK_BITS[kind] > bits:
        return None
    return _gguf_block_parts(kind, blocks, shape)


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


class TiedBlockEmbedding:
    """The token embedding of a tied model served from its block LM head (``BlockQLinear.rows``):
    the table is held once, as the head's blocks. ``owned``: the block weight is the embedding's
    own (an untied table held as stored), so its bytes count here."""

    def __init__(self, head: BlockQLinear, owned: bool = False) -> None:
        self.head = head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.nbytes = head.nbytes if owned else 0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.rows(ids).reshape(*ids.shape, self.embedding_dim)

    def dequantize(self) -> torch.Tensor:
        return self.head.dequantize()


def embedding_from_float(weight: torch.Tensor) -> BlockInt8Embedding:
    """A float table rounded to int8 blocks of 32 by Q8_0's rule (``float_to_block``'s 8 bits):
    the rows an 8-bit block head rounded from the same table would give, bit for bit."""
    u, d, _m = float_to_block(weight, 8)
    # u = q + 128 with q in [-127, 127]: flipping the top bit is q's two's complement byte, in place.
    return BlockInt8Embedding(u.bitwise_xor_(128).view(torch.int8), d)


def embedding_from_q8_0(blocks: torch.Tensor, shape: tuple[int, int]) -> BlockInt8Embedding:
    """Q8_0 (34-byte blocks: float16 d, 32 int8; w = q d), held as stored."""
    n, k = shape
    b = blocks.view(n, k // GROUP, 34)
    return BlockInt8Embedding(b[..., 2:].contiguous().view(torch.int8).reshape(n, k), _f16(b[..., 0:2]))


# Per format: the class that holds the transformer's projections, and the one for the LM head.
# The LM head is int8 under int4 too: a Q8_0 head (the usual one) would lose more bits as int4.
# w8a8 / w4a8 (BlockQLinear) are built by loaders.quantized from the file's blocks; both keep the
# LM head in 8-bit blocks (a Q8_0 head as stored).
LINEAR_CLASSES = {"bf16": Bf16Linear, "int8": Int8Linear, "int4": Int4Linear, "w8a8": BlockQLinear,
                  "w4a8": BlockQLinear}
HEAD_CLASSES = {"bf16": Bf16Linear, "int8": Int8Linear, "int4": Int8Linear, "w8a8": BlockQLinear,
                "w4a8": BlockQLinear}
BLOCK_FORMATS = {"w8a8": 8, "w4a8": 4}
