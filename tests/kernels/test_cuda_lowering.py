"""Every kernel compiles for CUDA in the configuration its launcher uses (all to a cubin in bf16
for sm_90; attention also to a cubin in sm_80 fp16 and bf16 at head_dim 256, and to LLVM IR in fp32
on sm_90 and at head_dim 256 on sm_80) on this GPU-less machine, within its architecture's
shared memory, and the sm_90 bf16 serving kernels neither spill nor load element by element.
The interpreter alone cannot show any of that: it also misses loop-carried type changes,
constructs the compiler rejects and the integer-1 specialisation of launch arguments. Runs in a
subprocess because this folder's tests run kernels under the interpreter."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_all_kernels_lower_to_cubin():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.cuda_lowering"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "all kernels lowered" in proc.stdout and "fp32 attention to LLVM IR" in proc.stdout
    assert "without spills" in proc.stdout
