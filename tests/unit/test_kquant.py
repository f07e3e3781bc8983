"""GGUF K-quants and 5-bit blocks kept as stored (engine/models/kquant.py, kernels/cpu_kquant.*).

* Decoding: random block bytes (any bytes with finite float16 scales are valid blocks), and
  Q5_0 / Q5_1 blocks the ``gguf`` package writes, become weights whose values are gguf's own
  ``dequantize``, bit for bit (through the parts, the packed layout, and the C++ row lookup).
* Products: each format against its float64 reference (the kernel's own input rounding, exact
  integer sums), and against a float product of the dequantized weight, at 1, 4, 32 and 512
  rows; a row's bits are the same alone and in a batch, and the portable build (plain
  x86-64-v2), the AVX2 build (x86-64-v3) and the AVX-VNNI one (no AVX-512) give the native
  build's bits (on an AVX-512 VNNI host, the 512-bit path's).
* The test encoder (tests/helpers/kquant_encode.py) writes blocks that decode to near the floats.

The C++ extension is built on first use; if it cannot be built these tests fail, they do not skip.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from sluice.engine.models import kquant
from sluice.kernels import cpu_ext, cpu_kquant
from tests.helpers.kquant_encode import encode

FORMATS = kquant.KQUANT_TYPES
# byte offsets of each block's float16 scales
_HALVES = {"Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0], "Q3_K": [108], "Q2_K": [80, 82]}


@pytest.fixture(scope="module")
def ops():
    assert cpu_ext.available(), f"the C++ CPU kernels did not build: {cpu_ext.unavailable_reason()}"
    return cpu_ext.module()


def random_blocks(kind: str, n: int, k: int, seed: int, scale: float = 0.01) -> np.ndarray:
    """[n, bytes per row] of random blocks with finite, positive float16 scales."""
    per, size = kquant._BLOCK[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for at in _HALVES[kind]:
        halves = (rng.random((n, k // per)) * scale + scale / 10).astype(np.float16)
        raw[..., at:at + 2] = halves.view(np.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


def weight(kind: str, n: int, k: int, seed: int) -> tuple[kquant.KQuantLinear, torch.Tensor]:
    raw = random_blocks(kind, n, k, seed)
    return kquant.KQuantLinear.from_gguf(kind, torch.from_numpy(raw), (n, k)), torch.from_numpy(dequantize(raw, T[kind]))


# ---- decoding ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", FORMATS)
def test_random_blocks_decode_to_ggufs_values_bit_for_bit(ops, kind):
    n, k = 37, 768                     # 37: a partial row tile; 768: three super-blocks
    w, want = weight(kind, n, k, seed=1)
    assert torch.equal(w.dequantize(), want)
    ids = torch.tensor([0, 36, 15, 16, 36])
    assert torch.equal(w.rows(ids), want[ids])
    parts = w.parts()
    assert all(torch.equal(a, b) for a, b in zip(parts, kquant.gguf_parts(kind, torch.from_numpy(
        random_blocks(kind, n, k, seed=1)), (n, k))) if a is not None)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1"])
def test_ggufs_own_q5_blocks_decode_bit_for_bit(ops, kind):
    import gguf

    x = np.random.default_rng(2).standard_normal((20, 96)).astype(np.float32)
    raw = gguf.quants.quantize(x, T[kind])
    w = kquant.KQuantLinear.from_gguf(kind, torch.from_numpy(raw), (20, 96))
    assert torch.equal(w.dequantize(), torch.from_numpy(dequantize(raw, T[kind])))


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"])
def test_the_test_encoder_writes_blocks_close_to_the_floats(kind):
    x = np.random.default_rng(3).standard_normal((32, 512)).astype(np.float32)
    back = dequantize(encode(x, kind), T[kind])
    rms = float(np.sqrt(((back - x) ** 2).mean()))
    bound = {"Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025, "Q5_0": 0.05, "Q5_1": 0.05, "IQ4_NL": 0.1, "IQ4_XS": 0.1}
    assert rms < bound[kind], rms


# ---- products ---------------------------------------------------------------------------------------
def _inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) * torch.linspace(0.1, 3.0, k)      # channels of unequal size


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("rows", [1, 4, 32, 512])
def test_product_matches_its_reference_and_the_float_product(ops, kind, rows):
    n, k = 40, 512
    w, dense = weight(kind, n, k, seed=rows)
    x = _inputs(rows, k, seed=100 + rows)
    got = w(x)
    want = kquant.kquant_linear_ref(x, w)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    exact = x.double() @ dense.double().t()
    # int8 rounding of the input (per 256 for the formats with sub-block scales, per 32 for the
    # others) costs what it should: close to the float product.
    assert (got.double() - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("kind", FORMATS)
def test_a_rows_bits_do_not_depend_on_the_batch_or_threads(ops, kind):
    w, _ = weight(kind, 50, 512, seed=4)
    x = _inputs(37, 512, seed=5)
    full = w(x)
    for i in (0, 1, 36):
        assert torch.equal(w(x[i:i + 1].contiguous())[0], full[i])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert torch.equal(w(x), full)
    finally:
        torch.set_num_threads(threads)


_AVX2 = {"avx2", "fma", "f16c"}


def _native_isa(flags: set[str]) -> str:
    """The path -march=native compiles on a CPU with these /proc/cpuinfo flags."""
    if {"avx512f", "avx512bw", "avx512_vnni"} | _AVX2 <= flags:
        return "avx512vnni"
    if {"avx_vnni"} | _AVX2 <= flags:
        return "avxvnni"
    return "avx2" if _AVX2 <= flags else "portable"


def _same_products(other, rows_list=(1, 4, 11, 32, 512)):
    """``other`` (a build of the kernels) gives the native build's bits for every format, with a
    partial row tile (33) and row counts that leave a remainder after each path's rows per pass."""
    for kind in FORMATS:
        w, _ = weight(kind, 33, 512, seed=6)
        ids = torch.tensor([0, 32, 17])
        assert torch.equal(other.kquant_rows(ids, w.packed, w.type_id, 33, 512), w.rows(ids))
        for rows in rows_list:
            x = _inputs(rows, 512, seed=rows)
            assert torch.equal(other.kquant_linear(x, w.packed, w.type_id, 33), w(x)), (kind, rows)


def test_the_portable_build_computes_what_the_native_one_does(ops):
    """Plain x86-64-v2 (no AVX2): the same integer sums and fused multiply-adds as the vector
    paths, so the same bits, at 1 to 512 rows, with a partial row tile. The native build runs the
    widest path this CPU has."""
    portable = cpu_ext.portable_module()
    assert portable.kquant_isa() == "portable"
    assert ops.kquant_isa() == _native_isa(set(cpu_ext._cpu_flags().decode().split()))
    _same_products(portable)


@pytest.mark.parametrize("variant,needs", [("avx2", _AVX2), ("avxvnni", _AVX2 | {"avx_vnni"}),
                                           ("avxvnni_evex", _AVX2 | {"avx512_vnni", "avx512vl", "avx512bw"})])
def test_each_narrower_vector_path_computes_what_the_native_one_does(ops, variant, needs):
    """The AVX2 path (what AVX2-only CPUs such as AMD Zen 2/3 run) and the 256-bit AVX-VNNI one
    (CPUs with AVX-VNNI and no AVX-512), built here with the wider paths turned off: the same bits
    as the native build (on an AVX-512 VNNI host, the 512-bit path). Where the native build is
    that path already, it is the one compared with the portable build above. No CI host has
    AVX-VNNI without AVX-512, so "avxvnni_evex" runs that path's code on AVX-512 VNNI hosts, with
    the EVEX forms of its 256-bit instructions."""
    flags = set(cpu_ext._cpu_flags().decode().split())
    if not needs <= flags:
        pytest.skip(f"this CPU cannot run the {variant} path (needs {sorted(needs - flags)})")
    path = variant.removesuffix("_evex")
    if ops.kquant_isa() == path:
        pytest.skip(f"the native build is the {path} path")
    other = cpu_ext.variant_module(variant)
    assert other.kquant_isa() == path
    _same_products(other)


def test_stacked_parts_in_different_formats(ops):
    """A fused projection whose parts the file stores in different types: each part's product,
    side by side; the same as each alone."""
    q, _ = weight("Q4_K", 32, 256, seed=7)
    v, _ = weight("Q6_K", 16, 256, seed=8)
    from sluice.engine.models import quant

    o = quant.BlockQLinear.from_float(torch.randn(24, 256), 8)
    stacked = kquant.StackedLinear([q, v, o])
    x = _inputs(3, 256, seed=9)
    got = stacked(x)
    assert got.shape == (3, 72)
    assert torch.equal(got, torch.cat([q(x), v(x), o(x)], dim=1))
    assert torch.equal(stacked.dequantize(), torch.cat([q.dequantize(), v.dequantize(), o.dequantize()]))
    assert [p[0] for p in stacked.cpp_parts()] == [112, 114, 8]


# ---- errors -----------------------------------------------------------------------------------------
def test_bad_parts_and_inputs_are_refused_by_name(ops):
    w, _ = weight("Q4_K", 16, 256, seed=10)
    u, d, dm, sc, mn = w.parts()
    with pytest.raises(ValueError, match="Q4_K: K must be a multiple of 256, got 128"):
        kquant.KQuantLinear("Q4_K", u[:, :128], d, dm, sc, mn)
    with pytest.raises(ValueError, match="Q4_K: values must be uint8 in 0..15"):
        kquant.KQuantLinear("Q4_K", u | 16, d, dm, sc, mn)
    with pytest.raises(ValueError, match="6-bit"):
        kquant.KQuantLinear("Q4_K", u, d, dm, sc | 64, mn)
    with pytest.raises(ValueError, match="Q6_K: has no dm"):
        kquant.KQuantLinear("Q6_K", u, d, dm, None, None)
    with pytest.raises(ValueError, match="Q3_K: values must be uint8 in 0..7"):
        kquant.KQuantLinear("Q3_K", u | 8, d, None, torch.zeros(16, 16, dtype=torch.uint8), None)
    with pytest.raises(ValueError, match="Q2_K: values must be uint8 in 0..3"):
        kquant.KQuantLinear("Q2_K", u, d, dm, torch.zeros(16, 16, dtype=torch.uint8), torch.zeros(16, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="Q2_K: mn must be torch.uint8 \\(16, 16\\)"):
        kquant.KQuantLinear("Q2_K", u & 3, d, dm, torch.zeros(16, 16, dtype=torch.uint8), mn)
    with pytest.raises(ValueError, match="no K-quant format 'IQ3_S'"):
        kquant.KQuantLinear("IQ3_S", u, d, dm, sc, mn)
    with pytest.raises(RuntimeError, match="kquant: unknown format 21"):
        ops.kquant_linear(torch.randn(1, 256), w.packed, 21, 16)
    with pytest.raises(RuntimeError, match="kquant: packed weight does not match N = 32"):
        ops.kquant_linear(torch.randn(1, 256), w.packed, 12, 32)
    with pytest.raises(RuntimeError, match="kquant rows: id 16 is outside 0..15"):
        w.rows(torch.tensor([16]))
    with pytest.raises(ValueError, match="expected 256"):
        w(torch.randn(2, 3, 128))
    assert w(torch.randn(2, 3, 256)).shape == (2, 3, 16)


def test_packing_in_cpp_and_in_torch_a_slice_at_a_time_give_the_same_layout(ops, monkeypatch):
    monkeypatch.setattr(cpu_kquant, "_PACK_ROWS", 32)
    for kind in FORMATS:
        w, _ = weight(kind, 70, 256, seed=11)                    # packed in C++ (70: a partial tile)
        assert torch.equal(cpu_kquant.pack_ref(kind, *w.parts()), w.packed), kind


def test_from_gguf_in_one_cpp_pass_and_through_the_parts_give_the_same_layout(ops, monkeypatch):
    rng = np.random.default_rng(12)
    for kind in FORMATS:
        per, size = kquant._BLOCK[kind]
        # every byte random, the float16 scales too (NaN and infinity patterns included): the
        # layout copies their bits, whatever they are
        raw = torch.from_numpy(rng.integers(0, 256, (70, 512 // per * size), dtype=np.uint8))
        whole = kquant.KQuantLinear(kind, *kquant.gguf_parts(kind, raw, (70, 512)))
        direct = kquant.KQuantLinear.from_gguf(kind, raw, (70, 512))             # kquant_pack_gguf
        monkeypatch.setattr(cpu_kquant, "pack_gguf", lambda *args: None)         # as without the C++ build
        monkeypatch.setattr(cpu_kquant, "_PACK_ROWS", 32)
        sliced = kquant.KQuantLinear.from_gguf(kind, raw, (70, 512))
        monkeypatch.undo()
        assert torch.equal(direct.packed, whole.packed) and direct.kind == whole.kind, kind
        assert torch.equal(sliced.packed, whole.packed), kind
        with pytest.raises(ValueError, match=rf"{kind}: {raw.numel() - size} bytes do not hold a \[70, 512\] tensor"):
            kquant.KQuantLinear.from_gguf(kind, raw.reshape(-1)[size:], (70, 512))
        with pytest.raises(RuntimeError, match="do not hold"):
            ops.kquant_pack_gguf(raw.reshape(-1)[size:].contiguous(), cpu_kquant.FORMATS[kind].type_id, 70, 512)


def test_a_fused_projections_parts_pack_where_they_lie_as_their_concatenation_does(ops, monkeypatch):
    # q, k, v (or gate, up) in one format: packed from each part's bytes (kquant_pack_gguf_parts),
    # the same layout as the stacked rows', with the part boundaries inside a tile (20 + 37 + 13
    # rows), and through the parts where the C++ build is missing
    rng = np.random.default_rng(13)
    for kind in FORMATS:
        per, size = kquant._BLOCK[kind]
        parts = [torch.from_numpy(rng.integers(0, 256, (r, 512 // per * size), dtype=np.uint8)) for r in (20, 37, 13)]
        whole = kquant.KQuantLinear.from_gguf(kind, torch.cat(parts), (70, 512))
        stacked = kquant.KQuantLinear.from_gguf(kind, parts, (70, 512))
        assert torch.equal(stacked.packed, whole.packed), kind
        monkeypatch.setattr(cpu_kquant, "pack_gguf", lambda *args: None)
        assert torch.equal(kquant.KQuantLinear.from_gguf(kind, parts, (70, 512)).packed, whole.packed), kind
        monkeypatch.undo()
        with pytest.raises(ValueError, match=rf"{kind}: parts of \[20, 37, 13\] rows do not stack to a \[71, 512\] tensor"):
            kquant.KQuantLinear.from_gguf(kind, parts, (71, 512))
        with pytest.raises(RuntimeError, match="part 1 must be contiguous uint8"):
            ops.kquant_pack_gguf_parts([parts[0], parts[1][:, size:].contiguous()], cpu_kquant.FORMATS[kind].type_id, 512)
