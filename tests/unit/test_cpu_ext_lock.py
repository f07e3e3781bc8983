"""A build of the C++ kernels killed midway (Ctrl-C during a first ``sluice serve``, after the
objects were compiled and before the library was linked) leaves torch's ``lock`` file in the
build folder, and torch waits for that file to go, without a timeout. The next load must not hang
on it, and must say that it is building."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_stale_build_lock_does_not_hang_the_next_load(tmp_path):
    from sluice.kernels import cpu_ext

    assert cpu_ext.available(), cpu_ext.unavailable_reason()
    built = cpu_ext.build_dir()
    copy = tmp_path / "ext" / built.name
    shutil.copytree(built, copy)          # modification times kept: only the link runs again
    (copy / "lock").touch()               # what the killed build left: its lock, no library
    library = copy / "sluice_cpu.so"
    library.unlink()
    env = {**os.environ, "SLUICE_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    code = ("import logging; logging.basicConfig(level='INFO'); "
            "from sluice.kernels import cpu_ext; print(cpu_ext.module().__file__)")
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        raise AssertionError("loading the kernels waited on the stale lock file") from None
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith(str(copy)) and library.is_file()   # linked again, in place
    assert not (copy / "lock").exists()
    assert f"compiling sluice's C++ CPU kernels into {copy}" in proc.stderr
