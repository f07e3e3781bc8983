"""The CPU's int8 multiply-accumulate ceiling, the bound on a block-format prefill.

A prefill step of a block-format model is integer dot products of int8 inputs with the weights'
values (``cpu_kquant.cpp``, ``cpu_blockq.cpp``): once enough rows share each unpacked weight
vector, the product is bound by how many of those the cores retire, not by memory. This times the
instruction the kernels use, the way a peak is measured: 12 independent accumulators held in registers, no loads,
on every thread at once (OpenMP), built with ``-march=native`` like ``kernels/cpu_ext.py``:

* AVX-512 VNNI: ``vpdpbusd`` on 512-bit vectors, 64 multiply-adds each;
* AVX-VNNI: ``vpdpbusd`` on 256-bit vectors, 32 each;
* AVX2: ``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd``, 32 multiply-adds per three.

A kernel's rate on a product of M rows against an N x K weight is M N K / time; its ratio to this
ceiling is how much an unpacking or a tiling change can still gain.

    python bench/int8_peak.py [--threads 2]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <chrono>

// Multiply-adds per second over `threads` threads; `iters` rounds of 12 independent instructions.
std::tuple<double, std::string> peak(int64_t iters, int64_t threads) {
  double best = 0;
  std::string path;
  for (int rep = 0; rep < 3; ++rep) {
    double total_macs = 0;
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total_macs)
    {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      __m512i acc[12];
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
      const __m512i a = _mm512_set1_epi32(0x01010101 + omp_get_thread_num()), b = _mm512_set1_epi32(0x02020202);
      for (int64_t n = 0; n < iters; ++n)
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
      int64_t keep = 0;
      for (int i = 0; i < 12; ++i) keep += _mm512_reduce_add_epi32(acc[i]);
      total_macs = 12.0 * 64 * iters + (keep == 42 ? 1 : 0);
#elif defined(__AVXVNNI__)
      __m256i acc[12];
      for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_epi32(i);
      const __m256i a = _mm256_set1_epi32(0x01010101 + omp_get_thread_num()), b = _mm256_set1_epi32(0x02020202);
      for (int64_t n = 0; n < iters; ++n)
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], a, b);
      int64_t keep = 0;
      for (int i = 0; i < 12; ++i) keep += _mm256_extract_epi32(acc[i], 0);
      total_macs = 12.0 * 32 * iters + (keep == 42 ? 1 : 0);
#elif defined(__AVX2__)
      __m256i acc[12];
      for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_epi32(i);
      const __m256i a = _mm256_set1_epi32(0x01010101 + omp_get_thread_num()), b = _mm256_set1_epi32(0x02020202);
      const __m256i ones = _mm256_set1_epi16(1);
      for (int64_t n = 0; n < iters; ++n)
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i)
          acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
      int64_t keep = 0;
      for (int i = 0; i < 12; ++i) keep += _mm256_extract_epi32(acc[i], 0);
      total_macs = 12.0 * 32 * iters + (keep == 42 ? 1 : 0);
#else
      total_macs = 0;
#endif
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, total_macs / s);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  path = "avx512vnni: vpdpbusd zmm";
#elif defined(__AVXVNNI__)
  path = "avxvnni: vpdpbusd ymm";
#elif defined(__AVX2__)
  path = "avx2: vpmaddubsw + vpmaddwd + vpaddd";
#else
  path = "no int8 vector instructions";
#endif
  return {best, path};
}
"""


def measure(threads: int, iters: int = 20_000_000) -> tuple[float, str]:
    """(multiply-adds per second over ``threads`` threads, the instruction path timed)."""
    from torch.utils import cpp_extension

    build = Path(tempfile.gettempdir()) / "sluice-int8-peak"
    build.mkdir(exist_ok=True)
    module = cpp_extension.load_inline(name="sluice_int8_peak", cpp_sources=_SOURCE, functions=["peak"],
                                       build_directory=str(build), extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                       extra_ldflags=["-fopenmp"], verbose=False)
    rate, path = module.peak(iters, threads)
    return float(rate), str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20_000_000, help="rounds of 12 instructions per thread")
    args = ap.parse_args(argv)
    rate, path = measure(args.threads, args.iters)
    if rate == 0:
        print(f"{path}: nothing to time")
        return 1
    print(f"{path}, {args.threads} threads: {rate / 1e9:.0f} G int8 multiply-adds/s "
          f"({rate / 1e9 / args.threads:.0f} per thread)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
