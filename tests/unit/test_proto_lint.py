"""proto/ passes ``buf lint`` with buf's STANDARD rules (proto/buf.yaml), run by the buf that
``make setup`` installs into the venv (npm's @bufbuild/buf, pinned in the Makefile). A missing or
differently versioned buf fails these tests rather than skipping them: the contract's lint is
part of the suite. A control run on a copy with a known violation shows the rules are on."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTO = REPO / "proto"
# Makefile: BUF_DIR = $(VENV)/buf. The tests usually run on that venv's interpreter (sys.prefix is
# $(VENV)); a second venv made for other checks (.ci/floors) finds the default one's buf.
_CANDIDATES = [venv / "buf" / "node_modules" / ".bin" / "buf" for venv in (Path(sys.prefix), REPO / ".venv")]
BUF = next((path for path in _CANDIDATES if path.exists()), _CANDIDATES[0])


def _pinned_version() -> str:
    m = re.search(r"^BUF_VERSION\s*\??=\s*(\S+)", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert m, "the Makefile names no BUF_VERSION"
    return m.group(1)


def _buf(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BUF), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def buf() -> Path:
    pinned = _pinned_version()
    if not BUF.exists():
        pytest.fail(f"buf is not installed at {' or '.join(map(str, dict.fromkeys(_CANDIDATES)))}: run `make setup` "
                    f"(it installs @bufbuild/buf@{pinned} from npm into the venv)", pytrace=False)
    proc = _buf("--version", cwd=REPO)
    if proc.returncode != 0:
        pytest.fail(f"{BUF} --version failed ({proc.stderr.strip()}): run `make setup`", pytrace=False)
    found = proc.stdout.strip() or proc.stderr.strip()
    if found != pinned:
        pytest.fail(f"buf {found} is installed, the Makefile pins {pinned}: run `make setup`", pytrace=False)
    return BUF


def test_proto_passes_buf_lint(buf: Path) -> None:
    proc = _buf("lint", cwd=PROTO)
    assert proc.returncode == 0, f"buf lint (STANDARD rules) found problems in proto/:\n{proc.stdout}{proc.stderr}"


def test_buf_lint_reports_a_violation_in_a_copy(buf: Path, tmp_path: Path) -> None:
    copy = tmp_path / "proto"
    shutil.copytree(PROTO, copy)
    source = copy / "sluice/v1/engine.proto"
    text = source.read_text()
    assert "service EngineService {" in text
    source.write_text(text.replace("service EngineService {", "service Engine {"))
    proc = _buf("lint", "--error-format=json", cwd=copy)
    assert proc.returncode != 0
    assert '"type":"SERVICE_SUFFIX"' in proc.stdout.replace(" ", ""), proc.stdout + proc.stderr
