"""Benchmark the Triton kernels against torch baselines at serving shapes.

    python bench/kernels.py [--quick]

On CUDA: times each kernel and its baseline with ``triton.testing.do_bench`` (which flushes L2
between runs) and prints µs, achieved GB/s or TFLOP/s and the share of the device's peak.
Without CUDA: checks every kernel against its torch reference at a tiny shape under the Triton
interpreter, says that timing needs a GPU, and exits 0.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton decorates the kernels
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import kernels as K  # noqa: E402

# Peak dense bf16 tensor TFLOP/s and HBM GB/s, from the vendors' datasheets (SXM parts).
PEAKS = {"H200": (989.0, 4800.0), "H100": (989.0, 3350.0), "A100": (312.0, 2039.0), "L4": (121.0, 300.0)}
HEAD_DIM, KV_HEADS, GROUP, BLOCK = 128, 8, 8, 16


def peak_for(name: str) -> tuple[float, float] | None:
    return next((v for k, v in PEAKS.items() if k in name.upper()), None)


def _pct(value: float, peak: float | None) -> str:
    return "n/a" if peak is None else f"{100 * value / peak:.0f}%"


def _paged(batch: int, ctx: int, q_len: int, dtype, device):
    blocks = triton.cdiv(ctx, BLOCK)
    kc = torch.randn(batch * blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    tables = torch.randperm(batch * blocks, device=device).view(batch, blocks).to(torch.int32)
    q = torch.randn(batch * q_len, KV_HEADS * GROUP, HEAD_DIM, dtype=dtype, device=device)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * q_len
    return q, kc, vc, tables, seq_lens, qsl


def bench_decode(quick: bool, peak, rows: list) -> None:
    sweep = [(1, 2048), (64, 2048)] if quick else [(b, c) for b in (1, 16, 64, 256) for c in (512, 2048, 8192, 32768)]
    for batch, ctx in sweep:
        q, kc, vc, tables, seq_lens, _ = _paged(batch, ctx, 1, torch.bfloat16, "cuda")
        scale = HEAD_DIM ** -0.5
        ms = triton.testing.do_bench(lambda: K.paged_decode(q, kc, vc, tables, seq_lens, scale, max_seq_len=ctx))
        gbs = 2 * kc.numel() * kc.element_size() / ms / 1e6
        base = "-"
        if batch * ctx <= 64 * 8192:   # the dense gather of the baseline must fit comfortably
            k = kc[tables.long()].flatten(1, 2).transpose(1, 2)     # [B, Hkv, L, D]
            v = vc[tables.long()].flatten(1, 2).transpose(1, 2)
            sdpa = lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)  # noqa: E731
            base = f"{triton.testing.do_bench(sdpa) * 1e3:.0f}"
        rows.append(("paged_decode", f"B={batch} ctx={ctx}", f"{ms * 1e3:.0f}", f"{gbs:.0f} GB/s",
                     _pct(gbs, peak and peak[1]), f"sdpa(dense, pre-gathered) {base} µs"))


def bench_prefill(quick: bool, peak, rows: list) -> None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    for chunk in ((512, 4096) if quick else (512, 1024, 2048, 4096, 8192)):
        q, kc, vc, tables, seq_lens, qsl = _paged(1, chunk, chunk, torch.bfloat16, "cuda")
        scale = HEAD_DIM ** -0.5
        ms = triton.testing.do_bench(lambda: K.paged_prefill(q, kc, vc, tables, qsl, seq_lens, scale, max_query_len=chunk))
        flops = 2 * 2 * chunk * chunk * HEAD_DIM * KV_HEADS * GROUP / 2   # causal: half the square
        tf = flops / ms / 1e9
        k = kc.flatten(0, 1)[:chunk].contiguous()
        v = vc.flatten(0, 1)[:chunk].contiguous()
        sdpa = lambda: F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),  # noqa: E731
                                                      is_causal=True, scale=scale, enable_gqa=True)
        other = f"sdpa {triton.testing.do_bench(sdpa) * 1e3:.0f} µs"
        if flash_attn_varlen_func is not None:
            fa = lambda: flash_attn_varlen_func(q, k, v, qsl, qsl, chunk, chunk, softmax_scale=scale, causal=True)  # noqa: E731
            other += f", flash-attn {triton.testing.do_bench(fa) * 1e3:.0f} µs"
        rows.append(("paged_prefill", f"chunk={chunk}", f"{ms * 1e3:.0f}", f"{tf:.0f} TFLOP/s",
                     _pct(tf, peak and peak[0]), other))


def _sampling_args(batch: int, vocab: int, device):
    f = lambda v, dt: torch.full((batch,), v, dtype=dt, device=device)  # noqa: E731
    logits = torch.randn(batch, vocab, device=device) * 3
    return logits, f(0.8, torch.float32), f(50, torch.int32), f(0.9, torch.float32), f(0.0, torch.float32), \
        torch.arange(batch, device=device), f(0, torch.int64)


def bench_sampling(quick: bool, peak, rows: list) -> None:
    for batch in ((256,) if quick else (1, 32, 256)):
        args = _sampling_args(batch, 128 * 1024, "cuda")
        ms = triton.testing.do_bench(lambda: K.sample(*args))

        def sort_top_p():
            probs = torch.softmax(args[0] / 0.8, -1)
            sorted_p, idx = probs.sort(-1, descending=True)
            cut = sorted_p.cumsum(-1) - sorted_p > 0.9
            sorted_p = sorted_p.masked_fill(cut, 0)
            return idx.gather(-1, torch.multinomial(sorted_p, 1))

        base = triton.testing.do_bench(sort_top_p)
        gbs = args[0].numel() * 4 / ms / 1e6
        rows.append(("sample", f"B={batch} V=128k", f"{ms * 1e3:.0f}", f"{gbs:.0f} GB/s",
                     _pct(gbs, peak and peak[1]), f"torch sort top-p {base * 1e3:.0f} µs ({base / ms:.1f}x)"))


def bench_kv_store(quick: bool, peak, rows: list) -> None:
    for tokens in ((256,) if quick else (256, 4096)):
        kc = torch.zeros(tokens // BLOCK + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        vc = torch.zeros_like(kc)
        key = torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        slots = torch.randperm(kc.shape[0] * BLOCK, device="cuda")[:tokens]
        ms = triton.testing.do_bench(lambda: K.kv_store(key, key, kc, vc, slots))
        base = triton.testing.do_bench(lambda: K.kv_store_ref(key, key, kc, vc, slots))
        gbs = 4 * key.numel() * key.element_size() / ms / 1e6
        rows.append(("kv_store", f"tokens={tokens}", f"{ms * 1e3:.1f}", f"{gbs:.0f} GB/s",
                     _pct(gbs, peak and peak[1]), f"torch index_put {base * 1e3:.1f} µs"))


def run_gpu(quick: bool) -> None:
    name = torch.cuda.get_device_name()
    peak = peak_for(name)
    print(f"device: {name}; peak: {'unknown (n/a)' if peak is None else f'{peak[0]:.0f} TFLOP/s, {peak[1]:.0f} GB/s'}")
    rows: list = []
    for fn in (bench_kv_store, bench_decode, bench_prefill, bench_sampling):
        fn(quick, peak, rows)
    header = ("kernel", "shape", "µs", "achieved", "% peak", "baseline")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print(" | ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def check_cpu() -> None:
    """Each kernel against its reference at a tiny shape, under the Triton interpreter."""
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(6, 4, 2, 16, generator=g), torch.randn(6, 4, 2, 16, generator=g)
    key, val = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    slots = torch.tensor([5, -1, 13])
    a, b = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
    K.kv_store(key, val, *a, slots)
    K.kv_store_ref(key, val, *b, slots)
    torch.testing.assert_close(a, b)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    seq_lens = torch.tensor([9, 12], dtype=torch.int32)
    q = torch.randn(2, 6, 16, generator=g)
    torch.testing.assert_close(K.paged_decode(q, kc, vc, tables, seq_lens, 0.25, num_splits=2),
                               K.paged_decode_ref(q, kc, vc, tables, seq_lens, 0.25))
    q = torch.randn(7, 6, 16, generator=g)
    qsl = torch.tensor([0, 4, 7], dtype=torch.int32)
    torch.testing.assert_close(K.paged_prefill(q, kc, vc, tables, qsl, seq_lens, 0.25),
                               K.paged_prefill_ref(q, kc, vc, tables, qsl, seq_lens, 0.25))
    args = _sampling_args(4, 100, "cpu")
    greedy = (args[0], torch.zeros(4), *args[2:])
    assert torch.equal(K.sample(*greedy), K.sample_ref(*greedy))
    counts = torch.randint(0, 2, (4, 100), dtype=torch.int32, generator=g)
    pen = (counts, counts == 0, torch.full((4,), 0.5), torch.full((4,), 0.1), torch.full((4,), 1.2),
           torch.tensor([[3], [-1], [7], [-1]], dtype=torch.int32), torch.ones(4, 1))
    torch.testing.assert_close(K.apply_penalties(args[0].clone(), *pen), K.apply_penalties_ref(args[0].clone(), *pen))
    p = torch.softmax(torch.randn(2, 3, 10, generator=g), -1)
    drafts = torch.tensor([[1, 2], [3, 4]])
    out, emitted = K.rejection_sample(drafts, p[:, :2], p, torch.arange(2), torch.zeros(2, dtype=torch.int64))
    assert emitted.tolist() == [3, 3] and torch.equal(out[:, :2], drafts)   # p == q: all accepted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small sweep")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        check_cpu()
        print("kv_store, paged_decode, paged_prefill, sample, apply_penalties, rejection_sample: "
              "match their torch references (Triton interpreter, tiny shapes)")
        print("timing needs a GPU: no CUDA device here, so no timings were taken")
        return 0
    run_gpu(args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
