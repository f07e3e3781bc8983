"""The import package is ``sluice``: pyproject.toml maps ``sluice.engine``, ``sluice.kernels`` and
``sluice.http_facade`` onto the layout's folders and lists every package under them, and no file
in the repository imports the bare names (``engine``, ``kernels``, ``http_facade``), which belong
to nobody (Hugging Face's ``kernels`` package owns the top-level ``kernels``)."""
from __future__ import annotations

import ast
import importlib.machinery
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("engine", "kernels", "http_facade")
BARE = set(FOLDERS)


def _setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed_under_its_sluice_name():
    config = _setuptools()
    assert config["package-dir"] == {f"sluice.{f}": f for f in FOLDERS}
    on_disk = {"sluice." + ".".join(p.parent.relative_to(REPO).parts)
               for f in FOLDERS for p in (REPO / f).rglob("__init__.py") if "__pycache__" not in p.parts}
    assert sorted(config["packages"]) == sorted(on_disk)


def test_the_console_script_and_the_distribution_name():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == "sluice-llm"
    assert project["scripts"] == {"sluice": "sluice.engine.cli:main"}
    assert not any(re.match(r"torch\b.*<", d) for d in project["dependencies"]), "torch must not be capped"


def _bare_imports(source: str, where: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename=where)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
            names = [str(node.args[0].value)]
        found += [f"{where}:{node.lineno}: {n}" for n in names if n.split(".")[0] in BARE]
    return found


def test_nothing_imports_the_bare_folder_names():
    files = [p for p in REPO.rglob("*.py")
             if not any(part.startswith(".") or part in ("build", "__pycache__") for part in p.relative_to(REPO).parts)]
    assert len(files) > 100
    assert [hit for p in files for hit in _bare_imports(p.read_text(), str(p.relative_to(REPO)))] == []


@pytest.mark.parametrize("source", ["import kernels", "from engine.cli import main",
                                    "importlib.import_module('http_facade.cli')"])
def test_the_check_sees_a_bare_import(source):
    assert len(_bare_imports(source, "probe.py")) == 1
    assert _bare_imports(source.replace("kernels", "sluice.kernels").replace("engine", "sluice.engine")
                         .replace("http_facade", "sluice.http_facade"), "probe.py") == []


def _import_kernels_in_the_checkout(*python_args: str, pythonpath: list[Path]) -> subprocess.CompletedProcess:
    """``import kernels`` from a shell in the checkout: its root is sys.path[0], as in a test run."""
    code = "import kernels; print(kernels.WHO)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    return subprocess.run([sys.executable, *python_args, "-c", code], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def test_the_bare_name_kernels_is_never_this_checkouts_folder(tmp_path):
    # transformers (>= 5.25 requires Hugging Face's kernels) imports `kernels` whenever it is
    # installed; in a checkout, the folder kernels/ came first and transformers failed on it.
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("WHO = 'the installed kernels package'\n")
    found = _import_kernels_in_the_checkout(pythonpath=[REPO, site])
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.strip() == "the installed kernels package"
    # Not installed (-S: no site-packages): the name is missing, as anywhere else, also with the
    # checkout on sys.path by a second path (a symlink), which must not find the folder again.
    link = tmp_path / "checkout"
    link.symlink_to(REPO)
    missing = _import_kernels_in_the_checkout("-S", pythonpath=[link, REPO])
    assert "ModuleNotFoundError: No module named 'kernels'" in missing.stderr, missing.stderr[-2000:]


def test_no_bench_script_hides_an_installed_module():
    # A bench script runs with bench/ first on sys.path (and the suite imports some of them), so a
    # script named like an installed package hides it from everything in that process, e.g. a
    # bench/kernels.py hid Hugging Face's kernels from transformers.
    elsewhere = [p for p in sys.path if Path(p or os.curdir).resolve() not in (REPO, REPO / "bench")]
    hidden = [script.name for script in sorted((REPO / "bench").glob("*.py"))
              if importlib.machinery.PathFinder.find_spec(script.stem, elsewhere) is not None
              or script.stem in sys.builtin_module_names]
    assert hidden == []
