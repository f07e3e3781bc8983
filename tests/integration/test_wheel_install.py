"""sluice as a user installs it: the built wheel (not the editable checkout) in a fresh virtualenv,
beside Hugging Face's ``kernels`` package (which owns the top-level name ``kernels``), and
``sluice serve`` started from a folder that holds a user's own ``engine/`` and ``kernels/``.
The server must answer a chat request, none of the user's folders may be imported, and
``import kernels`` must still give Hugging Face's package, also after sluice is uninstalled.

It serves the tiny random-weight SmolLM2 (a float32 folder: ``auto`` keeps float32, so nothing is
compiled). Served on the default GGUF, the installed package would first build its C++ kernels
for its own path (a minute or more on 2 cores) and load the embedding model, neither of which
the packaging needs to show; that the wheel ships the C++ sources where ``cpu_ext`` compiles them
from is checked instead.

Only sluice and Hugging Face's ``kernels`` (with its own dependencies, from the wheelhouse that
``make setup`` downloads) are installed into the new virtualenv. sluice's dependencies (torch,
grpcio, ...) are borrowed from the test virtualenv through a path entry appended *after* the
install, so that pip never sees (or touches) the test virtualenv's editable sluice, and the
editable install's import hook, which only a processed ``.pth`` file would start, stays off."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import requests

from tests.integration.conftest import REPO, free_port

pytestmark = pytest.mark.slow

WHEELHOUSE = Path(sys.prefix) / "wheelhouse"
# The installed copy compiles its own C++ kernels while the engine loads (they are keyed on their
# sources' folder): about two minutes on a quiet 2-core host, and more than four with the rest of
# the suite (or other builds) beside it. A start that never comes still fails, after this.
START_S = 600
# A user's own folders, named like sluice's layout: importing either one is a test failure.
HIJACK = "raise SystemExit('the working directory\\'s {name}/ was imported instead of sluice')\n"


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    if not (WHEELHOUSE / ".downloaded").exists():
        pytest.fail(f"{WHEELHOUSE} is missing Hugging Face's kernels wheels: run `make setup`")
    tmp = tmp_path_factory.mktemp("wheel")
    # Built from a copy of what the wheel is made of, so that no build/ folder lands in the checkout.
    src = tmp / "src"
    for name in ("engine", "kernels", "http_facade"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(src)])
    wheels = list(tmp.glob("sluice_llm-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp / "venv"
    # Without pip of its own (ensurepip takes ~4-8 s here): this pip installs into it by --python,
    # and leaves the ~40 packages uncompiled (bytecode is written when they are first imported;
    # compiling all of them took ~3 s more).
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    pip = [*_pip_for(venv), "install", "-q", "--no-index", "--no-compile"]
    _run([*pip, "--find-links", str(WHEELHOUSE), "kernels"])
    _run([*pip, "--no-deps", str(wheels[0])])
    site = Path(_run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                .stdout.strip())
    (site / "zz_borrowed_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _pip_for(venv: Path) -> list[str]:
    """The test virtualenv's pip, acting on ``venv``'s interpreter and site-packages only."""
    return [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]


def _where(venv: Path, cwd: Path, module: str) -> str:
    code = f"import importlib.util, json; print(json.dumps(importlib.util.find_spec({module!r}).origin))"
    return json.loads(_run([str(venv / "bin" / "python"), "-P", "-c", code], cwd=cwd).stdout)


def test_the_wheel_serves_beside_hf_kernels_from_a_folder_with_engine_and_kernels(fresh_venv, tmp_path, tiny_smollm2):
    work = tmp_path / "user_project"
    for name in ("engine", "kernels", "http_facade"):
        (work / name).mkdir(parents=True)
        (work / name / "__init__.py").write_text(HIJACK.format(name=name))
        (work / name / "cli.py").write_text(HIJACK.format(name=name))
    site = Path(_where(fresh_venv, tmp_path, "kernels")).parents[1]
    assert site.is_relative_to(fresh_venv), f"kernels from {site}, not the fresh virtualenv"
    assert Path(_where(fresh_venv, tmp_path, "sluice.kernels")).is_relative_to(site / "sluice")
    assert not Path(_where(fresh_venv, tmp_path, "sluice.engine")).is_relative_to(REPO)
    code = "from sluice.kernels import cpu_ext; print('\\n'.join(str(p) for p in cpu_ext._SOURCES if p.is_file()))"
    shipped = _run([str(fresh_venv / "bin" / "python"), "-P", "-c", code], cwd=tmp_path).stdout.split()
    assert [Path(p).name for p in shipped] == ["cpu_blockq.cpp", "cpu_kquant.cpp", "cpu_ops.cpp", "cpu_pages.cpp",
                                              "cpu_stack.cpp"], shipped
    assert all(Path(p).is_relative_to(site / "sluice" / "kernels") for p in shipped), shipped

    port = free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # The C++ kernels are keyed on their sources' folder, so the installed copy would compile its
    # own (two minutes here) before serving; the float32 tiny model serves through the Python
    # layers instead. That the sources ship is checked above; that they compile, by tests/unit.
    env["SLUICE_CPU_CPP_LAYERS"] = "0"
    cmd = [str(fresh_venv / "bin" / "sluice"), "serve", str(tiny_smollm2), "--device", "cpu", "--port", str(port),
           "--embedding-model", "none"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_S
        while "ready on" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"sluice serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready after {START_S}s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": str(tiny_smollm2), "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Name a river."}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert "was imported instead of sluice" not in log.read_text(errors="replace")

    # Each package owns its own files: removing sluice leaves Hugging Face's kernels whole. The
    # borrowed path goes first, so that this pip cannot see the test virtualenv's sluice at all.
    (site / "zz_borrowed_test_deps.pth").unlink()
    _run([*_pip_for(fresh_venv), "uninstall", "-q", "-y", "sluice-llm"])
    code = "import kernels, importlib.metadata as m; print(m.version('kernels'), kernels.__file__)"
    out = _run([str(fresh_venv / "bin" / "python"), "-P", "-c", code], cwd=tmp_path).stdout
    assert str(site) in out, out
