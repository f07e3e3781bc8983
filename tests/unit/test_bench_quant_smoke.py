"""``bench/quant.py --quick`` runs end to end (one child process per format) on the tiny
random-weight model and writes one row per format with every field of its table. Nothing is
measured here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_quant_bench_runs_on_the_tiny_model(tmp_path):
    from tests.tiny_model import write_tiny_folder

    folder = write_tiny_folder(tmp_path / "tiny")
    out = tmp_path / "quant.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "bench/quant.py", "--quick", "--model", str(folder),
                           "--formats", "none,int4", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert [r["format"] for r in rows] == ["none", "int4"]
    for r in rows:
        assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["batch8_tok_s"] > 0
        assert set(r["profile_ms"]) >= {"step", "projections", "attention", "lm_head", "sampling"}
    assert rows[1]["weights_mib"] < rows[0]["weights_mib"]
    assert "| int4 |" in proc.stdout


def test_blockq_bench_prints_one_row_per_shape_and_row_count():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "bench/blockq.py", "--rows", "1,3", "--budget", "0.01", "--threads", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "×" in line]
    assert len(rows) == 8, proc.stdout
    assert all(len(r.strip("|").split("|")) == 6 for r in rows), rows
    assert "block product path: " in proc.stdout and "path: None" not in proc.stdout


def test_gguf_rounding_bench_compares_a_file_with_itself():
    """``bench/gguf_rounding.py`` end to end on the shipped Q4_1 file as its own reference: every
    difference from the reference is zero, and auto (w4a8) differs from none by its activations'
    int8 rounding only (no weight is rounded)."""
    from tests.model_files import smollm2_gguf

    # The caller's path after the checkout: where sluice is this tree through it, so is the child's.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "bench/gguf_rounding.py", "--threads", "1", "--reference",
                           str(smollm2_gguf()), str(smollm2_gguf())],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith(f"| {smollm2_gguf().name} | Q4_1 | w4a8 |"))
    assert "| 0.0000 / 0.000, 1.000 | 0.0000 / 0.000, 1.000 |" in row, row
    assert f"| {smollm2_gguf().name} | Q4_1 | 210 | nan | nan, nan |" in proc.stdout
