"""bench/triton_kernels.py --quick runs to completion: on CPU it checks every kernel under the
interpreter, says timing needs a GPU and exits 0. Its goal verdicts follow from the rows measured,
and its GPU measurement path runs end to end on CPU at a tiny sweep."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_bench_kernels_quick():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "triton_kernels.py"), "--quick"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    if torch.cuda.is_available():
        assert "paged_decode" in proc.stdout and "% peak" in proc.stdout
    else:
        assert "match their torch references" in proc.stdout
        assert "timing needs a GPU" in proc.stdout


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "triton_kernels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module        # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_goals_are_judged_from_the_measured_rows():
    bench = _bench_module()
    h200 = bench.peak_for("NVIDIA H200")
    rows = [
        bench.Row("paged_decode", "B=64 ctx=2048", 100.0, 4000.0, "GB/s", h200[1], {}),
        bench.Row("paged_prefill", "chunk=4096", 300.0, 200.0, "TFLOP/s", h200[0], {"flash-attn (dense)": 120.0}),
        bench.Row("sample", "B=256 V=128k top-p 0.9", 50.0, 2600.0, "GB/s", h200[1], {"torch sort top-p": 90.0}),
    ]
    assert bench.goals(rows, h200) == [
        "paged decode ≥ 80% of HBM bandwidth at B=64 × 2k: 83% (met)",
        "prefill ≥ 50% of flash-attn's throughput at 4k: 40% (missed)",
        "sampling ≥ 2× torch sort-based top-p at B=256 × 128k: 1.8× (missed)",
    ]
    assert rows[0].cells()[3:5] == ("4000 GB/s", "83%")
    assert rows[2].cells()[-1] == "torch sort top-p 90 µs (1.80×)"
    missing = bench.goals(rows[:1], None)
    assert all("not measured" in line for line in missing)


def test_the_gpu_measurement_path_runs_end_to_end_on_a_tiny_sweep(monkeypatch, tmp_path, device):
    """Every bench function, the table and the Markdown file, with fp16 and tiny shapes (timing by
    one wall-clock call instead of do_bench), on CPU under the interpreter, so that a GPU
    session's few minutes are not lost to a bug in the script."""
    import time

    bench = _bench_module()

    def one_call_us(fn):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6

    monkeypatch.setattr(bench, "DEVICE", device.type)
    monkeypatch.setattr(bench, "_us", one_call_us)
    monkeypatch.setattr(bench, "HEAD_DIM", 32)
    tiny = bench.Sweep(decode=((2, 40),), prefill=(20,), sample=(3,), penalties=(2,), rejection=(2,),
                       kv_store=(5,), verify=((2, 40),), vocab=300, dtype=torch.float16)
    rows = bench.measure(tiny, None)
    assert [r.kernel for r in rows] == ["kv_store", "paged_decode", "paged_prefill", "paged_prefill (tree)", "sample",
                                        "sample", "apply_penalties", "rejection_sample"]
    assert "torch ref" in rows[1].baselines and "sdpa (dense)" in rows[2].baselines
    assert "same rows, causal" in rows[3].baselines
    out = tmp_path / "kernels.md"
    bench.report(rows, None, "Device: cpu (test)", str(out))
    text = out.read_text()
    assert text.startswith("Device: cpu (test)") and text.count("\n| ") == len(rows) + 1
    assert "not measured" in text          # the goals' shapes are not in a tiny sweep
