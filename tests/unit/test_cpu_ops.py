"""sluice's C++ CPU kernels (kernels/cpu_blockq.cpp, kernels/cpu_ops.cpp) against their torch
references, on tiny random tensors.

* The block-quantized product (w4a8 / w8a8) equals its float64 reference (``linear_ref``: the
  same int8 rounding of the input, exact integer sums) to float32 rounding, and a row's bits are
  the same alone and among other rows; GGUF Q4_0 / Q4_1 / Q8_0 blocks become weights that
  dequantize to exactly what gguf's own ``dequantize`` gives.
* Each small op (RMSNorm, residual + RMSNorm, RoPE, SwiGLU, the KV store, paged decode attention,
  a draft tree's slot moves and its children's top-k probabilities) matches the torch code it
  replaces.
* The C++ layer stack (cpu_stack.cpp's DecoderStack) matches the Python layers on the tiny model, and a
  sequence's greedy tokens do not depend on the batch, the chunking or the prefix cache.

The extension is built on first use (about a minute on 2 cores, then cached): if it cannot be
built here, these tests fail with the reason, they do not skip.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from sluice.engine.attention.torch_backend import TorchAttentionBackend, store_kv
from sluice.engine.models import quant
from sluice.engine.models.rope import apply_rotary
from sluice.kernels import cpu_blockq, cpu_ext


@pytest.fixture(scope="module")
def ops():
    assert cpu_ext.available(), f"the C++ CPU kernels did not build: {cpu_ext.unavailable_reason()}"
    return cpu_ext.module()


def _weights(n: int, k: int, bits: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-4
    m = -torch.rand(n, k // 32, generator=g) * 0.1
    return u, d.half().float(), m.half().float()      # float16 values, as GGUF stores them


# ---- block-quantized products ---------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k,rows", [(16, 32, 1), (40, 96, 3), (200, 576, 13), (33, 64, 130)])
def test_block_product_matches_its_float64_reference(ops, bits, n, k, rows):
    u, d, m = _weights(n, k, bits, seed=n + k)
    w = quant.BlockQLinear(u, d, m, bits)
    # Seeded: with the suite's global generator a draw depended on the tests run before it, and one
    # (n 16, k 32, one row) rounded 2.3% off, over the bound below, in .ci/floors' order.
    g = torch.Generator().manual_seed(1000 + n + k + rows)
    x = torch.randn(rows, k, generator=g) * torch.linspace(0.1, 3.0, k)   # channels of unequal size
    got = w(x)
    want = quant.blockq_linear_ref(x, w)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # The weight it multiplies by is d u + m, as given (n not a multiple of the 16-row tile too).
    got_u, got_d, got_m = w.parts()
    assert torch.equal(got_u, u) and torch.equal(got_d, d) and torch.equal(got_m, m)
    # int8 rounding of the input costs what it should: close to the float product.
    exact = x.double() @ w.dequantize().double().t()
    assert (got.double() - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_bits_do_not_depend_on_the_batch(ops, bits):
    u, d, m = _weights(50, 192, bits, seed=3)
    w = quant.BlockQLinear(u, d, m, bits)
    x = torch.randn(37, 192)
    full = w(x)
    for i in (0, 8, 36):
        assert torch.equal(w(x[i:i + 1].contiguous())[0], full[i])
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        assert torch.equal(w(x), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind,bits", [(T.Q4_0, 4), (T.Q4_1, 4), (T.Q8_0, 8), (T.Q4_1, 8)])
def test_gguf_blocks_are_used_as_stored(ops, kind, bits):
    rng = np.random.default_rng(int(kind))
    w = (rng.standard_normal((48, 128)) * rng.uniform(0.01, 1.0, (48, 1)) + 0.1).astype(np.float32)
    blocks = torch.from_numpy(np.ascontiguousarray(quantize(w, kind)))
    want = torch.from_numpy(dequantize(blocks.numpy(), kind))
    parts = quant.block_parts(kind.name, blocks, (48, 128), bits)
    got = quant.BlockQLinear(*parts, bits).dequantize()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-7 * float(want.abs().max()))
    # An 8-bit tensor does not fit a 4-bit weight: the caller re-quantizes from floats instead.
    if kind == T.Q8_0:
        assert quant.block_parts("Q8_0", blocks, (48, 128), 4) is None


def _gguf_tensor(kind, n: int, k: int, seed: int) -> torch.Tensor:
    """gguf's own blocks of a random [n, k] weight, every float16 bit pattern of d around."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.001, 2.0, (n, 1)) + 0.1).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(quantize(w, kind)))


@pytest.mark.parametrize("bits", [4, 8])
def test_gguf_blocks_packed_in_one_pass_equal_the_parts_path(ops, bits):
    """``BlockQLinear.from_gguf`` (``cpu_blockq.cpp``'s blockq_pack_gguf, straight from the file's
    bytes) holds exactly what ``block_parts`` + ``BlockQLinear`` hold, for each type alone and for
    a fused projection whose parts differ in type, with a partial last tile of 16 rows."""
    kinds = [T.Q4_0, T.Q4_1] + ([T.Q8_0] if bits == 8 else [])
    stacks = [[(kind, 37)] for kind in kinds] + [[(kind, rows) for kind, rows in zip(kinds, (21, 5, 18))]]
    for stack in stacks:
        parts = [(kind.name, _gguf_tensor(kind, rows, 96, seed=i + rows)) for i, (kind, rows) in enumerate(stack)]
        got = quant.BlockQLinear.from_gguf(parts, bits, 96)
        pieces = [quant.block_parts(kind, b, (b.shape[0], 96), bits) for kind, b in parts]
        want = quant.BlockQLinear(*[torch.cat(p) for p in zip(*pieces)], bits)
        assert (got.out_features, got.in_features, got.bits) == (want.out_features, 96, bits)
        for name in ("packed", "d", "m"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (stack, name)
        x = torch.randn(3, 96)
        assert torch.equal(got(x), want(x))


def test_a_projection_mixing_file_blocks_and_rounded_floats_stacks_them(ops):
    """w4a8 with a Q4_1 q and a Q8_0 v (rounded to 4 bits from float): the loader's ``_stack`` holds
    the file's blocks and the rounded part in one 4-bit weight, as the (u, d, m) path would."""
    from sluice.engine.loaders import quantized

    q = _gguf_tensor(T.Q4_1, 24, 64, seed=7)
    v = torch.randn(8, 64) * 0.1
    got = quantized._stack([(4, quantized._GgufBlocks("Q4_1", q)), (4, quant.float_to_block(v, 4))])
    want = quant.BlockQLinear(*[torch.cat(p) for p in zip(quant.block_parts("Q4_1", q, (24, 64), 4),
                                                               quant.float_to_block(v, 4))], 4)
    assert isinstance(got, quant.BlockQLinear) and got.out_features == 32
    assert all(torch.equal(getattr(got, name), getattr(want, name)) for name in ("packed", "d", "m"))


def test_gguf_block_packing_refuses_what_it_cannot_hold(ops):
    q8 = _gguf_tensor(T.Q8_0, 16, 64, seed=3)
    with pytest.raises(RuntimeError, match="Q8_0 blocks do not fit 4-bit blocks"):
        quant.BlockQLinear.from_gguf([("Q8_0", q8)], 4, 64)
    with pytest.raises(RuntimeError, match=r"part 0 must be contiguous uint8 \[rows, 34\] \(GGML type 8, K = 32\)"):
        quant.BlockQLinear.from_gguf([("Q8_0", q8)], 8, 32)
    with pytest.raises(ValueError, match="not one of"):
        quant.BlockQLinear.from_gguf([("Q5_0", q8)], 8, 64)
    # Q8_0's offset is -128 d: a d past 65504 / 128 has none in float16, as with the parts path.
    big = q8.clone()
    big.view(16, 2, 34)[0, 0, 0:2] = torch.tensor([1000.0], dtype=torch.float16).view(torch.uint8)
    with pytest.raises(ValueError, match="must be float16 values"):
        quant.BlockQLinear.from_gguf([("Q8_0", big)], 8, 64)


@pytest.mark.parametrize("bits", [4, 8])
def test_weight_rows_are_the_dequantized_rows(ops, bits):
    """A tied block LM head serves the embedding's lookups (``TiedBlockEmbedding``)."""
    w = quant.BlockQLinear.from_float(torch.randn(70, 96), bits)   # 70: the last tile is partial
    ids = torch.tensor([[0, 15, 16], [69, 3, 3]])
    assert torch.equal(w.rows(ids.flatten()), w.dequantize()[ids.flatten()])
    assert torch.equal(w.rows(ids.flatten()), w.rows_ref(ids.flatten()))     # the kernel = torch ops
    assert w.rows(torch.zeros(0, dtype=torch.long)).shape == (0, 96)
    for bad in (70, -1):   # past the last row (inside the last tile's padding) and negative
        with pytest.raises(RuntimeError, match=f"blockq rows: id {bad} is outside 0..69"):
            w.rows(torch.tensor([3, bad]))
    emb = quant.TiedBlockEmbedding(w)
    assert emb(ids).shape == (2, 3, 96) and torch.equal(emb(ids)[1, 0], w.dequantize()[69])


def test_float_weights_quantize_per_block(ops):
    w = torch.randn(32, 64) * 0.05
    for bits, tol in ((8, 1 / 254), (4, 1 / 30)):
        q = quant.BlockQLinear.from_float(w, bits).dequantize()
        span = w.view(32, 2, 32).abs().amax(-1, keepdim=True) * 2
        assert ((q - w).view(32, 2, 32).abs() <= tol * span + 1e-7).all(), bits


def test_bad_block_inputs_are_clear_errors(ops):
    u, d, m = _weights(16, 64, 4, seed=1)
    with pytest.raises(ValueError, match="values must lie in 0..15"):
        quant.BlockQLinear(u * 0 + 16, d, m, 4)
    with pytest.raises(ValueError, match="K a multiple of 32"):
        quant.BlockQLinear(u[:, :40], d, m, 4)
    w = quant.BlockQLinear(u, d, m, 4)
    with pytest.raises(ValueError, match="input has 32 features, expected 64"):
        w(torch.randn(2, 1, 32))
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        cpu_blockq.linear(torch.randn(1, 48), w.packed, w.d, w.m, 4, 16)
    # Scales are held as float16: one that is not a float16 value is refused, not rounded.
    with pytest.raises(ValueError, match="must be float16 values"):
        quant.BlockQLinear(u, d + 1e-7, m, 4)
    with pytest.raises(RuntimeError, match="scales must be contiguous float16"):
        cpu_blockq.linear(torch.randn(1, 64), w.packed, w.d.float(), w.m, 4, 16)
    with pytest.raises(ValueError, match="beyond float16's range"):
        quant.BlockQLinear.from_float(torch.full((16, 32), 1e6), 4)


def _native_isa() -> str:
    """The block product's path that -march=native must compile on this CPU."""
    flags = set(cpu_ext._cpu_flags().decode().split())
    if {"avx512f", "avx512bw", "avx512_vnni"} <= flags:
        return "avx512vnni"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else "portable"


def test_the_portable_build_computes_what_the_native_one_does(ops):
    """The same sources for plain x86-64-v2 (no AVX2, no AVX-512): block products bit for bit
    with the native build's vector path (AVX512-VNNI or AVX2: the same integer sums and fused
    multiply-adds), at every row count of the vector tiles and with partial output tiles; the
    other ops to rounding."""
    import platform

    assert platform.machine() in ("x86_64", "AMD64"), "this build check is written for x86-64"
    assert ops.blockq_isa() == _native_isa() == cpu_blockq.isa()
    portable = cpu_ext.portable_module()
    assert portable.blockq_isa() == "portable"
    g = torch.Generator().manual_seed(5)
    for bits in (4, 8):
        for n in (40, 33):
            u, d, m = _weights(n, 96, bits, seed=bits + n)
            w = quant.BlockQLinear(u, d, m, bits)
            ids = torch.tensor([0, n - 1, 17])
            assert torch.equal(portable.blockq_rows(ids, w.packed, w.d, w.m, bits, n, 96), w.rows(ids))
            for rows in (1, 2, 3, 4, 7, 9):
                x = torch.randn(rows, 96, generator=g) * 3
                assert torch.equal(portable.blockq_linear(x, w.packed, w.d, w.m, bits, n), w(x)), (bits, n, rows)
    x, wn = torch.randn(5, 64), torch.randn(64)
    torch.testing.assert_close(portable.rms_norm(x, wn, 1e-5), ops.rms_norm(x, wn, 1e-5))
    kc, vc = _cache(blocks=16, block_size=4, kv_heads=3, dim=64)
    tables = torch.tensor([[3, 9, 1, 0], [2, 15, 4, 11]], dtype=torch.int32)
    lens = torch.tensor([10, 16], dtype=torch.int32)
    q = torch.randn(2, 9, 64)
    torch.testing.assert_close(portable.paged_decode(q, kc, vc, tables, lens, 0.125),
                               ops.paged_decode(q, kc, vc, tables, lens, 0.125), rtol=1e-5, atol=1e-6)
    gu = torch.randn(3, 2 * 40, generator=g) * 8
    torch.testing.assert_close(portable.silu_mul(gu), ops.silu_mul(gu))
    logits = torch.randint(-3, 4, (4, 37), generator=g).float()
    logits[1, 20] = float("nan")
    assert torch.equal(portable.argmax_rows(logits), ops.argmax_rows(logits))
    logits = torch.randn(4, 50, generator=g)
    for got, want in zip(portable.top_probs(logits, 3), ops.top_probs(logits, 3)):
        torch.testing.assert_close(got, want)


# ---- the small ops ---------------------------------------------------------------------------------
def test_norms_rope_and_swiglu_match_torch(ops):
    x, w = torch.randn(7, 96), torch.randn(96)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (96,), w, 1e-5))
    delta = torch.randn(7, 96)
    total, normed = ops.add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, F.rms_norm(x + delta, (96,), w, 1e-6))
    # RoPE on a strided view (the Q/K part of a fused projection), cos/sin [T, 1, D/2].
    qkv = torch.randn(5, 12 * 16)
    qk = qkv[:, :8 * 16].view(5, 8, 16)
    cos, sin = torch.randn(5, 1, 8), torch.randn(5, 1, 8)
    torch.testing.assert_close(ops.rotary(qk, cos, sin), apply_rotary(qk, cos, sin))
    # SiLU: 16 lanes at a time and a scalar tail (40 = 2 * 16 + 8), both signs, and gates far
    # enough out that a naive e^-g would overflow.
    gu = torch.randn(4, 2 * 40) * 8
    gu[0, :6] = torch.tensor([-200.0, -90.0, -1e-8, 0.0, 90.0, 200.0])
    gu[1, 34:40] = gu[0, :6]
    torch.testing.assert_close(ops.silu_mul(gu), F.silu(gu[:, :40]) * gu[:, 40:])


@pytest.mark.parametrize("n, k", [(1, 1), (7, 3), (40, 5), (8192, 3), (33, 33)])
def test_top_probs_are_softmax_then_topk(ops, n, k):
    g = torch.Generator().manual_seed(n + k)
    logits = torch.randn(4, n, generator=g) * 5
    probs, idx = ops.top_probs(logits, k)
    want = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    assert torch.equal(idx, want.indices)
    torch.testing.assert_close(probs, want.values, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n", [1, 5, 16, 37, 49152])
def test_argmax_rows_is_torchs_argmax(ops, n):
    """First maximum per row, ties and -inf rows included, a NaN's index where a row has one,
    in the 16-lane part and the tail alike."""
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-3, 4, (8, n), generator=g).float()         # many ties
    x[1] = -float("inf")
    x[2, -1] = 100.0                                                 # the maximum in the tail
    x[3, n // 2] = float("nan")
    x[4, :] = torch.randn(n, generator=g)
    x[5, 0] = float("inf")
    x[6, -1] = float("nan")
    x[6, 0] = 1e9
    assert ops.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()


def test_top_probs_ties_go_to_the_earlier_token_and_bad_k_is_refused(ops):
    logits = torch.tensor([[1.0, 3.0, 3.0, -float("inf"), 3.0, 0.0]])
    probs, idx = ops.top_probs(logits, 4)
    assert idx.tolist() == [[1, 2, 4, 0]]
    torch.testing.assert_close(probs, torch.softmax(logits, -1)[:, [1, 2, 4, 0]])
    assert ops.top_probs(torch.full((1, 3), -float("inf")).clamp_min(-1e30), 3)[1].tolist() == [[0, 1, 2]]
    with pytest.raises(RuntimeError, match=r"top_probs: k must be in \[1, 6\], got 7"):
        ops.top_probs(logits, 7)


def test_move_slots_copies_in_order_in_every_cache(ops):
    """A draft tree's accepted nodes move to a chain's slots, in order (a later move may read what
    an earlier one wrote), in every layer's K and V, float32 or float16."""
    caches = [torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8).half()]
    want = [c.clone() for c in caches]
    moves = [(5, 1), (1, 2), (11, 3)]
    for c in want:
        flat = c.view(-1, 2, 8)
        for a, b in moves:
            flat[b] = flat[a]
    ops.move_slots(caches, torch.tensor([a for a, _b in moves]), torch.tensor([b for _a, b in moves]))
    for got, ref in zip(caches, want):
        assert torch.equal(got, ref)
    with pytest.raises(RuntimeError, match="move_slots: slot outside the cache"):
        ops.move_slots(caches, torch.tensor([12]), torch.tensor([0]))


def _cache(blocks=12, block_size=4, kv_heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(blocks, block_size, kv_heads, dim, generator=g),
            torch.randn(blocks, block_size, kv_heads, dim, generator=g))


def test_store_kv_matches_torch(ops):
    ours, ref = _cache(), _cache()
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([5, 0, 47])
    ops.store_kv(k, v, ours[0], ours[1], slots)
    store_kv(k, v, ref, slots)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.store_kv(k, v, ours[0], ours[1], torch.tensor([5, 0, 48]))


# (KV heads, query heads per KV head, head size): the tiled kernels (head sizes 16 x 2 .. 8 and 256)
# with one pass of values for the whole group and with several (8 heads at 64: two passes of 4;
# 5 at 80: 3 and 2; 3 at 128: 2 and 1; 6 at 96), and the general loops (head size 16).
_SHAPES = [(3, 3, 64), (2, 2, 128), (1, 4, 64), (2, 1, 64), (1, 8, 64), (2, 5, 80), (2, 3, 128),
           (2, 6, 96), (1, 2, 256), (2, 3, 16)]


@pytest.mark.parametrize("kv_heads,group,dim", _SHAPES)
def test_paged_decode_matches_sdpa_per_sequence(ops, kv_heads, group, dim):
    kc, vc = _cache(blocks=16, block_size=4, kv_heads=kv_heads, dim=dim)
    # Three sequences over scattered blocks.
    tables = torch.tensor([[3, 9, 1, 0], [7, 0, 0, 0], [2, 15, 4, 11]], dtype=torch.int32)
    lens = torch.tensor([10, 1, 16], dtype=torch.int32)
    q = torch.randn(3, kv_heads * group, dim)
    got = ops.paged_decode(q, kc, vc, tables, lens, dim ** -0.5)
    want = TorchAttentionBackend._decode(q, (kc, vc), tables, lens, 16, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    alone = ops.paged_decode(q[2:].contiguous(), kc, vc, tables[2:], lens[2:], dim ** -0.5)
    assert torch.equal(alone[0], got[2])
    with pytest.raises(RuntimeError, match="does not fit the block table"):
        ops.paged_decode(q, kc, vc, tables, torch.tensor([10, 1, 17], dtype=torch.int32), 0.25)


@pytest.mark.parametrize("kv_heads,group,dim", [(3, 3, 64), (2, 5, 64), (2, 3, 16)])
@pytest.mark.parametrize("length", [10, 300])      # one chunk; the tail in the second of two
def test_a_draft_tree_row_attends_as_the_same_tokens_in_a_plain_sequence(ops, kv_heads, group, dim, length):
    """A tree row reads its tokens from tail_start on at explicit slots (its ancestors and itself,
    wherever the step wrote them): its result is bit for bit that of a plain sequence holding
    the same tokens in order, and rows without a tail are untouched."""
    kc, vc = _cache(blocks=200, block_size=4, kv_heads=kv_heads, dim=dim, seed=5)
    g = torch.Generator().manual_seed(2)
    plain = torch.randperm(100, generator=g).to(torch.int32)             # a sequence's table
    flat_k, flat_v = kc.view(-1, kv_heads, dim), vc.view(-1, kv_heads, dim)
    start, depth = length - 3, 3
    # The tree row's last three tokens live at scattered slots of blocks 100-199, holding copies.
    scattered = (400 + torch.randperm(400, generator=g)[:depth]).long()
    for j in range(depth):
        t = start + j
        src = int(plain[t // 4]) * 4 + t % 4
        flat_k[scattered[j]], flat_v[scattered[j]] = flat_k[src], flat_v[src]
    # The tree row's own table: the plain one up to the tail, nothing valid after it.
    tree_table = plain.clone()
    tree_table[(start + 3) // 4 + 1:] = 199
    tables = torch.stack([plain, tree_table])
    lens = torch.tensor([length, length], dtype=torch.int32)
    tail_start = torch.tensor([length, start], dtype=torch.int32)        # row 0: no tail
    tail_slots = torch.zeros(2, 4, dtype=torch.int64)
    tail_slots[1, :depth] = scattered
    q = torch.randn(1, kv_heads * group, dim, generator=g).expand(2, -1, -1).contiguous()
    got = ops.paged_decode(q, kc, vc, tables, lens, dim ** -0.5, tail_start, tail_slots)
    assert torch.equal(got[1], got[0])
    assert torch.equal(got[0], ops.paged_decode(q[:1], kc, vc, tables[:1], lens[:1], dim ** -0.5)[0])
    # The tree row does read the tail: pointed elsewhere, it changes.
    moved = tail_slots.clone()
    moved[1, depth - 1] = scattered[0]
    assert not torch.equal(ops.paged_decode(q, kc, vc, tables, lens, dim ** -0.5, tail_start, moved)[1], got[0])
    with pytest.raises(RuntimeError, match="outside the cache"):
        bad = tail_slots.clone()
        bad[1, 0] = 200 * 4
        ops.paged_decode(q, kc, vc, tables, lens, dim ** -0.5, tail_start, bad)
    with pytest.raises(RuntimeError, match="does not fit tail_slots"):
        ops.paged_decode(q, kc, vc, tables, lens, dim ** -0.5, torch.tensor([length, start - 2], dtype=torch.int32),
                         tail_slots[:, :3].contiguous())
    with pytest.raises(RuntimeError, match="go together"):
        ops.paged_decode(q, kc, vc, tables, lens, dim ** -0.5, tail_start, None)


@pytest.mark.parametrize("kv_heads,group,dim", [(2, 2, 128), (1, 4, 64), (2, 5, 64), (2, 3, 16)])
def test_soft_capped_scores_match_the_torch_backend(ops, kv_heads, group, dim):
    """Gemma 2's attention soft-cap (scores -> cap * tanh(score / cap) before the softmax), in the
    tiled kernels and the general loops, one chunk and several, with and without a window:
    the torch backend's capped ``_short`` per row, a row's bits the same alone, and not the
    uncapped result."""
    kc, vc = _cache(blocks=120, block_size=4, kv_heads=kv_heads, dim=dim, seed=5)
    g = torch.Generator().manual_seed(2)
    tables = torch.stack([torch.randperm(120, generator=g)[:100] for _ in range(3)]).to(torch.int32)
    lens = torch.tensor([9, 300, 1], dtype=torch.int32)                  # 1, 2 and 1 chunks
    q = 3 * torch.randn(3, kv_heads * group, dim, generator=g)           # scores large enough to bend
    cap, scale = 2.0, dim ** -0.5
    for window in (0, 7):
        got = ops.paged_decode(q, kc, vc, tables, lens, scale, window=window, softcap=cap)
        for b in range(3):
            want = TorchAttentionBackend._short(q[b:b + 1], (kc, vc), tables[b], int(lens[b]), scale,
                                                window=window or None, softcap=cap)
            torch.testing.assert_close(got[b:b + 1], want, rtol=1e-5, atol=1e-5)
            alone = ops.paged_decode(q[b:b + 1].contiguous(), kc, vc, tables[b:b + 1], lens[b:b + 1], scale,
                                     window=window, softcap=cap)
            assert torch.equal(alone[0], got[b])
        assert not torch.allclose(got, ops.paged_decode(q, kc, vc, tables, lens, scale, window=window), atol=1e-3)
        torch.testing.assert_close(cpu_ext.portable_module().paged_decode(q, kc, vc, tables, lens, scale, window=window,
                                                                          softcap=cap), got, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match=r"paged_decode: softcap must be >= 0 \(0: none\), got -1"):
        ops.paged_decode(q, kc, vc, tables, lens, scale, softcap=-1.0)


@pytest.mark.parametrize("kv_heads,group,dim", [(3, 3, 64), (2, 5, 64)])
def test_long_rows_attend_in_chunks_that_merge_to_sdpa(ops, kv_heads, group, dim):
    """Rows past 256 tokens attend in chunks of 256 merged afterwards (so one long sequence keeps
    both threads busy): the result is SDPA's, a row's bits are the same alone and in any batch,
    and a one-chunk row beside long ones is computed as before."""
    kc, vc = _cache(blocks=300, block_size=4, kv_heads=kv_heads, dim=dim, seed=3)
    g = torch.Generator().manual_seed(1)
    tables = torch.stack([torch.randperm(300, generator=g)[:200] for _ in range(4)]).to(torch.int32)
    lens = torch.tensor([257, 800, 3, 512], dtype=torch.int32)      # 2, 4, 1 and 2 chunks
    q = torch.randn(4, kv_heads * group, dim, generator=g)
    got = ops.paged_decode(q, kc, vc, tables, lens, dim ** -0.5)
    want = TorchAttentionBackend._decode(q, (kc, vc), tables, lens, 800, dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for i in range(4):
        alone = ops.paged_decode(q[i:i + 1].contiguous(), kc, vc, tables[i:i + 1], lens[i:i + 1], dim ** -0.5)
        assert torch.equal(alone[0], got[i]), i
    # The short row's result is the unchunked one: that of a batch with no long row in it.
    short = ops.paged_decode(q[2:3].contiguous(), kc, vc, tables[2:3], lens[2:3], dim ** -0.5)
    assert torch.equal(short[0], got[2])
    portable = cpu_ext.portable_module()
    torch.testing.assert_close(portable.paged_decode(q, kc, vc, tables, lens, dim ** -0.5), got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads,group,dim", [(1, 8, 64), (2, 3, 128), (2, 5, 80)])
def test_the_avx2_build_attends_as_the_native_one(ops, kv_heads, group, dim):
    """The 256-bit build (what AVX2-only CPUs run) sums a tile's 16 scores with shuffles of its
    own: SDPA's attention and the native build's, within float32 rounding, on rows of 1 to 300
    tokens (tiles of 16 with short tails; one chunk and two), over float32 and float16 caches."""
    if not {"avx2", "fma", "f16c"} <= set(cpu_ext._cpu_flags().decode().split()):
        pytest.skip("this CPU cannot run the AVX2 build")
    avx2 = cpu_ext.variant_module("avx2")
    kc, vc = _cache(blocks=300, block_size=4, kv_heads=kv_heads, dim=dim, seed=4)
    g = torch.Generator().manual_seed(3)
    tables = torch.stack([torch.randperm(300, generator=g)[:80] for _ in range(5)]).to(torch.int32)
    lens = torch.tensor([1, 15, 17, 100, 300], dtype=torch.int32)
    q = torch.randn(5, kv_heads * group, dim, generator=g)
    want = TorchAttentionBackend._decode(q, (kc, vc), tables, lens, 300, dim ** -0.5)
    for k, v in ((kc, vc), (kc.half(), vc.half())):
        got = avx2.paged_decode(q, k, v, tables, lens, dim ** -0.5)
        torch.testing.assert_close(got, ops.paged_decode(q, k, v, tables, lens, dim ** -0.5), rtol=1e-5, atol=1e-5)
        if k.dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads,group,dim", [(3, 3, 64), (2, 5, 64), (2, 3, 16)])
def test_a_float16_cache_stores_as_torch_rounds_and_attends_as_its_float32_values(ops, kv_heads, group, dim):
    """kv_cache_dtype=float16: store_kv rounds as torch's .to(float16) does, and attention over
    the float16 cache equals, bit for bit, attention over a float32 cache of the same values (the
    values are widened exactly), for the tiled kernels and the general loops, short and long
    rows; the portable build agrees."""
    kc32, vc32 = _cache(blocks=300, block_size=4, kv_heads=kv_heads, dim=dim, seed=5)
    kc, vc = kc32.half(), vc32.half()
    k, v = torch.randn(3, kv_heads, dim) * 4, torch.randn(3, kv_heads, dim) * 4
    slots = torch.tensor([5, 0, 1199])
    ops.store_kv(k, v, kc, vc, slots)
    ref = (kc32.half().clone(), vc32.half().clone())
    store_kv(k, v, ref, slots)
    assert torch.equal(kc, ref[0]) and torch.equal(vc, ref[1])
    g = torch.Generator().manual_seed(2)
    tables = torch.stack([torch.randperm(300, generator=g)[:200] for _ in range(3)]).to(torch.int32)
    lens = torch.tensor([700, 5, 256], dtype=torch.int32)
    q = torch.randn(3, kv_heads * group, dim, generator=g)
    got = ops.paged_decode(q, kc, vc, tables, lens, dim ** -0.5)
    assert torch.equal(got, ops.paged_decode(q, kc.float(), vc.float(), tables, lens, dim ** -0.5))
    # The portable build sums in another order than the vector one (AVX-512 or AVX2): to rounding.
    torch.testing.assert_close(cpu_ext.portable_module().paged_decode(q, kc, vc, tables, lens, dim ** -0.5), got,
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="differ in dtype or shape"):
        ops.paged_decode(q, kc, vc.float(), tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="float32 or float16"):
        ops.store_kv(k, v, kc.bfloat16(), vc.bfloat16(), slots)


# ---- the whole decode step -------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["w4a8", "none"])
def tiny_cpp(request, tiny_smollm2):
    """The tiny model in a format whose layers run in C++: block-quantized (w4a8) and float32
    packed for oneDNN (none)."""
    from sluice.engine.loaders import load_model

    return load_model(str(tiny_smollm2), quantization=request.param)


def test_a_sequences_tokens_depend_on_nothing_else(ops, tiny_cpp):
    """Through the C++ layers every row attends over its own prefix: greedy tokens are the same
    alone, in a batch, prefilled in small chunks beside decodes, and after a prefix-cache hit."""
    from sluice.engine.llm import LLM
    from sluice.engine.sampling_params import SamplingParams

    prompts = ["hello there " * 6, "a b c d e f g", "x", "hello there " * 4 + "friend"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(batch, **options):
        llm = LLM(loaded=tiny_cpp, quantization=tiny_cpp.quantization, kv_cache_memory_bytes=8 << 20, **options)
        return [r.outputs[0].token_ids for r in llm.generate(batch, params)], llm

    batched, llm = run(prompts)
    assert tiny_cpp.model._cpu_decoder() is not None, "the C++ layers were not used"
    alone = [run([p])[0][0] for p in prompts]
    assert alone == batched
    chunked, _ = run(prompts, max_num_batched_tokens=16)
    assert chunked == batched
    # The same engine again: the shared prefixes now come from its prefix cache.
    again = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    assert again == batched


def _plain_forward(model, *args):
    """The model's Python layers with plain torch ops (F.rms_norm, apply_rotary, SDPA)."""
    from sluice.engine.models.layer_stack import PythonLayers

    decoder, model._decoder = model._decoder, PythonLayers()
    try:
        return model(*args)
    finally:
        model._decoder = decoder


def test_the_stack_pads_rows_to_the_python_layers_buckets(ops):
    # The engine's warm-up compiles oneDNN's primitives for cpu_linear.row_bucket's row counts; the
    # C++ stack must run its float32 products at exactly those, or every other count compiles anew.
    from sluice.engine.models.cpu_linear import row_bucket

    assert [ops.row_bucket(r) for r in range(1, 9000)] == [row_bucket(r) for r in range(1, 9000)]


def test_cpu_layers_match_the_torch_layers(ops, tiny_cpp):
    """A mixed step (a prefill chunk after cached context, beside a decode row) and a decode step
    through the C++ DecoderStack against the Python layers: equal up to float32 rounding (amplified a
    little where it moves an int8 rounding of an activation), and the caches written alike."""
    _layers_match(tiny_cpp.model)


@pytest.mark.parametrize("quantization", ["w4a8", "none"])
def test_cpu_layers_add_qwen2_style_biases_as_the_torch_layers_do(ops, tiny_smollm2, quantization):
    from sluice.engine.loaders import load_model

    model = load_model(str(tiny_smollm2), quantization=quantization).model
    g = torch.Generator().manual_seed(7)
    for layer in model.layers:
        qkv = layer.self_attn.qkv_proj
        qkv.bias = torch.nn.Parameter(torch.randn(qkv.out_features, generator=g) * 0.5, requires_grad=False)
    _layers_match(model)
    # A bias of the wrong size is refused by the stack, not read past its end.
    model.layers[0].self_attn.qkv_proj.bias = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    model._decoder = None
    with pytest.raises(RuntimeError, match="bias must be a contiguous float32"):
        model._cpu_decoder()


def _layers_match(model):
    from sluice.engine.attention.base import AttentionMetadata

    arch = model.arch
    assert model._cpu_decoder() is not None
    caches = [_cache(blocks=4, block_size=16, kv_heads=arch.num_key_value_heads, dim=arch.head_dim, seed=i)
              for i in range(arch.num_hidden_layers)]
    plain = [(k.clone(), v.clone()) for k, v in caches]
    steps = [
        # sequence 0: 3 new tokens after 9 cached (positions 9..11); sequence 1: decodes position 19
        (AttentionMetadata(
            slot_mapping=torch.tensor([9, 10, 11, 16 + 3]), query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
            seq_lens=torch.tensor([12, 20], dtype=torch.int32), context_lens=torch.tensor([9, 19], dtype=torch.int32),
            block_tables=torch.tensor([[0, 3], [2, 1]], dtype=torch.int32), block_size=16, max_query_len=3,
            max_seq_len=20, query_lens_cpu=(3, 1), seq_lens_cpu=(12, 20)),
         torch.tensor([5, 6, 7, 17]), torch.tensor([9, 10, 11, 19])),
        (AttentionMetadata(
            slot_mapping=torch.tensor([12, 16 + 4]), query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
            seq_lens=torch.tensor([13, 21], dtype=torch.int32), context_lens=torch.tensor([12, 20], dtype=torch.int32),
            block_tables=torch.tensor([[0, 3], [2, 1]], dtype=torch.int32), block_size=16, max_query_len=1,
            max_seq_len=21, query_lens_cpu=(1, 1), seq_lens_cpu=(13, 21)),
         torch.tensor([8, 18]), torch.tensor([12, 20])),
    ]
    for meta, ids, pos in steps:
        got = model(ids, pos, caches, meta, TorchAttentionBackend())
        want = _plain_forward(model, ids, pos, plain, meta, TorchAttentionBackend())
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        for (k, v), (pk, pv) in zip(caches, plain):
            torch.testing.assert_close(k, pk, rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(v, pv, rtol=2e-3, atol=2e-3)
