"""bench/kernels.py --quick runs to completion: on CPU it checks every kernel under the
interpreter, says timing needs a GPU and exits 0."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_bench_kernels_quick():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels.py"), "--quick"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    if torch.cuda.is_available():
        assert "paged_decode" in proc.stdout and "% peak" in proc.stdout
    else:
        assert "match their torch references" in proc.stdout
        assert "timing needs a GPU" in proc.stdout
