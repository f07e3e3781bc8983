"""Two versions of ``kernels/cpu_kquant.cpp`` in one process: each builds (with ``cpu_blockq.cpp``)
as its own small module, calls alternate on the same weights and inputs, and every output of the
new one must equal the old one's bit for bit (an assertion, not a tolerance). For kernel changes
on a shared, busy host, where two separate runs of ``bench/kquant.py`` minutes apart differ by
more than the change. Each version packs the weight from the same random GGUF blocks itself
(``kquant_pack_gguf``), so a change of the packed layout is compared as well.

    git show HEAD~1:kernels/cpu_kquant.cpp > /tmp/old_kquant.cpp
    python bench/kquant_ab.py /tmp/old_kquant.cpp kernels/cpu_kquant.cpp --kinds Q4_K,Q6_K
    python bench/kquant_ab.py /tmp/old_kquant.cpp kernels/cpu_kquant.cpp --cold --rows 1,4

``--cold`` times each call over the next of enough copies of the weight to fill --cold-mib (past
the last-level cache), so every call reads its weight from memory, as a decode step does for a
model larger than the cache; the default times one weight over and over, from the cache.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

_BIND = """#include <torch/extension.h>
torch::Tensor kquant_linear(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t n);
torch::Tensor kquant_pack_gguf(torch::Tensor blocks, int64_t fmt, int64_t n, int64_t k);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kquant_linear", &kquant_linear);
  m.def("kquant_pack_gguf", &kquant_pack_gguf);
}
"""


def build(src: Path, work: Path, arch: list[str]):
    from torch.utils import cpp_extension

    name = "kq_" + hashlib.sha256(src.read_bytes() + " ".join(arch).encode()).hexdigest()[:12]
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    bind = work / "bind.cpp"
    bind.write_text(_BIND)
    return cpp_extension.load(name=name, sources=[str(src), str(ROOT / "kernels" / "cpu_blockq.cpp"), str(bind)],
                              build_directory=str(out), extra_cflags=["-O3", *arch, "-fopenmp"],
                              extra_ldflags=["-fopenmp"], verbose=False)


def _cycle(module, x, copies, type_id: int, n: int):
    """One call per copy of the weight (one copy: the same weight, from the cache)."""
    def run() -> None:
        for packed in copies:
            module.kquant_linear(x, packed, type_id, n)
    return run


def _copies(module, raw, type_id: int, n: int, k: int, count: int) -> list:
    """The weight packed by ``module`` itself (the two sources may lay it out differently), ``count`` times."""
    packed = module.kquant_pack_gguf(raw, type_id, n, k)
    return [packed] + [packed.clone() for _ in range(count - 1)]


def main() -> None:
    import torch

    from kquant import random_blocks
    from timers import best_us

    from sluice.kernels.cpu_kquant import FORMATS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path)
    p.add_argument("--kinds", default="Q4_K,Q5_K,Q6_K")
    p.add_argument("--rows", default="1,8,32,128")
    p.add_argument("--shapes", default="2048x2048,11264x2048,2048x5632")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=float, default=0.3)
    p.add_argument("--cold", action="store_true", help="each call reads its weight from memory (see above)")
    p.add_argument("--cold-mib", type=int, default=1024, help="total size of the copies with --cold")
    p.add_argument("--no-check", action="store_true", help="time only (for experiments that change results)")
    p.add_argument("--arch", default="-march=native",
                   help="compiler flags choosing the path, e.g. '-march=native -mno-avx512f' (AVX-VNNI without "
                        "AVX-512) or -march=x86-64-v3 (AVX2 only); default: %(default)s")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.gettempdir()) / "sluice-kquant-ab"
    arch = args.arch.split()
    old, new = build(args.old.resolve(), work, arch), build(args.new.resolve(), work, arch)
    where = f"weights from memory ({args.cold_mib} MiB of copies)" if args.cold else "weights from the cache"
    print(f"{args.threads} threads, {args.arch}, {where}; µs per call, best of {args.budget} s each; new / old")
    print("| format | weight | rows | old | new | new / old |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for kind in args.kinds.split(","):
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            raw, type_id = random_blocks(kind, n, k, seed=0), FORMATS[kind].type_id
            count = max(1, (args.cold_mib << 20) // old.kquant_pack_gguf(raw, type_id, n, k).numel()) if args.cold else 1
            copies_old, copies_new = _copies(old, raw, type_id, n, k, count), _copies(new, raw, type_id, n, k, count)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k)
                assert args.no_check or torch.equal(new.kquant_linear(x, copies_new[0], type_id, n),
                                                    old.kquant_linear(x, copies_old[0], type_id, n)), (kind, shape, rows)
                t_old = best_us(_cycle(old, x, copies_old, type_id, n), args.budget) / count
                t_new = best_us(_cycle(new, x, copies_new, type_id, n), args.budget) / count
                print(f"| {kind} | {n}×{k} | {rows} | {t_old:.0f} | {t_new:.0f} | {t_new / t_old:.2f} |", flush=True)


if __name__ == "__main__":
    main()
