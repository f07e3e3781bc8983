"""Block-format products with their weights on 4 KiB pages against the same weights on
transparent huge pages (``engine/heap.py``'s ``huge_page_allocations``, which ``load_model`` uses
for every CPU model), in one process, calls alternating, each call reading its weight from memory.

    python bench/hugepages.py                                   # Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; 1 and 4 rows
    python bench/hugepages.py --kinds Q4_K --rows 1 --shapes 49152x2048

Each format's weight is copied until the copies fill --cold-mib (past the last-level cache); a
timed call runs the product over every copy in turn, so each product reads its weight from
memory, as a decode step does. One set of copies is made on the heap (4 KiB pages), the other
inside the huge-page scope. µs per product (best of a --budget loop), the effective read rate,
and huge / 4 KiB. The last line says how much of the process is on huge pages (AnonHugePages):
where THP is off (`never`) the two sets are the same.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kquant import random_blocks  # noqa: E402
from timers import best_us  # noqa: E402

KINDS = ("Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def make_weight(kind: str, n: int, k: int):
    """A random weight of GGUF type ``kind`` as sluice holds it (``cpu_blockq`` for Q4_1 / Q8_0,
    ``cpu_kquant`` for the K-quants)."""
    import torch

    from sluice.engine.models import quant
    from sluice.engine.models.kquant import KQuantLinear

    if kind in ("Q4_1", "Q8_0"):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
        return quant.BlockQLinear.from_float(w, 4 if kind == "Q4_1" else 8)
    return KQuantLinear.from_gguf(kind, random_blocks(kind, n, k, seed=0), (n, k))


def copies(weight, count: int, huge: bool) -> list:
    """``count`` copies of ``weight`` whose tensors are cloned on the heap or, with ``huge``,
    inside the huge-page scope."""
    import torch

    from sluice.engine.heap import huge_page_allocations

    out = []
    with huge_page_allocations() if huge else contextlib.nullcontext():
        for _ in range(count):
            c = copy.copy(weight)
            for name, value in vars(weight).items():
                if isinstance(value, torch.Tensor) and value.numel():
                    setattr(c, name, value.clone())
            out.append(c)
    return out


def weight_bytes(weight) -> int:
    import torch

    return sum(v.nbytes for v in vars(weight).values() if isinstance(v, torch.Tensor))


def anon_huge_mib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) // 1024
    return 0


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--rows", default="1,4")
    p.add_argument("--shapes", default="11264x2048,2048x5632,49152x2048")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=float, default=1.0)
    p.add_argument("--cold-mib", type=int, default=1024, help="total size of each set of copies")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"{args.threads} threads; THP: {thp.read_text().strip() if thp.exists() else 'not built'}; "
          f"µs per product, weights from memory ({args.cold_mib} MiB of copies per set)")
    print("| format | weight | rows | 4 KiB pages | huge pages | huge / 4 KiB | GB/s (4 KiB / huge) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for kind in args.kinds.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            weight = make_weight(kind, n, k)
            size = weight_bytes(weight)
            count = max(2, (args.cold_mib << 20) // size)
            small, huge = copies(weight, count, False), copies(weight, count, True)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k)
                assert torch.equal(small[0](x), huge[0](x)), (kind, shape, rows)

                def cycle(ws):
                    def run() -> None:
                        for w in ws:
                            w(x)
                    return run

                t_small = best_us(cycle(small), args.budget) / count
                t_huge = best_us(cycle(huge), args.budget) / count
                print(f"| {kind} | {n}×{k} | {rows} | {t_small:.0f} | {t_huge:.0f} | {t_huge / t_small:.2f} | "
                      f"{size / t_small / 1e3:.1f} / {size / t_huge / 1e3:.1f} |", flush=True)
            if kind == args.kinds.split(",")[-1] and shape == args.shapes.split(",")[-1]:
                print(f"AnonHugePages: {anon_huge_mib()} MiB (the huge-page set is {count * size >> 20} MiB)")
            del small, huge
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
