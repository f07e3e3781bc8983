"""GGUF's K-quants and 5-bit blocks held as stored (``quantization=gguf``), and projections whose
parts the file stores in different types.

* ``KQuantLinear``: a Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_NL or IQ4_XS weight in the layout of
  ``kernels/cpu_kquant.cpp`` (the file's values, float16 scales and 6-/8-bit sub-block scales;
  ``kernels/cpu_kquant.py`` says why that layout), multiplied with the input rounded to int8 per
  block of 32 and exact integer sums, like ``quant.BlockQLinear`` for Q4_0 / Q4_1 / Q8_0.
* ``StackedLinear``: a fused projection (q/k/v, gate/up) whose parts are held in different
  formats, as llama.cpp's mixed files store them (a Q4_K_M file keeps attn_v in Q6_K on some
  layers and attn_q / attn_k in Q4_K): each part's product, side by side.
* ``gguf_parts``: a GGUF tensor's raw blocks -> the parts ``cpu_kquant`` takes, bit for bit
  (tests/unit/test_kquant.py holds them to gguf's ``dequantize``).

Each class has ``__call__(x [.., K] float32) -> [.., N]``, ``dequantize() -> [N, K] float32``,
``nbytes`` and ``cpp_parts()``, the (kind, packed, d, m, n) list the C++ layer stack
(``cpu_stack.cpp``'s StackPart) runs: kind 4 / 8 for ``BlockQLinear``'s bits, 100 + the GGML
type id for these formats.
"""
from __future__ import annotations

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from sluice.engine.models.quant import BlockQLinear, _check, _rows

KQUANT_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
KIND_OFFSET = 100
_EMPTY = torch.empty(0)
# elements and bytes per GGUF block (gguf's table)
_BLOCK = {kind: GGML_QUANT_SIZES[GGMLQuantizationType[kind]] for kind in KQUANT_TYPES}


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian float16 bytes -> [...] float16."""
    return raw.contiguous().view(torch.float16).squeeze(-1)


def _bits(b: torch.Tensor, shifts: list[int], width: int) -> torch.Tensor:
    """[..., L] bytes -> [..., len(shifts), L]: each byte shifted right by each shift, masked."""
    sh = torch.tensor(shifts, dtype=torch.uint8).view(len(shifts), 1)
    return (b.unsqueeze(-2) >> sh) & (2 ** width - 1)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> (sc, mn) [..., 8] 6-bit: bytes 0-3 hold sc 0-3 in
    their low 6 bits, 4-7 mn 0-3; bytes 8-11 the low nibbles of sc 4-7 (low) and mn 4-7 (high), whose
    top 2 bits are the top bits of bytes 0-3 (sc) and 4-7 (mn)."""
    lo_sc, lo_mn, mixed = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((lo_sc & 63, (mixed & 15) | ((lo_sc >> 6) << 4)), -1)
    mn = torch.cat((lo_mn & 63, (mixed >> 4) | ((lo_mn >> 6) << 4)), -1)
    return sc, mn


def _two_bit_planes(q: torch.Tensor) -> torch.Tensor:
    """[..., 64 * h] bytes -> [..., 256 * h] 2-bit values, GGML's order for Q2_K's and Q3_K's low
    bits and Q6_K's high ones: element 128 h + 32 s + l is bits 2 s of byte 32 h + l."""
    return _bits(q.reshape(*q.shape[:-1], -1, 32), [0, 2, 4, 6], 2).reshape(*q.shape[:-1], -1)


def _low_nibbles(qs: torch.Tensor, runs: int) -> torch.Tensor:
    """[..., runs * L] bytes -> [..., runs * 2L] values: in each run of L bytes, element i is the low
    nibble of byte i and element L + i its high nibble."""
    v = qs.reshape(*qs.shape[:-1], runs, -1)
    return torch.stack((v & 15, v >> 4), dim=-2).reshape(*qs.shape[:-1], -1)


def _check_blocks(kind: str, blocks: torch.Tensor, n: int, k: int) -> tuple[int, int]:
    """(elements, bytes) per block of ``kind``, after checking that ``blocks`` hold [n, k]."""
    per, size = _BLOCK[kind]
    _check(k % per == 0 and blocks.numel() == n * k // per * size,
           f"{kind}: {blocks.numel()} bytes do not hold a [{n}, {k}] tensor")
    return per, size


def gguf_parts(kind: str, blocks: torch.Tensor, shape: tuple[int, int]):
    """A GGUF tensor's blocks ([rows, bytes per row] uint8) -> (u, d, dm, sc, mn) for
    ``cpu_kquant.pack`` (its module doc says what each is)."""
    n, k = shape
    per, size = _check_blocks(kind, blocks, n, k)
    b = blocks.reshape(n, k // per, size)
    if kind in ("Q5_0", "Q5_1"):
        at = 2 if kind == "Q5_0" else 4
        d, dm = _f16(b[..., 0:2]), (_f16(b[..., 2:4]) if kind == "Q5_1" else None)
        hi = _bits(b[..., at:at + 4], list(range(8)), 1).transpose(-1, -2).reshape(n, -1, 32)   # bit e%8 of byte e//8
        u = _low_nibbles(b[..., at + 4:], 1) | (hi << 4)
        return u.reshape(n, k), d, dm, None, None
    if kind == "Q3_K":
        # hmask [32], qs [64], 12 scale bytes, d; scale i: low nibble of byte i % 8 (high for i >= 8),
        # top 2 bits at 2 (i / 4) of byte 8 + i % 4, minus 32; element 128 h + 32 s + l: bits 2 s of
        # qs[32 h + l], plus 4 where bit (128 h + 32 s + l) / 32 of hmask[l] is set
        hm, qs, s = b[..., 0:32], b[..., 32:96], b[..., 96:108]
        low_sc = torch.cat((s[..., 0:8] & 15, s[..., 0:8] >> 4), -1)
        sc = (low_sc | (_bits(s[..., 8:12], [0, 2, 4, 6], 2).reshape(n, -1, 16) << 4)).to(torch.int16) - 32
        u = _two_bit_planes(qs) | (_bits(hm, list(range(8)), 1).reshape(n, -1, 256) << 2)
        return u.reshape(n, k), _f16(b[..., 108:110]), None, sc.to(torch.int8).view(torch.uint8).reshape(n, -1), None
    if kind == "Q2_K":
        # 16 scale bytes (sc the low nibble, mn the high one), qs [64], d, dmin; element
        # 128 h + 32 s + l: bits 2 s of qs[32 h + l]
        s = b[..., 0:16]
        u = _two_bit_planes(b[..., 16:80]).reshape(n, k)
        return u, _f16(b[..., 80:82]), _f16(b[..., 82:84]), (s & 15).reshape(n, -1), (s >> 4).reshape(n, -1)
    if kind == "IQ4_NL":
        return _low_nibbles(b[..., 2:], 1).reshape(n, k), _f16(b[..., 0:2]), None, None, None
    if kind == "IQ4_XS":
        # d, the scales' high 2 bits (uint16: sub-block i at bits 2i), their low nibbles (sub-block i
        # in nibble i % 2 of byte i / 2), then 16 bytes per sub-block of 32 (low nibbles first)
        high = b[..., 2].to(torch.int32) | (b[..., 3].to(torch.int32) << 8)
        shifts = torch.arange(8, dtype=torch.int32)
        low = (b[..., 4:8].to(torch.int32).repeat_interleave(2, -1) >> (4 * (shifts % 2))) & 15
        sc = (low | (((high[..., None] >> (2 * shifts)) & 3) << 4)) - 32
        u = _low_nibbles(b[..., 8:], 8)
        return u.reshape(n, k), _f16(b[..., 0:2]), None, sc.to(torch.int8).view(torch.uint8).reshape(n, -1), None
    if kind == "Q6_K":
        lo = _low_nibbles(b[..., 0:128], 2)                                             # [n, nsb, 256]
        hi = _two_bit_planes(b[..., 128:192])
        return (lo | (hi << 4)).reshape(n, k), _f16(b[..., 208:210]), None, b[..., 192:208].reshape(n, -1), None
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    if kind == "Q4_K":
        u = _low_nibbles(b[..., 16:144], 4)
    else:   # Q5_K: element 32 j + i takes bit j of high-bit byte i
        u = _low_nibbles(b[..., 48:176], 4) | (_bits(b[..., 16:48], list(range(8)), 1).reshape(n, -1, 256) << 4)
    return u.reshape(n, k), d, dmin, sc.reshape(n, -1), mn.reshape(n, -1)


class KQuantLinear:
    """A ``cpu_kquant`` format weight [N, K] (``fmt`` one of ``KQUANT_TYPES``), held in the
    kernel's layout. Construction checks the parts (``cpu_kquant.pack``)."""

    def __init__(self, fmt: str, u, d, dm=None, sc=None, mn=None) -> None:
        from sluice.kernels import cpu_kquant

        _check(fmt in cpu_kquant.FORMATS, f"block weight: no K-quant format {fmt!r}; one of {', '.join(KQUANT_TYPES)}")
        _check(u.dim() == 2, f"{fmt} weight: expected [N, K], got {tuple(u.shape)}")
        self._setup(fmt, *u.shape, cpu_kquant.pack(fmt, u, d, dm, sc, mn))

    @classmethod
    def from_gguf(cls, kind: str, blocks: torch.Tensor | list[torch.Tensor], shape: tuple[int, int]) -> "KQuantLinear":
        """From a GGUF tensor's blocks ([rows, bytes per row] uint8), or a list of such tensors in
        ``kind`` stacked by rows (a fused projection's parts; ``shape`` is the whole's): in one C++
        pass over the bytes where they lie (``cpu_kquant.pack_gguf``), or without the C++ kernels
        through ``gguf_parts`` a slice of rows at a time, so that the load's temporaries (a byte per
        weight, a few times over) stay a slice's, not the tensor's (a 49152x2048 LM head: ~100 MiB each)."""
        from sluice.kernels import cpu_kquant

        n, k = shape
        if isinstance(blocks, torch.Tensor):
            _check_blocks(kind, blocks, n, k)
            parts = [blocks.reshape(n, -1)]
        else:
            parts = list(blocks)
            counts = [b.shape[0] if b.dim() == 2 else -1 for b in parts]
            _check(bool(parts) and min(counts) >= 0 and sum(counts) == n,
                   f"{kind}: parts of {counts} rows do not stack to a [{n}, {k}] tensor")
            for b in parts:
                _check_blocks(kind, b, b.shape[0], k)
        packed = cpu_kquant.pack_gguf(kind, parts, k)
        if packed is None:
            step, rows = cpu_kquant._PACK_ROWS, parts[0] if len(parts) == 1 else torch.cat(parts)
            pieces = [cpu_kquant.pack(kind, *gguf_parts(kind, rows[r:r + step], (min(step, n - r), k)))
                      for r in range(0, n, step)]
            packed = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        self = cls.__new__(cls)
        self._setup(kind, n, k, packed)
        return self

    def _setup(self, fmt: str, n: int, k: int, packed: torch.Tensor) -> None:
        from sluice.kernels import cpu_kquant

        self.fmt, self.out_features, self.in_features, self.packed = fmt, n, k, packed
        self.type_id = cpu_kquant.FORMATS[fmt].type_id
        self.kind = KIND_OFFSET + self.type_id
        self._kernel, self._rows_kernel = cpu_kquant.kernel(), cpu_kquant.rows_kernel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():
            return self._kernel(x, self.packed, self.type_id, self.out_features)
        _check(x.shape[-1] == self.in_features, f"{self.fmt} linear: input has {x.shape[-1]} features, "
               f"expected {self.in_features}")
        out = self._kernel(_rows(x).to(torch.float32).contiguous(), self.packed, self.type_id, self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows ``ids`` [T] dequantized, [T, K] float32, equal to gguf's values bit for bit
        (an embedding's lookups)."""
        return self._rows_kernel(ids.reshape(-1).long().contiguous(), self.packed, self.type_id,
                                 self.out_features, self.in_features)

    def parts(self):
        from sluice.kernels import cpu_kquant

        return cpu_kquant.unpack(self.fmt, self.packed, self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        from sluice.kernels import cpu_kquant

        return cpu_kquant.dequantize(self.fmt, self.parts())

    def cpp_parts(self) -> list:
        return [(self.kind, self.packed, _EMPTY, _EMPTY, self.out_features)]

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


def kquant_linear_ref(x: torch.Tensor, weight: KQuantLinear) -> torch.Tensor:
    from sluice.kernels import cpu_kquant

    out = cpu_kquant.linear_ref(_rows(x), weight.fmt, weight.parts())
    return out.reshape(*x.shape[:-1], weight.out_features)


def block_cpp_parts(weight) -> list:
    """(kind, packed, d, m, n) of a ``BlockQLinear``, ``KQuantLinear`` or ``StackedLinear``."""
    if isinstance(weight, BlockQLinear):
        return [(weight.bits, weight.packed, weight.d, weight.m, weight.out_features)]
    return weight.cpp_parts()


class StackedLinear:
    """Block weights stacked by output rows, each in its own format: the product is each part's,
    side by side (the input is rounded the same way for every part, so this is the product of
    the stacked weight)."""

    def __init__(self, parts: list) -> None:
        _check(len(parts) > 1, "stacked weight: needs at least two parts")
        k = parts[0].in_features
        _check(all(p.in_features == k for p in parts), "stacked weight: parts differ in input features")
        self.parts_ = list(parts)
        self.in_features, self.out_features = k, sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts_], dim=-1)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts_])

    def cpp_parts(self) -> list:
        return [t for p in self.parts_ for t in block_cpp_parts(p)]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts_)


BLOCK_CLASSES = (BlockQLinear, KQuantLinear, StackedLinear)
