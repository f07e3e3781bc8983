"""One projection's time per format, at the model's shapes: float32 (oneDNN packed, the ``none``
format), torch's int4 kernel, sluice's block products (w4a8, w8a8) in the vector path this CPU
compiled (AVX512-VNNI or AVX2) and, with ``--portable``, the same sources' portable C++ loop.

    python bench/blockq.py                  # SmolLM2's shapes, 1 / 32 / 128 rows, 2 threads
    python bench/blockq.py --portable --rows 1,8

Random weights (the kernels' speed does not depend on the values), best of a 0.3 s loop per
cell, µs per call and each format's time as a fraction of float32's in the same run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timers import best_us  # noqa: E402

# SmolLM2-135M: the fused q/k/v, the fused gate/up, the down projection and the LM head.
SHAPES = ((960, 576), (3072, 576), (576, 1536), (49152, 576))


def main() -> None:
    import torch

    from sluice.engine.models import quant
    from sluice.engine.models.llama import pack_cpu_weight, packed_linear
    from sluice.kernels import cpu_blockq, cpu_ext

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,32,128", help="comma-separated input row counts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--portable", action="store_true", help="also time the portable C++ loop")
    p.add_argument("--budget", type=float, default=0.3, help="seconds of calls per cell (the best one counts)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    portable = cpu_ext.portable_module() if args.portable else None
    print(f"block product path: {cpu_blockq.isa()}, torch CPU capability: "
          f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} threads; µs per call (x float32)")
    cols = ["float32", "int4", "w4a8", "w8a8"] + (["w4a8 portable"] if portable else [])
    print("| weight | rows | " + " | ".join(cols) + " |")
    print("| --- | ---: |" + " ---: |" * len(cols))
    for n, k in SHAPES:
        dense = torch.randn(n, k) * 0.02
        packed = pack_cpu_weight(dense)
        int4 = quant.Int4Linear.from_float(dense)
        w4, w8 = quant.BlockQLinear.from_float(dense, 4), quant.BlockQLinear.from_float(dense, 8)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            calls = [lambda: packed_linear(x, packed, None), lambda: int4(x), lambda: w4(x), lambda: w8(x)]
            if portable is not None:
                calls.append(lambda: portable.blockq_linear(x, w4.packed, w4.d, w4.m, 4, n))
            times = [best_us(fn, args.budget) for fn in calls]
            cells = [f"{t:.0f}" if i == 0 else f"{t:.0f} ({t / times[0]:.2f})" for i, t in enumerate(times)]
            print(f"| {n}×{k} | {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
