#!/usr/bin/env bash
# The one prepared run for a session that is lent a GPU machine: the kernel tests on CUDA (the
# interpreter cases compiled for real, plus the `gpu`-marked ones), then bench/triton_kernels.py, whose
# table and goals go to $OUT/kernels.md for bench/README.md. It installs nothing: it needs torch,
# triton (>= 3.4), pytest, numpy, jinja2 and tokenizers, which the lent machine's python3 has.
#
#   from the device tool:  run(command="bash bench/gpu_check.sh", timeout_s=560)
#   anywhere else:         OUT=bench/results bash bench/gpu_check.sh
#
# Time: about a minute of kernel compiles for the tests and 3-5 minutes of benchmark sweeps
# (each stage is capped below so that the logs come back even when one hangs).
set -uo pipefail
out=${OUT:-bench/results}
mkdir -p "$out"
py=${PYTHON:-python3}
# Nothing is installed, so the import package `sluice` is put together from the checkout's
# folders (pyproject.toml maps sluice.engine to engine/ and so on) in a scratch folder on the path.
pkg=$(mktemp -d)
trap 'rm -rf "$pkg"' EXIT
mkdir "$pkg/sluice"
for d in engine kernels http_facade; do ln -s "$PWD/$d" "$pkg/sluice/$d"; done
export PYTHONUNBUFFERED=1 PYTHONPATH="$pkg:$PWD${PYTHONPATH:+:$PYTHONPATH}"

{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  $py -c 'import sys, torch, triton; print("python", sys.version.split()[0], "| torch", torch.__version__,
          "| triton", triton.__version__, "|", torch.cuda.get_device_name())'
} 2>&1 | tee "$out/env.txt"

# Left out: the cubin compile (superseded by running the kernels), the benchmark smoke test (the
# full benchmark runs next) and `slow` tests, which need the default model's wheel (too big to carry).
timeout 240 $py -m pytest -q -p no:cacheprovider -rs -o timeout=120 -m "not slow" tests/kernels \
    --deselect tests/kernels/test_cuda_lowering.py::test_all_kernels_lower_to_cubin \
    --deselect tests/kernels/test_bench_smoke.py::test_bench_kernels_quick 2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}

timeout 300 $py bench/triton_kernels.py --out "$out/kernels.md" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}

echo "kernel tests exit $tests, benchmark exit $bench" | tee -a "$out/env.txt"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
