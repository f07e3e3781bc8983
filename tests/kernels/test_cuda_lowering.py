"""Every kernel compiles to a CUDA cubin (all in bf16 for sm_90; attention also fp32, sm_80 fp16, and
head_dim 256 on sm_80), each within its architecture's shared memory, on this GPU-less machine,
which the interpreter alone cannot show: it catches loop-carried type changes, constructs the
compiler rejects, the integer-1 specialisation of launch arguments and shared memory overruns. Runs in a
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
    assert "all kernels lowered" in proc.stdout
