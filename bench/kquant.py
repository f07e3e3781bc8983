"""One projection's time per GGUF block format, at a 1B-class Llama's shapes (TinyLlama: hidden
2048, FFN 5632, 32/4 heads, vocabulary 32000): float32 (oneDNN packed, the ``none`` format),
Q4_1 and Q8_0 (``cpu_blockq``, as w4a8 / w8a8 hold them) and the K-quant / 5-bit / IQ4 formats
kept as stored (``cpu_kquant``: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_NL, IQ4_XS), all in one run.

    python bench/kquant.py                      # 1 / 8 / 32 / 128 rows, 2 threads
    python bench/kquant.py --rows 1 --shapes 5632x2048 --portable

Random blocks (the kernels' speed does not depend on the values), best of a --budget loop per
cell; µs per call, and each format's time as a fraction of float32's and of Q4_1's (Q4_1 is the
format sluice was fastest on before the K-quants were kept as stored).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.timers import best_us  # noqa: E402

# TinyLlama-1.1B: fused q/k/v, o, fused gate/up, down, the LM head.
SHAPES = ((2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632), (32000, 2048))
KQUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS")


def random_blocks(kind: str, n: int, k: int, seed: int):
    """A GGUF tensor's bytes [n, K / block * bytes] of random blocks, their float16 scales set small."""
    import numpy as np
    import torch

    from sluice.engine.models.kquant import _BLOCK

    per, size = _BLOCK[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    halves = {"Q5_0": [0], "Q5_1": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0], "Q3_K": [108], "Q2_K": [80, 82]}.get(kind, [0, 2])
    for at in halves:
        raw[..., at:at + 2] = np.full((n, k // per), 1e-3, np.float16).view(np.uint8).reshape(n, k // per, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def random_kquant(kind: str, n: int, k: int, seed: int):
    from sluice.engine.models.kquant import KQuantLinear

    return KQuantLinear.from_gguf(kind, random_blocks(kind, n, k, seed), (n, k))


def main() -> None:
    import torch

    from sluice.engine.models import quant
    from sluice.engine.models.llama import pack_cpu_weight, packed_linear
    from sluice.kernels import cpu_blockq, cpu_ext, cpu_kquant

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,32,128", help="comma-separated input row counts")
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK,...")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--portable", action="store_true", help="also time the portable C++ loop (Q4_K)")
    p.add_argument("--budget", type=float, default=0.3, help="seconds of calls per cell (the best one counts)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    portable = cpu_ext.portable_module() if args.portable else None
    print(f"K-quant path: {cpu_kquant.isa()}, Q4_1/Q8_0 path: {cpu_blockq.isa()}, torch CPU capability: "
          f"{torch.backends.cpu.get_cpu_capability()}, {args.threads} threads; "
          "µs per call (x float32, x Q4_1)")
    cols = ["float32", "Q4_1", "Q8_0", *KQUANTS] + (["Q4_K portable"] if portable else [])
    print("| weight | rows | " + " | ".join(cols) + " |")
    print("| --- | ---: |" + " ---: |" * len(cols))
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        dense = torch.randn(n, k) * 0.02
        packed = pack_cpu_weight(dense)
        q41, q80 = quant.BlockQLinear.from_float(dense, 4), quant.BlockQLinear.from_float(dense, 8)
        del dense
        kq = {kind: random_kquant(kind, n, k, seed=i) for i, kind in enumerate(KQUANTS)}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            calls = [lambda: packed_linear(x, packed, None), lambda: q41(x), lambda: q80(x)]
            calls += [lambda w=w: w(x) for w in kq.values()]
            if portable is not None:
                w = kq["Q4_K"]
                calls.append(lambda: portable.kquant_linear(x, w.packed, w.type_id, n))
            times = [best_us(fn, args.budget) for fn in calls]
            cells = [f"{times[0]:.0f}"] + [f"{t:.0f} ({t / times[0]:.2f}, {t / times[1]:.2f})" for t in times[1:]]
            print(f"| {n}×{k} | {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
