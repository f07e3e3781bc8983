"""GGUF K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), 5-bit blocks (Q5_0, Q5_1) and the 4-bit grid formats
(IQ4_NL, IQ4_XS) as CPU linear layers (``cpu_kquant.cpp``): the file's values and scales,
integer dot products.

A weight is given as its parts, the form every one of these formats shares (``cpu_kquant.cpp``
says how each maps onto it):

* ``u`` [N, K] uint8: the unsigned values (2, 3, 4, 5 or 6 bits); for IQ4_NL / IQ4_XS the 4-bit
  index into ``IQ4_GRID``, the value each index stands for;
* ``d`` [N, K/S] float16: the super-block scale (S = 256 for K-quants, 32 for Q5_0 / Q5_1);
* ``dm`` [N, K/S] float16: the super-block minimum scale (Q2_K, Q4_K, Q5_K) or the offset m (Q5_1);
  None for the formats with a zero point (Q6_K 32, Q5_0 16);
* ``sc`` [N, K/SUB] uint8: the sub-block scales (6-bit for Q4_K / Q5_K per 32, Q6_K's int8 per
  16, Q3_K's 6-bit minus 32 per 16 and IQ4_XS's per 32 as their bytes, Q2_K's 4-bit per 16);
  None for Q5_0 / Q5_1 / IQ4_NL;
* ``mn`` [N, K/SUB] uint8: Q4_K's and Q5_K's 6-bit sub-block minimums (per 32), Q2_K's 4-bit
  ones (per 16); None otherwise.

They are repacked at load into the kernel's layout (``pack``, in C++; ``pack_ref`` is the same
in torch ops), which keeps the file's float16 scales and its 6-bit sub-block scales as bytes
rather than as float32 products d * sc: memory stays at the file's size (Q4_K 4.625 bits a weight
against the file's 4.5, the others equal; float32 products would make Q4_K 6 bits a weight), and
the kernel applies them where it reads them.

Paths (``isa()``), chosen by the build (``cpu_ext``: -march=native): ``avx512vnni`` (512-bit
vpdpbusd, all 16 lanes of a row tile per vector), ``avxvnni`` (the AVX2 tile with 256-bit
vpdpbusd, for CPUs with AVX-VNNI and no AVX-512), ``avx2`` (vpmaddubsw / vpmaddwd), and portable
C++. All have the same integer sums and the same float operations in the same order per output:
bit for bit the same results (tests/unit/test_kquant.py builds every path this CPU can run and
holds each to the native one).

The input is rounded to int8 per row. For the formats with sub-block scales (K-quants, IQ4_XS)
it takes one scale per super-block of 256, as llama.cpp's Q8_K does
(``cpu_blockq.quantize_input(x, 256)``), so each super-block's sub-block sums combine as integers
(sum_i sc_i I_i, and sum_i mn_i B_i for the minimums) and a row pays two float operations per
256 weights instead of two to four per sub-block: the products run 0.7-0.9x the time of a float
scale per sub-block (bench/README.md).
Q5_0 / Q5_1 / IQ4_NL round per block of 32 (``cpu_blockq.quantize_input``, as the Q4_0 / Q4_1 /
Q8_0 products).
"""
from __future__ import annotations

import dataclasses

import torch

from sluice.kernels import cpu_blockq, cpu_ext

TILE = 16
# IQ4_NL's and IQ4_XS's 16 values (llama.cpp's non-linear 4-bit grid); the C++ kernels look up
# these plus 128, unsigned, and subtract 128 times the input's sum (a zero point).
IQ4_GRID = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclasses.dataclass(frozen=True)
class Spec:
    type_id: int       # the GGML type id (the kernel's format code)
    bits: int          # value bits
    super_block: int   # elements per d (and dm)
    sub: int           # elements per sub-block scale (= super_block without sub-block scales)
    offset: bool       # w = D u + M (else w = D (u - zero))
    zero: int
    sub_scales: bool
    signed_scales: bool = False
    grid: tuple[int, ...] | None = None   # the value of each index (w = D grid[u]), else u itself
    value_bits: int | None = None          # the values' bits where narrower than their field (Q3_K: 3)

    @property
    def top(self) -> int:
        """The largest value ``u`` may hold."""
        return 2 ** (self.value_bits or self.bits) - 1

    @property
    def sub_blocks(self) -> int:
        return self.super_block // self.sub


FORMATS = {
    "Q5_0": Spec(6, 5, 32, 32, False, 16, False),
    "Q5_1": Spec(7, 5, 32, 32, True, 0, False),
    "Q4_K": Spec(12, 4, 256, 32, True, 0, True),
    "Q5_K": Spec(13, 5, 256, 32, True, 0, True),
    "Q6_K": Spec(14, 6, 256, 16, False, 32, True, signed_scales=True),
    "IQ4_NL": Spec(20, 4, 32, 32, False, 0, False, grid=IQ4_GRID),
    "Q3_K": Spec(11, 4, 256, 16, False, 4, True, signed_scales=True, value_bits=3),   # in 4-bit fields
    "Q2_K": Spec(10, 2, 256, 16, True, 0, True),
    "IQ4_XS": Spec(23, 4, 256, 32, False, 0, True, signed_scales=True, grid=IQ4_GRID),
}
Parts = tuple  # (u, d, dm | None, sc | None, mn | None)


def isa() -> str | None:
    """``avx512vnni``, ``avxvnni``, ``avx2`` or ``portable``; None when the kernels are not built."""
    return str(cpu_ext.module().kquant_isa()) if cpu_ext.available() else None


def _check_parts(fmt: str, u, d, dm, sc, mn) -> tuple[int, int]:
    spec = FORMATS[fmt]
    n, k = u.shape
    if k % spec.super_block:
        raise ValueError(f"{fmt}: K must be a multiple of {spec.super_block}, got {k}")
    want = {"d": (d, (n, k // spec.super_block), torch.float16),
            "dm": (dm, (n, k // spec.super_block) if spec.offset else None, torch.float16),
            "sc": (sc, (n, k // spec.sub) if spec.sub_scales else None, torch.uint8),
            "mn": (mn, (n, k // spec.sub) if spec.sub_scales and spec.offset else None, torch.uint8)}
    for name, (t, shape, dtype) in want.items():
        if shape is None:
            if t is not None:
                raise ValueError(f"{fmt}: has no {name}")
        elif t is None or tuple(t.shape) != shape or t.dtype != dtype:
            got = None if t is None else (tuple(t.shape), t.dtype)
            raise ValueError(f"{fmt}: {name} must be {dtype} {shape}, got {got}")
    if u.dtype != torch.uint8 or int(u.max()) > spec.top:
        raise ValueError(f"{fmt}: values must be uint8 in 0..{spec.top}")
    if spec.sub_scales and not spec.signed_scales and (int(sc.max()) > 63 or int(mn.max()) > 63):
        raise ValueError(f"{fmt}: sub-block scales and minimums are 6-bit (0..63)")
    return n, k


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    pad = -t.shape[0] % TILE
    return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t


def _per_tile(t: torch.Tensor, nsb: int) -> torch.Tensor:
    """[N, nsb * c] bytes -> [tiles, nsb, c * 16]: each super-block's c columns, row lanes fastest."""
    p = _pad_rows(t)
    c = p.shape[1] // nsb
    return p.view(p.shape[0] // TILE, TILE, nsb, c).permute(0, 2, 3, 1).reshape(p.shape[0] // TILE, nsb, c * TILE)


def _halves_per_tile(h: torch.Tensor) -> torch.Tensor:
    """[N, nsb] float16 -> [tiles, nsb, 32] bytes: each super-block's 16 row lanes as float16."""
    p = _pad_rows(h.contiguous())
    tiles, nsb = p.shape[0] // TILE, p.shape[1]
    return p.view(tiles, TILE, nsb).transpose(1, 2).contiguous().view(torch.uint8)


_PACK_ROWS = 1024     # rows packed at a time (a multiple of TILE): bounds the load's temporaries


def pack(fmt: str, u: torch.Tensor, d: torch.Tensor, dm=None, sc=None, mn=None) -> torch.Tensor:
    """The parts (this module's doc) -> the kernel's layout (flat uint8; ``cpu_kquant.cpp``).
    Tiles are independent, so rows are packed a slice at a time and the slices joined."""
    n, k = _check_parts(fmt, u, d, dm, sc, mn)
    if cpu_ext.available():        # the same bytes, in C++ (a 49152x2048 LM head: ~0.2 s, not ~8 s)
        empty = torch.empty(0, dtype=torch.uint8)
        return cpu_ext.module().kquant_pack(u.contiguous(), d.contiguous(), empty if dm is None else dm.contiguous(),
                                            empty if sc is None else sc.contiguous(),
                                            empty if mn is None else mn.contiguous(), FORMATS[fmt].type_id)
    return pack_ref(fmt, u, d, dm, sc, mn)


def pack_gguf(fmt: str, parts: list[torch.Tensor], k: int) -> torch.Tensor | None:
    """A GGUF tensor's raw blocks in ``fmt`` as a list of [rows, K / S * block bytes] uint8 tensors
    stacked by rows (one, or a fused projection's parts) -> the kernel's layout, in C++ straight
    from the file's bytes where they lie: ``pack`` of ``engine.models.kquant.gguf_parts`` bit for
    bit, without the parts in between (a byte per weight, a few times over), their checks (every
    field of a GGML block is in range by construction) or a copy of the stacked parts. None where
    the C++ kernels are not built: the caller goes through the parts."""
    if not cpu_ext.available():
        return None
    return cpu_ext.module().kquant_pack_gguf_parts([b.contiguous() for b in parts], FORMATS[fmt].type_id, k)


def pack_ref(fmt: str, u: torch.Tensor, d: torch.Tensor, dm=None, sc=None, mn=None) -> torch.Tensor:
    """``pack`` in torch ops (where the C++ kernels are not built; tests hold the two equal)."""
    n, k = u.shape
    pieces = [_pack_rows(fmt, *(None if t is None else t[r:r + _PACK_ROWS] for t in (u, d, dm, sc, mn)))
              for r in range(0, n, _PACK_ROWS)]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    if cpu_ext.available():
        assert out.numel() == -(-n // TILE) * (k // FORMATS[fmt].super_block) * cpu_ext.module().kquant_chunk_bytes(
            FORMATS[fmt].type_id)
    return out


def _pack_rows(fmt: str, u, d, dm, sc, mn) -> torch.Tensor:
    spec = FORMATS[fmt]
    n, k = u.shape
    nsb, blocks = k // spec.super_block, spec.super_block // 32
    header = [_halves_per_tile(d)]
    if spec.offset:
        header.append(_halves_per_tile(dm))
    if spec.sub_scales:
        header.append(_per_tile(sc, nsb))
        if spec.offset:
            header.append(_per_tile(mn, nsb))
    # Bytes are formed in each row's own order (contiguous, fast), then moved into tiles once.
    q = _pad_rows(u).view(-1, k // 32, 8, 4)                                         # [N, blocks, g, j]
    tiles = q.shape[0] // TILE
    if spec.bits == 2:                          # 2 rows of 64 bytes, group 4p + m at bits 2m of row p
        rows = q[:, :, 0::4] | (q[:, :, 1::4] << 2) | (q[:, :, 2::4] << 4) | (q[:, :, 3::4] << 6)   # [N, blocks, p, j]
        body = rows.view(tiles, TILE, nsb, blocks, 2, 4).permute(0, 2, 3, 4, 1, 5).reshape(tiles, nsb, -1)
        return torch.cat([*header, body], -1).reshape(-1).contiguous()
    lo = q & 15
    nib = lo[:, :, 0::2] | (lo[:, :, 1::2] << 4)                                      # [N, blocks, p, j]
    body = [nib.view(tiles, TILE, nsb, blocks, 4, 4).permute(0, 2, 3, 4, 1, 5).reshape(tiles, nsb, blocks, 256)]
    width = spec.bits - 4                       # high bits per value: W planes, 8 / W groups each
    if width:
        per, high = 8 // width, (q >> 4) & ((1 << width) - 1)                         # [N, blocks, g, j]
        for p in range(width):
            plane = high[:, :, p * per].clone()
            for m in range(1, per):
                plane |= high[:, :, p * per + m] << (width * m)                        # [N, blocks, j]
            body.append(plane.view(tiles, TILE, nsb, blocks, 4).permute(0, 2, 3, 1, 4).reshape(tiles, nsb, blocks, 64))
    body = torch.cat(body, -1).reshape(tiles, nsb, -1)
    return torch.cat([*header, body], -1).reshape(-1).contiguous()


def unpack(fmt: str, packed: torch.Tensor, n: int, k: int) -> Parts:
    """Inverse of ``pack``: the parts, rows [:n]."""
    spec = FORMATS[fmt]
    nsb, blocks, tiles = k // spec.super_block, spec.super_block // 32, -(-n // TILE)
    chunk = packed.view(tiles, nsb, -1)
    at = 0

    def take(width: int) -> torch.Tensor:       # [tiles, nsb, width * 16] -> [N, nsb * width]
        nonlocal at
        t = chunk[:, :, at:at + width * TILE]
        at += width * TILE
        return t.reshape(tiles, nsb, width, TILE).permute(0, 3, 1, 2).reshape(tiles * TILE, nsb * width)[:n]

    def halves() -> torch.Tensor:              # [tiles, nsb, 32] -> [N, nsb] float16
        nonlocal at
        t = chunk[:, :, at:at + 2 * TILE].contiguous().view(torch.float16)           # [tiles, nsb, 16]
        at += 2 * TILE
        return t.transpose(1, 2).reshape(tiles * TILE, nsb)[:n]

    d = halves()
    dm = halves() if spec.offset else None
    sc = take(spec.sub_blocks).contiguous() if spec.sub_scales else None
    mn = take(spec.sub_blocks).contiguous() if spec.sub_scales and spec.offset else None
    if spec.bits == 2:
        rows = chunk[:, :, at:].reshape(tiles, nsb, blocks, 2, TILE, 4)                  # [t, sb, b, p, r, j]
        fields = torch.stack([(rows >> (2 * m)) & 3 for m in range(4)], dim=4)        # [t, sb, b, p, m, r, j]
        u = fields.permute(0, 5, 1, 2, 3, 4, 6).reshape(tiles * TILE, k)[:n].contiguous()
        return u, d, dm, sc, mn
    body = chunk[:, :, at:].reshape(tiles, nsb, blocks, 256 + 64 * (spec.bits - 4))
    nib = body[..., :256].reshape(tiles, nsb, blocks, 4, TILE, 4)                     # [t, sb, b, p, r, j]
    lo = torch.stack((nib & 15, nib >> 4), dim=4)                                     # [t, sb, b, p, h, r, j]
    u = lo.permute(0, 5, 1, 2, 3, 4, 6).reshape(tiles * TILE, nsb, blocks, 8, 4).to(torch.int32)   # [N, sb, b, g, j]
    width = spec.bits - 4
    if width:
        per, planes = 8 // width, []
        for p in range(width):
            plane = body[..., 256 + 64 * p:256 + 64 * (p + 1)].reshape(tiles, nsb, blocks, TILE, 4).to(torch.int32)
            planes.append((plane[..., None] >> (width * torch.arange(per, dtype=torch.int32))) & ((1 << width) - 1))
        high = torch.cat(planes, -1)                                                  # [t, sb, b, r, j, g]
        u |= high.permute(0, 3, 1, 2, 5, 4).reshape(tiles * TILE, nsb, blocks, 8, 4) << 4
    return u.reshape(tiles * TILE, k)[:n].to(torch.uint8), d, dm, sc, mn


def scales(fmt: str, d, dm, sc, mn, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(D [N, K/SUB], M [N, K/SUB] or None) float32 from the parts: d * sc and -(dmin * mn),
    exact in float32, as gguf forms them."""
    spec = FORMATS[fmt]
    rep = spec.sub_blocks
    dd = d.float().repeat_interleave(rep, dim=1)
    if spec.sub_scales:
        s = sc.view(torch.int8) if spec.signed_scales else sc
        big_d = dd * s.float()
    else:
        big_d = dd
    if not spec.offset:
        return big_d, None
    dmf = dm.float().repeat_interleave(rep, dim=1)
    return big_d, (-(dmf * mn.float()) if spec.sub_scales else dmf)


def values(fmt: str, u: torch.Tensor) -> torch.Tensor:
    """The stored values as int32: ``u`` itself, or the grid's value at each index."""
    grid = FORMATS[fmt].grid
    return u.to(torch.int32) if grid is None else torch.tensor(grid, dtype=torch.int32)[u.long()]


def dequantize(fmt: str, parts: Parts) -> torch.Tensor:
    """[N, K] float32 with gguf's float32 arithmetic: D q + M, or D (q - zero)."""
    spec = FORMATS[fmt]
    u, d, dm, sc, mn = parts
    n, k = u.shape
    big_d, big_m = scales(fmt, d, dm, sc, mn, k)
    q = values(fmt, u).float().view(n, k // spec.sub, spec.sub)
    if spec.offset:
        w = big_d[..., None] * q + big_m[..., None]
    else:
        w = big_d[..., None] * (q - spec.zero)
    return w.reshape(n, k)


def kernel():
    """The compiled ``kquant_linear(x, packed, type_id, n)``, for hot loops."""
    return cpu_ext.module().kquant_linear


def rows_kernel():
    """The compiled ``kquant_rows(ids [T] int64, packed, type_id, n, k) -> [T, k] float32``."""
    return cpu_ext.module().kquant_rows


def linear(x: torch.Tensor, packed: torch.Tensor, fmt: str, n: int) -> torch.Tensor:
    """x [M, K] float32 (contiguous) -> [M, n] float32."""
    return cpu_ext.module().kquant_linear(x, packed, FORMATS[fmt].type_id, n)


def linear_ref(x: torch.Tensor, fmt: str, parts: Parts) -> torch.Tensor:
    """The kernel's product in float64. Formats with sub-block scales: the input rounded per 256,
    per super-block d s (sum_i sc_i I_i) - dmin s (sum_i mn_i B_i) (I_i the exact sum (u - zero) a
    over sub-block i, B_i the sum of a); the others: the input rounded per 32, each block's exact
    integer sum times d s, plus m s (sum a)."""
    spec = FORMATS[fmt]
    u, d, dm, sc, mn = parts
    n, k = u.shape
    q = values(fmt, u).double() - (0 if spec.offset else spec.zero)
    if spec.sub_scales:
        a, s = cpu_blockq.quantize_input(x, 256)                                     # [M, K], [M, K/256]
        rows, per = a.shape[0], spec.sub_blocks
        ab = a.double().view(rows, -1, spec.sub)
        dots = torch.einsum("msi,nsi->mns", ab, q.view(n, -1, spec.sub))            # [M, N, K/SUB]
        scv = (sc.view(torch.int8) if spec.signed_scales else sc).double()           # [N, K/SUB]
        t = (dots * scv[None]).view(rows, n, -1, per).sum(-1)                        # [M, N, K/256]
        out = t * d.double()[None] * s.double()[:, None]
        if spec.offset:
            o = (ab.sum(-1)[:, None] * mn.double()[None]).view(rows, n, -1, per).sum(-1)
            out = out - o * dm.double()[None] * s.double()[:, None]
        return out.sum(-1).float()
    a, s = cpu_blockq.quantize_input(x)                                             # [M, K], [M, K/32]
    rows = a.shape[0]
    big_d, big_m = scales(fmt, d, dm, sc, mn, k)                                     # [N, K/SUB]
    dots = torch.einsum("msi,nsi->mns", a.double().view(rows, -1, spec.sub), q.view(n, -1, spec.sub))
    s_sub = s.double().repeat_interleave(32 // spec.sub, dim=1)                      # [M, K/SUB]
    out = (dots * big_d.double()[None] * s_sub[:, None]).sum(-1)
    if spec.offset:
        sums = a.double().view(rows, -1, spec.sub).sum(-1)                           # [M, K/SUB]
        out = out + (big_m.double()[None] * (s_sub * sums)[:, None]).sum(-1)
    return out.float()
