"""Benchmark the Triton kernels against torch baselines at serving shapes.

    python bench/triton_kernels.py [--quick] [--out kernels.md]

On CUDA: times each kernel and its baselines with ``triton.testing.do_bench`` (which flushes L2
between runs) and prints µs, achieved GB/s or TFLOP/s, the share of the device's peak, and the
issue's three goals with met/missed. ``--out`` also writes the table and the goals as Markdown.
Without CUDA: checks every kernel against its torch reference at a tiny shape under the Triton
interpreter, says that timing needs a GPU, and exits 0.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton decorates the kernels
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import sluice.kernels as K  # noqa: E402

# Peak dense bf16 tensor TFLOP/s and HBM GB/s, from the vendors' datasheets (SXM parts).
PEAKS = {"H200": (989.0, 4800.0), "H100": (989.0, 3350.0), "A100": (312.0, 2039.0), "L4": (121.0, 300.0)}
HEAD_DIM, KV_HEADS, GROUP, BLOCK = 128, 8, 8, 16
DEVICE = "cuda"
# A baseline that gathers K/V densely (or loops over rows in Python) is timed only up to this
# many cached tokens in the batch, so that it fits in memory and the sweep ends in minutes.
MAX_BASELINE_TOKENS = 64 * 8192


@dataclass(frozen=True)
class Sweep:
    decode: tuple[tuple[int, int], ...]   # (batch, context)
    prefill: tuple[int, ...]              # chunk lengths
    sample: tuple[int, ...]               # batch sizes
    penalties: tuple[int, ...]
    rejection: tuple[int, ...]
    kv_store: tuple[int, ...]             # tokens
    verify: tuple[tuple[int, int], ...] = ()   # (batch, context): a draft tree's rows per sequence
    vocab: int = 128 * 1024
    dtype: torch.dtype = torch.bfloat16   # K/V and queries (logits and probabilities are fp32)


FULL = Sweep(decode=tuple((b, c) for b in (1, 16, 64, 256) for c in (512, 2048, 8192, 32768)),
             prefill=(512, 1024, 2048, 4096, 8192), sample=(1, 32, 256), penalties=(32, 256),
             rejection=(16, 64), kv_store=(256, 4096), verify=((1, 2048), (16, 2048), (64, 2048)))
QUICK = Sweep(decode=((1, 2048), (64, 2048)), prefill=(512, 4096), sample=(256,), penalties=(256,),
              rejection=(64,), kv_store=(256,), verify=((16, 2048),))
# The verification rows' draft tree (spec_decode.tree): the default width 3 and K 4 at most, 12
# nodes, here 3 children of the last known token and 3 of each of them, then one more level.
TREE_PARENTS = [-1, -1, -1, 0, 0, 0, 1, 1, 1, 3, 4, 6]


@dataclass
class Row:
    kernel: str
    shape: str
    us: float
    rate: float | None            # in ``unit``; None where no rate applies
    unit: str                     # "GB/s" or "TFLOP/s"
    peak: float | None            # the device's peak in ``unit``, when known
    baselines: dict[str, float]   # name -> µs

    def cells(self) -> tuple[str, ...]:
        achieved = "-" if self.rate is None else f"{self.rate:.0f} {self.unit}"
        pct = "-" if self.rate is None else "n/a" if self.peak is None else f"{100 * self.rate / self.peak:.0f}%"
        base = ", ".join(f"{name} {us:.0f} µs ({us / self.us:.2f}×)" for name, us in self.baselines.items())
        return (self.kernel, self.shape, f"{self.us:.1f}", achieved, pct, base or "-")


def peak_for(name: str) -> tuple[float, float] | None:
    return next((v for k, v in PEAKS.items() if k in name.upper()), None)


def _bw(peak) -> float | None:
    return peak and peak[1]


def _us(fn) -> float:
    return triton.testing.do_bench(fn) * 1e3


def _paged(batch: int, ctx: int, q_len: int, dtype, device):
    blocks = triton.cdiv(ctx, BLOCK)
    kc = torch.randn(batch * blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    tables = torch.randperm(batch * blocks, device=device).view(batch, blocks).to(torch.int32)
    q = torch.randn(batch * q_len, KV_HEADS * GROUP, HEAD_DIM, dtype=dtype, device=device)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * q_len
    return q, kc, vc, tables, seq_lens, qsl


def _vocab(v: int) -> str:
    return f"{v // 1024}k" if v % 1024 == 0 else str(v)


def bench_decode(sweep: Sweep, peak, rows: list[Row]) -> None:
    for batch, ctx in sweep.decode:
        q, kc, vc, tables, seq_lens, _ = _paged(batch, ctx, 1, sweep.dtype, DEVICE)
        scale = HEAD_DIM ** -0.5
        us = _us(lambda: K.paged_decode(q, kc, vc, tables, seq_lens, scale, max_seq_len=ctx))
        gbs = 2 * kc.numel() * kc.element_size() / us / 1e3
        base = {}
        if batch * ctx <= MAX_BASELINE_TOKENS:
            k = kc[tables.long()].flatten(1, 2).transpose(1, 2)     # [B, Hkv, L, D], gathered outside the timing
            v = vc[tables.long()].flatten(1, 2).transpose(1, 2)
            base["sdpa (dense, pre-gathered)"] = _us(
                lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True))
            del k, v
            if batch <= 16:                                          # a Python loop over the rows
                base["torch ref"] = _us(lambda: K.paged_decode_ref(q, kc, vc, tables, seq_lens, scale))
        rows.append(Row("paged_decode", f"B={batch} ctx={ctx}", us, gbs, "GB/s", _bw(peak), base))
        del q, kc, vc


def bench_prefill(sweep: Sweep, peak, rows: list[Row]) -> None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    for chunk in sweep.prefill:
        q, kc, vc, tables, seq_lens, qsl = _paged(1, chunk, chunk, sweep.dtype, DEVICE)
        scale = HEAD_DIM ** -0.5
        us = _us(lambda: K.paged_prefill(q, kc, vc, tables, qsl, seq_lens, scale, max_query_len=chunk))
        flops = 2 * 2 * chunk * chunk * HEAD_DIM * KV_HEADS * GROUP / 2   # QK^T and PV, causal: half the square
        tf = flops / us / 1e6
        k = kc[tables[0].long()].flatten(0, 1)[:chunk].contiguous()   # the sequence's K/V, dense
        v = vc[tables[0].long()].flatten(0, 1)[:chunk].contiguous()
        base = {"sdpa (dense)": _us(lambda: F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True))}
        if flash_attn_varlen_func is not None:
            base["flash-attn (dense)"] = _us(lambda: flash_attn_varlen_func(
                q, k, v, qsl, qsl, chunk, chunk, softmax_scale=scale, causal=True))
        if chunk <= 2048:
            base["torch ref"] = _us(lambda: K.paged_prefill_ref(q, kc, vc, tables, qsl, seq_lens, scale))
        rows.append(Row("paged_prefill", f"chunk={chunk}", us, tf, "TFLOP/s", peak and peak[0], base))


def bench_verify(sweep: Sweep, peak, rows: list[Row]) -> None:
    """Speculative verification with a draft tree: each sequence's last known token and 12
    nodes (TREE_PARENTS) through paged_prefill's tree mask, against the same rows read causally
    (what a chain of 12 drafts costs): the mask's price."""
    from sluice.engine.attention.base import NO_TREE
    from sluice.engine.spec_decode.tree import visibility

    nodes = len(TREE_PARENTS)
    for batch, ctx in sweep.verify:
        q_len = 1 + nodes
        q, kc, vc, tables, seq_lens, qsl = _paged(batch, ctx, q_len, sweep.dtype, DEVICE)
        node_start = torch.full((batch, q_len), NO_TREE, dtype=torch.int32)
        node_start[:, 1:] = ctx - nodes
        visible = torch.zeros(batch, q_len, nodes, dtype=torch.int8)
        visible[:, 1:] = torch.tensor(visibility(TREE_PARENTS))
        node_start, visible = node_start.view(-1).to(DEVICE), visible.view(-1, nodes).to(DEVICE)
        scale = HEAD_DIM ** -0.5
        us = _us(lambda: K.paged_prefill(q, kc, vc, tables, qsl, seq_lens, scale, max_query_len=q_len,
                                         node_start=node_start, visible=visible))
        gbs = 2 * kc.numel() * kc.element_size() / us / 1e3
        base = {"same rows, causal": _us(lambda: K.paged_prefill(q, kc, vc, tables, qsl, seq_lens, scale,
                                                                 max_query_len=q_len))}
        rows.append(Row("paged_prefill (tree)", f"B={batch} ctx={ctx} nodes={nodes}", us, gbs, "GB/s", _bw(peak), base))
        del q, kc, vc


def _sampling_args(batch: int, vocab: int, device, top_k: int = 50):
    f = lambda v, dt: torch.full((batch,), v, dtype=dt, device=device)  # noqa: E731
    logits = torch.randn(batch, vocab, device=device) * 3
    return logits, f(0.8, torch.float32), f(top_k, torch.int32), f(0.9, torch.float32), f(0.0, torch.float32), \
        torch.arange(batch, device=device), f(0, torch.int64)


def torch_sort_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The usual torch sampler: softmax, full sort, cumulative-sum cut, multinomial."""
    probs = torch.softmax(logits / temperature, -1)
    sorted_p, idx = probs.sort(-1, descending=True)
    sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= top_p, 0)
    return idx.gather(-1, torch.multinomial(sorted_p, 1))


def bench_sampling(sweep: Sweep, peak, rows: list[Row]) -> None:
    for batch in sweep.sample:
        for top_k in (0, 50):
            args = _sampling_args(batch, sweep.vocab, DEVICE, top_k)
            us = _us(lambda: K.sample(*args))
            gbs = args[0].numel() * 4 / us / 1e3
            base = {"torch sort top-p": _us(lambda: torch_sort_top_p(args[0], 0.8, 0.9))}
            name = "top-p 0.9" if top_k == 0 else f"top-k {top_k} + top-p 0.9"
            rows.append(Row("sample", f"B={batch} V={_vocab(sweep.vocab)} {name}", us, gbs, "GB/s", _bw(peak), base))


def bench_penalties(sweep: Sweep, peak, rows: list[Row]) -> None:
    vocab = sweep.vocab
    for batch in sweep.penalties:
        logits = torch.randn(batch, vocab, device=DEVICE)
        counts = (torch.rand(batch, vocab, device=DEVICE) < 0.01).to(torch.int32)
        prompt = torch.rand(batch, vocab, device=DEVICE) < 0.01
        f = lambda v: torch.full((batch,), v, device=DEVICE)  # noqa: E731
        bias_ids = torch.randint(0, vocab, (batch, 4), dtype=torch.int32, device=DEVICE)
        args = (counts, prompt, f(0.5), f(0.1), f(1.2), bias_ids, torch.ones(batch, 4, device=DEVICE))
        us = _us(lambda: K.apply_penalties(logits, *args))
        moved = logits.numel() * 4 * 2 + counts.numel() * 4 + prompt.numel()   # logits read+written, counts, mask
        gbs = moved / us / 1e3
        base = {"torch ref": _us(lambda: K.apply_penalties_ref(logits, *args))}
        rows.append(Row("apply_penalties", f"B={batch} V={_vocab(vocab)}", us, gbs, "GB/s", _bw(peak), base))


def torch_rejection(drafts, q, p):
    """Vectorised torch rejection sampling (the reference loops over rows in Python)."""
    rows, k = drafts.shape
    r = torch.arange(rows, device=drafts.device)
    pd = p[:, :k].gather(2, drafts[..., None])[..., 0]
    qd = q.gather(2, drafts[..., None])[..., 0]
    accepted = (torch.rand(rows, k, device=drafts.device) * qd < pd).int().cumprod(1).sum(1)   # [rows]
    at = accepted.clamp_max(k - 1)
    dist = torch.where((accepted == k)[:, None], p[r, accepted], (p[r, at] - q[r, at]).clamp_min(0))
    dist = torch.where(dist.sum(-1, keepdim=True) > 0, dist, p[r, accepted])
    out = torch.cat([drafts, torch.full_like(drafts[:, :1], -1)], 1)
    out[r, accepted] = torch.multinomial(dist, 1)[:, 0]
    out[torch.arange(k + 1, device=drafts.device)[None, :] > accepted[:, None]] = -1
    return out, accepted + 1


def bench_rejection(sweep: Sweep, peak, rows: list[Row]) -> None:
    k, vocab = 4, sweep.vocab
    for batch in sweep.rejection:
        g = torch.Generator(device=DEVICE).manual_seed(0)
        p = torch.softmax(torch.randn(batch, k + 1, vocab, device=DEVICE, generator=g) * 2, -1)
        q = torch.softmax(torch.randn(batch, k, vocab, device=DEVICE, generator=g) * 2, -1)
        drafts = torch.multinomial(q.flatten(0, 1), 1).view(batch, k)
        seeds, offsets = torch.arange(batch, device=DEVICE), torch.zeros(batch, dtype=torch.int64, device=DEVICE)
        us = _us(lambda: K.rejection_sample(drafts, q, p, seeds, offsets))
        base = {"torch (vectorised)": _us(lambda: torch_rejection(drafts, q, p))}
        if batch <= 16:
            base["torch ref"] = _us(lambda: K.rejection_sample_ref(drafts, q, p))
        rows.append(Row("rejection_sample", f"B={batch} K={k} V={_vocab(vocab)}", us, None, "", None, base))


def bench_kv_store(sweep: Sweep, peak, rows: list[Row]) -> None:
    for tokens in sweep.kv_store:
        kc = torch.zeros(tokens // BLOCK + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=sweep.dtype, device=DEVICE)
        vc = torch.zeros_like(kc)
        key = torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=sweep.dtype, device=DEVICE)
        slots = torch.randperm(kc.shape[0] * BLOCK, device=DEVICE)[:tokens]
        us = _us(lambda: K.kv_store(key, key, kc, vc, slots))
        gbs = 4 * key.numel() * key.element_size() / us / 1e3
        base = {"torch index_put": _us(lambda: K.kv_store_ref(key, key, kc, vc, slots))}
        rows.append(Row("kv_store", f"tokens={tokens}", us, gbs, "GB/s", _bw(peak), base))


def goals(rows: list[Row], peak) -> list[str]:
    """The issue's three GPU goals, judged from the rows measured (a goal whose row or baseline
    was not measured says so)."""
    by = {(r.kernel, r.shape): r for r in rows}
    out = []
    dec = by.get(("paged_decode", "B=64 ctx=2048"))
    if dec is None or peak is None:
        out.append("paged decode ≥ 80% of HBM bandwidth at B=64 × 2k: not measured (row or device peak missing)")
    else:
        pct = 100 * dec.rate / peak[1]
        out.append(f"paged decode ≥ 80% of HBM bandwidth at B=64 × 2k: {pct:.0f}% ({'met' if pct >= 80 else 'missed'})")
    pre = by.get(("paged_prefill", "chunk=4096"))
    fa = pre and pre.baselines.get("flash-attn (dense)")
    if not fa:
        out.append("prefill ≥ 50% of flash-attn's throughput at 4k: not measured (flash-attn not installed)")
    else:
        share = 100 * fa / pre.us
        out.append(f"prefill ≥ 50% of flash-attn's throughput at 4k: {share:.0f}% ({'met' if share >= 50 else 'missed'})")
    smp = by.get(("sample", "B=256 V=128k top-p 0.9"))
    if smp is None:
        out.append("sampling ≥ 2× torch sort-based top-p at B=256 × 128k: not measured")
    else:
        x = smp.baselines["torch sort top-p"] / smp.us
        out.append(f"sampling ≥ 2× torch sort-based top-p at B=256 × 128k: {x:.1f}× ({'met' if x >= 2 else 'missed'})")
    return out


def table(rows: list[Row]) -> list[tuple[str, ...]]:
    return [("kernel", "shape", "µs", "achieved", "% peak", "baselines (µs, kernel's speed-up)"), *(r.cells() for r in rows)]


BENCHES = (bench_kv_store, bench_decode, bench_prefill, bench_verify, bench_sampling, bench_penalties,
           bench_rejection)


def measure(sweep: Sweep, peak) -> list[Row]:
    rows: list[Row] = []
    for fn in BENCHES:
        fn(sweep, peak, rows)
        print(f"{fn.__name__}: done", flush=True)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    return rows


def report(rows: list[Row], peak, header: str, out_path: str | None) -> None:
    """Print the table and the goals; with ``out_path``, write them there as Markdown too."""
    cells = table(rows)
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    for r in cells:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    judged = goals(rows, peak)
    for line in judged:
        print("goal:", line)
    if out_path:
        with open(out_path, "w") as fh:
            fh.write(header + "\n\n")
            fh.write("| " + " | ".join(cells[0]) + " |\n|" + "---|" * len(cells[0]) + "\n")
            fh.writelines("| " + " | ".join(r) + " |\n" for r in cells[1:])
            fh.write("\n" + "".join(f"- {line}\n" for line in judged))


def run_gpu(sweep: Sweep, out_path: str | None) -> None:
    name = torch.cuda.get_device_name()
    peak = peak_for(name)
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    peak_text = "unknown (n/a)" if peak is None else f"{peak[0]:.0f} TFLOP/s bf16, {peak[1]:.0f} GB/s"
    print(f"device: {name}; peak: {peak_text}; {versions}", flush=True)
    rows = measure(sweep, peak)
    header = (f"Device: {name} (peak {peak_text}); {versions}; bf16 K/V and queries, head_dim {HEAD_DIM}, "
              f"{KV_HEADS} KV heads × GQA {GROUP}, block size {BLOCK}; fp32 logits.")
    report(rows, peak, header, out_path)


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
    # The second sequence's last 3 rows a draft tree (node 2 a child of node 0, not of node 1).
    node_start = torch.tensor([1 << 30] * 4 + [9, 9, 9], dtype=torch.int32)
    visible = torch.tensor([[0, 0, 0]] * 4 + [[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=torch.int8)
    torch.testing.assert_close(K.paged_prefill(q, kc, vc, tables, qsl, seq_lens, 0.25, node_start=node_start,
                                               visible=visible),
                               K.paged_prefill_ref(q, kc, vc, tables, qsl, seq_lens, 0.25, node_start, visible))
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
    out, emitted = torch_rejection(drafts, p[:, :2], p)                    # the vectorised baseline agrees
    assert emitted.tolist() == [3, 3] and torch.equal(out[:, :2], drafts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small sweep")
    parser.add_argument("--out", help="also write the table and the goals to this Markdown file (GPU only)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        check_cpu()
        print("kv_store, paged_decode, paged_prefill (draft-tree mask included), sample, apply_penalties, "
              "rejection_sample: match their torch references (Triton interpreter, tiny shapes)")
        print("timing needs a GPU: no CUDA device here, so no timings were taken")
        return 0
    run_gpu(QUICK if args.quick else FULL, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
