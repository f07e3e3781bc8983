"""``bench/kquant.py`` runs end to end on a small shape: one row per row count, a cell per format
(float32, Q4_1, Q8_0 and the K-quant / 5-bit / IQ4 formats), each with its ratios; so does
``bench/hugepages.py``. Nothing is measured here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sluice.engine.models.kquant import KQUANT_TYPES

REPO = Path(__file__).resolve().parents[2]


def test_kquant_bench_prints_one_row_per_shape_and_row_count():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "bench/kquant.py", "--rows", "1,3", "--shapes", "48x512",
                           "--budget", "0.01", "--threads", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 48×512 |")]
    assert len(rows) == 2, proc.stdout
    cells = [r.strip("|").split("|") for r in rows]
    # shape, rows, float32, Q4_1, Q8_0 and every format cpu_kquant keeps as stored
    assert all(len(c) == 5 + len(KQUANT_TYPES) for c in cells), rows
    assert all(c.count(",") == 1 for r in cells for c in r[3:]), rows      # (x float32, x Q4_1)
    paths = ("avx512vnni", "avxvnni", "avx2", "portable")      # cpu_kquant.isa()'s names
    assert any(f"K-quant path: {p}," in proc.stdout for p in paths), proc.stdout[:300]


def test_hugepages_bench_prints_one_row_per_format_shape_and_row_count():
    """``bench/hugepages.py``: both sets of copies compute the same outputs (it asserts that), a
    row per (format, shape, rows), and the process's AnonHugePages at the end."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "bench/hugepages.py", "--kinds", "Q4_1,Q6_K", "--rows", "1,2",
                           "--shapes", "64x256", "--budget", "0.01", "--threads", "1", "--cold-mib", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [line.strip("|").split("|") for line in proc.stdout.splitlines() if "| 64×256 |" in line]
    assert [(r[0].strip(), r[2].strip()) for r in rows] == [("Q4_1", "1"), ("Q4_1", "2"), ("Q6_K", "1"), ("Q6_K", "2")]
    assert all(len(r) == 7 and float(r[5]) > 0 for r in rows), rows
    assert "AnonHugePages:" in proc.stdout
