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


def _pythonpath() -> str:
    """The child's: a caller's PYTHONPATH first (a package folder linking `sluice` to a worktree
    tests that tree, whose sources the parent built), then this checkout."""
    return os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)


def test_a_stale_build_lock_does_not_hang_the_next_load(tmp_path):
    from sluice.kernels import cpu_ext

    assert cpu_ext.available(), cpu_ext.unavailable_reason()
    built = cpu_ext.build_dir()
    copy = tmp_path / "ext" / built.name
    # Modification times kept: usually only the link runs again. Not when the folder was built for
    # an earlier checkout at the same path with the same sources (the folder's key): ninja then
    # finds the sources and torch's headers newer than its log and compiles again (~3 min on 2
    # busy cores), hence the timeout; a process waiting on the lock never ends.
    shutil.copytree(built, copy)
    (copy / "lock").touch()               # what the killed build left: its lock, no library
    library = copy / "sluice_cpu.so"
    library.unlink()
    env = {**os.environ, "SLUICE_CACHE_DIR": str(tmp_path), "PYTHONPATH": _pythonpath()}
    code = ("import logging; logging.basicConfig(level='INFO'); "
            "from sluice.kernels import cpu_ext; print(cpu_ext.module().__file__)")
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=420)
    except subprocess.TimeoutExpired:
        raise AssertionError("loading the kernels waited on the stale lock file") from None
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith(str(copy)) and library.is_file()   # linked again, in place
    assert not (copy / "lock").exists()
    assert f"compiling sluice's C++ CPU kernels into {copy}" in proc.stderr


def _load_in_child(cache_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLUICE_CACHE_DIR": str(cache_dir), "PYTHONPATH": _pythonpath()}
    code = ("import sys; from sluice.kernels import cpu_ext; print(cpu_ext.module().__file__); "
            "print('torch.utils.cpp_extension' in sys.modules)")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_a_built_library_loads_without_torchs_extension_builder_until_its_flags_change(tmp_path):
    """Once a build of these flags has loaded, later loads import the library directly (torch's
    builder imports setuptools, ~0.13 s of every engine start); a stamp of other flags (an edited
    VARIANTS) sends the load through the builder again, which checks the build and writes the stamp."""
    from sluice.kernels import cpu_ext

    assert cpu_ext.available(), cpu_ext.unavailable_reason()
    built = cpu_ext.build_dir()
    copy = tmp_path / "ext" / built.name
    shutil.copytree(built, copy)
    stamp = copy / "sluice_cpu.flags"
    stamp.write_text("cflags=['-O0'] ldflags=[]\n")
    first = _load_in_child(tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.split() == [str(copy / "sluice_cpu.so"), "True"]       # through the builder
    assert stamp.read_text() == cpu_ext._stamp_text("native")
    again = _load_in_child(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.split() == [str(copy / "sluice_cpu.so"), "False"]      # imported directly
