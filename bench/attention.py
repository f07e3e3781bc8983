"""The C++ CPU paged attention (``kernels/cpu_ops.cpp``'s ``paged_decode``, which the layer stack
runs for decode rows and prefill rows alike) against the torch backend's decode
(``TorchAttentionBackend._decode``: the sequences' blocks gathered, then matmuls) on the same
caches and queries, in one process, at the shapes of models people serve.

    python bench/attention.py                         # the default shapes, float32 and float16 caches
    python bench/attention.py --shapes 32x32/4x64x96 --threads 2

A shape is BATCHxHEADS/KV_HEADSxHEAD_SIZExLENGTH (every row LENGTH tokens long). Each cell is the
best time of a --budget loop; "ns / (token, head)" is that time over batch x heads x length, which
is what a longer context or a bigger group costs. The C++ result is checked against torch's first.

``--cold`` gives each call the next of enough copies of the caches to fill --cold-mib (past the
last-level cache), so every call reads its cache from memory, as a decode step does: it reads
each layer's cache in turn, all of them together larger than the cache. The default times one
cache over and over, from the cache.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timers import best_us  # noqa: E402
from sluice.engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from sluice.kernels import cpu_ext  # noqa: E402

# 32 streams of a short chat on a TinyLlama-shaped 1B (32/4 heads of 64) and a Llama 3.2 1B
# (32/8), a Qwen2.5-7B-shaped group of 7 at 128; one stream at 4k tokens.
SHAPES = ("32x32/4x64x96", "32x32/8x64x96", "32x28/4x128x96", "32x16/4x128x96", "1x32/4x64x4096",
          "1x32/8x64x4096")


def parse(shape: str) -> tuple[int, int, int, int, int]:
    batch, heads, rest = shape.split("x", 2)
    heads, kv = heads.split("/")
    dim, length = rest.split("x")
    return int(batch), int(heads), int(kv), int(dim), int(length)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtypes", default="float32,float16", help="KV cache element types")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.5, help="seconds per cell")
    ap.add_argument("--cold", action="store_true", help="each call reads its cache from memory (see above)")
    ap.add_argument("--cold-mib", type=int, default=512, help="total size of the cache copies with --cold")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_ext.module()
    where = f"caches from memory ({args.cold_mib} MiB of copies)" if args.cold else "caches from the cache"
    print(f"{args.threads} threads, {where}; µs per call (best of a {args.budget} s loop), ns per (token, head)")
    print("| shape | cache | C++ µs | ns / (token, head) | torch µs | torch / C++ |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        batch, heads, kv, dim, length = parse(shape)
        bs = args.block_size
        per_row = -(-length // bs)
        blocks = batch * per_row   # every row's blocks, scattered over the cache
        tables = torch.randperm(blocks, generator=gen).view(batch, per_row).to(torch.int32)
        lens = torch.full((batch,), length, dtype=torch.int32)
        q = torch.randn(batch, heads, dim, generator=gen)
        scale = dim ** -0.5
        k32, v32 = torch.randn(blocks, bs, kv, dim, generator=gen), torch.randn(blocks, bs, kv, dim, generator=gen)
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            kc, vc = k32.to(dtype), v32.to(dtype)
            tol = 1e-4 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(ops.paged_decode(q, kc, vc, tables, lens, scale),
                                       TorchAttentionBackend._decode(q.to(dtype), (kc, vc), tables, lens, length,
                                                                     scale).float(), rtol=tol, atol=tol)
            copies = max(1, (args.cold_mib << 20) // (2 * kc.nbytes)) if args.cold else 1
            caches = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(copies - 1)]
            turn = itertools.count()
            ours = lambda: ops.paged_decode(q, *caches[next(turn) % copies], tables, lens, scale)  # noqa: E731
            theirs = lambda: TorchAttentionBackend._decode(  # noqa: E731
                q.to(dtype), caches[next(turn) % copies], tables, lens, length, scale)
            a, b = best_us(ours, args.budget), best_us(theirs, args.budget)
            print(f"| {shape} | {name} | {a:.0f} | {a * 1e3 / (batch * heads * length):.2f} | {b:.0f} "
                  f"| {b / a:.2f} |", flush=True)


if __name__ == "__main__":
    main()
