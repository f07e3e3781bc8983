"""The scheduler and the KV block manager import no torch, directly or through their imports:
each is imported in a fresh interpreter, which then reports whether torch got loaded. A control
import of a module that does use torch shows the probe can tell."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))))
"""


def torch_modules_after_import(module: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, module], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["sluice.engine.scheduler", "sluice.engine.kv_cache",
                                    "sluice.engine.kv_cache.block_pool", "sluice.engine.kv_cache.block_manager"])
def test_module_does_not_import_torch(module):
    assert torch_modules_after_import(module) == []


def test_probe_detects_torch():
    assert "torch" in torch_modules_after_import("sluice.engine.attention.base")
