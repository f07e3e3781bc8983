"""``bench/structured.py --quick`` runs both sections end to end on the random-weight model with
SmolLM2's vocabulary: the constrained and plain runs produce the same token count (what makes
the overhead a per-step figure), and every schema compiles, cold then from the cache."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_structured_bench_quick(tmp_path, tiny_smollm2):
    out = tmp_path / "structured.json"
    proc = subprocess.run([sys.executable, "bench/structured.py", "--quick", "--model", str(tiny_smollm2),
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=280,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    over = [r for r in rows if r["section"] == "overhead"]
    assert [r["batch"] for r in over] == [1, 2] and all(r["same_token_count"] and r["tokens"] for r in over)
    comp = {r["which"]: r for r in rows if r["section"] == "compile"}
    assert comp["cold"]["schemas"] == 3 and comp["cached"]["max_ms"] < comp["cold"]["max_ms"]
