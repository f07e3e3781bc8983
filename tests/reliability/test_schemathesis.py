"""Schemathesis against the facade's own ``/openapi.json`` (issue #16), on ``sluice serve`` with
the tiny model: a bounded, seeded run (``--max-examples`` per operation, fixed ``--seed``) whose
only check is ``not_a_server_error``: whatever it sends, no answer is a 5xx. Afterwards the
engine is idle (nothing leaked by the fuzzed requests)."""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.serve import REPO, Serve, wait_idle
from tests.tiny_model import write_tiny_folder

# The test runs schemathesis' command line; importing it here only to check it is there cost
# every collecting worker ~0.8 s.
if importlib.util.find_spec("schemathesis") is None:
    pytest.skip("schemathesis is in the dev extra", allow_module_level=True)
pytestmark = pytest.mark.timeout(600)
MAX_EXAMPLES, SEED = 10, 16


def _schemathesis() -> list[str]:
    exe = Path(sys.executable).with_name("schemathesis")
    return [str(exe)] if exe.exists() else [shutil.which("schemathesis") or "schemathesis"]


def test_schemathesis_finds_no_server_error(tmp_path):
    s = Serve(write_tiny_folder(tmp_path / "tiny"), tmp_path / "serve.log", api_key="st-key").wait_ready()
    try:
        run = subprocess.run(
            [*_schemathesis(), "run", s.url + "/openapi.json", "--checks", "not_a_server_error,response_schema_conformance",
             "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--phases", "examples,coverage,fuzzing",
             "--workers", "1", "--request-timeout", "60", "-H", "Authorization: Bearer st-key"],
            cwd=REPO, capture_output=True, text=True, timeout=540)
        summary = run.stdout[-4000:]
        (tmp_path / "schemathesis.txt").write_text(run.stdout + run.stderr)
        assert run.returncode == 0, summary + run.stderr[-2000:]
        counts = re.search(r"(\d+) generated, (\d+) passed", summary)
        assert counts and int(counts[1]) == int(counts[2]) > 100 and "failed" not in summary, summary
        wait_idle(s, timeout=60)
    finally:
        s.stop()
