"""README.md stays true of the code: what it names exists, and its Python examples run.

Checked over the README (the checkers take the text, so that the tests at the end can show each
one failing on a README that is wrong):

* every repo path it names (a token under one of the top-level folders, or a top-level file, in
  code or in a link) exists; every ``python -m sluice....`` module too;
* no link or path leaves the repository (``../``, absolute paths of this machine, ``file:``);
* every ``make TARGET`` is a target of the Makefile;
* every ``sluice SUBCOMMAND ...`` in code names a real subcommand, and each ``--flag`` of it
  appears in that subcommand's ``--help`` (the CLI's argparse, built in-process); a code span that
  is a bare ``--flag`` must be a flag of some subcommand; ``python bench/X.py --flag`` is checked
  against that script's ``--help``;
* the override table lists exactly ``engine.overrides.KEYS``, and the limits table only keys of
  ``http_facade.limits.RequestLimits``;
* the two regions other engineers regenerate are there, once each;
* it is under 500 lines;
* every ```python block runs (in a subprocess, with the short model names unknown, so that it can
  only have run on the tiny model or on nothing) unless the line before it is
  ``<!-- needs: default-model -->``; those are compiled.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 500
NEEDS_DEFAULT_MODEL = "<!-- needs: default-model -->"
MODELS_HEADER = "| architecture | models | CPU float32 | CPU block formats | GPU | what is refused |"
REGIONS = ("json-schema-keywords", "gguf-formats", "models")
TOP_DIRS = (".ci", "bench", "engine", "http_facade", "kernels", "proto", "tests")
TOP_FILES = ("Makefile", "pyproject.toml", "README.md")
PACKAGE_DIRS = {"sluice.engine": "engine", "sluice.kernels": "kernels", "sluice.http_facade": "http_facade"}
# What an unmarked example runs under: short names resolve to nothing, so an example that loads
# the default model fails instead of passing slowly.
PRELUDE = "import sluice.engine.models.registry as _r\n_r.SHORT_NAMES.clear()\n"


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int                # 1-based line of the opening fence
    needs_default_model: bool


def blocks(text: str) -> list[Block]:
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        before = next((ln.strip() for ln in reversed(lines[:start]) if ln.strip()), "")
        found.append(Block(m.group(1), "\n".join(body) + "\n", start + 1, before == NEEDS_DEFAULT_MODEL))
        i += 1
    return found


def prose(text: str) -> str:
    """The text outside fenced blocks."""
    return re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)


def code_spans(text: str) -> list[str]:
    return [" ".join(s.replace("\\|", "|").split()) for s in re.findall(r"`([^`]+)`", prose(text))]


def shell_lines(text: str) -> list[str]:
    """Commands: lines of bash/sh/console blocks (continuations joined), and code spans."""
    out = []
    for b in blocks(text):
        if b.lang in ("bash", "sh", "shell", "console", ""):
            out += [ln for ln in b.code.replace("\\\n", " ").splitlines() if ln.strip()]
    return out + code_spans(text)


def link_targets(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", prose(text))


# ---- the checkers: each returns what is wrong ---------------------------------------------------
def _strip(token: str) -> str:
    return token.strip("'\"()[],;:").rstrip(".").split("#")[0]


def repo_paths(text: str) -> set[str]:
    tokens = set(link_targets(text))
    for chunk in shell_lines(text) + [b.code for b in blocks(text)]:
        tokens.update(chunk.split())
    paths = set()
    for tok in map(_strip, tokens):
        if tok in TOP_FILES or re.fullmatch(rf"(?:{'|'.join(map(re.escape, TOP_DIRS))})/[\w./-]*", tok):
            paths.add(tok)
    return paths


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    wrong = [p for p in sorted(repo_paths(text)) if not (root / p).exists()]
    for module in re.findall(r"python -m (sluice(?:\.\w+)+)", " ".join(shell_lines(text))):
        head = ".".join(module.split(".")[:2])
        rel = Path(PACKAGE_DIRS.get(head, "?"), *module.split(".")[2:])
        if not ((root / rel).with_suffix(".py").exists() or (root / rel / "__init__.py").exists()):
            wrong.append(f"module {module}")
    return wrong


def leaving_paths(text: str, root: Path = ROOT) -> list[str]:
    wrong = [f"..{m}" for m in re.findall(r"\.\.(/[^\s`)]*)", text)]
    wrong += re.findall(r"(?:file:|(?<![\w/.])(?:/work|/home|/root|~)/)[^\s`)]*", text)
    for target in link_targets(text):
        if re.match(r"(https?:|mailto:|#)", target):
            continue
        path = (root / target.split("#")[0]).resolve()
        if not path.is_relative_to(root) or not path.exists():
            wrong.append(target)
    return wrong


def makefile_targets(root: Path = ROOT) -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (root / "Makefile").read_text(), re.M))


def missing_make_targets(text: str, root: Path = ROOT) -> list[str]:
    named = set()
    for line in shell_lines(text):
        named.update(re.findall(r"(?<![\w-])make ([a-z][\w-]*)", line))
    return sorted(named - makefile_targets(root))


@lru_cache(maxsize=None)
def cli_help() -> dict[str, str]:
    """``{"": top-level help, subcommand: its help}`` from the real argparse parser."""
    from sluice.engine.cli import _build_parser

    parser = _build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": parser.format_help(), **{name: p.format_help() for name, p in subs.choices.items()}}


@lru_cache(maxsize=None)
def script_help(script: str) -> str:
    run = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    return run.stdout if run.returncode == 0 else ""


def _flags(words: list[str]) -> list[str]:
    flags = []
    for w in words:
        if w in ("|", "&&", ";", "||") or w.startswith("#"):
            break
        if m := re.match(r"^(--[a-z][\w-]*)", w):
            flags.append(m.group(1))
    return flags


def _has_flag(help_text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_text) is not None


def wrong_commands(text: str) -> list[str]:
    helps = cli_help()
    wrong = []
    for line in shell_lines(text):
        for m in re.finditer(r"(?:^|[\s/])sluice\s+(.*)", line):
            words = m.group(1).split()
            sub = words[0] if words and not words[0].startswith("-") else ""
            if sub not in helps:
                wrong.append(f"sluice {sub}: no such subcommand")
                continue
            for flag in _flags(words[1:] if sub else words):
                if not _has_flag(helps[sub], flag):
                    wrong.append(f"sluice {sub} {flag}: not in its --help")
        for m in re.finditer(r"python (bench/\w+\.py)\s*(.*)", line):
            if not (ROOT / m.group(1)).exists():
                continue                                   # missing_paths reports it
            help_text = script_help(m.group(1))
            for flag in _flags(m.group(2).split()):
                if not _has_flag(help_text, flag):
                    wrong.append(f"python {m.group(1)} {flag}: not in its --help")
    every = "\n".join(helps.values())
    for span in code_spans(text):
        if m := re.match(r"^(--[a-z][\w-]*)", span):
            if not _has_flag(every, m.group(1)):
                wrong.append(f"{m.group(1)}: no sluice subcommand has it")
    return wrong


def table_first_column(text: str, header: str) -> list[str]:
    """The backticked names in the first column of the table whose header row is ``header``."""
    lines = text.splitlines()
    start = lines.index(header) + 2
    names = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def wrong_tables(text: str) -> list[str]:
    from sluice.engine.models.config import ARCHITECTURES
    from sluice.engine.overrides import KEYS
    from sluice.http_facade.limits import RequestLimits

    wrong = []
    try:
        listed = set(table_first_column(text, "| key | what it sets |"))
        wrong += [f"override {k}: not in engine.overrides.KEYS" for k in sorted(listed - set(KEYS))]
        wrong += [f"override {k}: missing from the README's table" for k in sorted(set(KEYS) - listed)]
    except ValueError:
        wrong.append("no override table (header '| key | what it sets |')")
    try:
        listed = table_first_column(text, MODELS_HEADER)
        wrong += [f"architecture {a}: not in engine.models.config.ARCHITECTURES"
                  for a in listed if a not in ARCHITECTURES]
        wrong += [f"architecture {a}: missing from the README's model table"
                  for a in ARCHITECTURES if a not in listed]
    except ValueError:
        wrong.append(f"no model table (header {MODELS_HEADER!r})")
    try:
        limits = {f.name for f in fields(RequestLimits)}
        wrong += [f"limit {k}: not a RequestLimits field"
                  for k in table_first_column(text, "| key | default | bounds |") if k not in limits]
    except ValueError:
        wrong.append("no limits table (header '| key | default | bounds |')")
    return wrong


def wrong_regions(text: str) -> list[str]:
    wrong = []
    for name in REGIONS:
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
            wrong.append(f"region {name}: needs one {begin} before one {end}")
    return wrong


def failing_examples(text: str) -> list[str]:
    wrong = []
    for b in blocks(text):
        if b.lang != "python":
            continue
        try:
            compile(b.code, f"README.md:{b.line}", "exec")
        except SyntaxError as exc:
            wrong.append(f"README.md:{b.line}: does not compile: {exc}")
            continue
        if b.needs_default_model:
            continue
        run = subprocess.run([sys.executable, "-c", PRELUDE + b.code], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        if run.returncode != 0:
            wrong.append(f"README.md:{b.line}: exit {run.returncode}: {run.stderr.strip()[-600:]}")
    return wrong


# ---- the README itself -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text()


def test_readme_is_short(readme):
    assert len(readme.splitlines()) < MAX_LINES, f"README.md has {len(readme.splitlines())} lines"


def test_every_path_it_names_exists(readme):
    assert repo_paths(readme), "found no repo paths at all: the path pattern is broken"
    assert missing_paths(readme) == []


def test_nothing_leaves_the_repository(readme):
    assert leaving_paths(readme) == []


def test_every_make_target_exists(readme):
    assert {"serve", "test"} <= set(re.findall(r"make (\w+)", readme))
    assert missing_make_targets(readme) == []


def test_every_command_and_flag_is_in_the_cli_help(readme):
    assert wrong_commands(readme) == []


def test_reference_tables_match_the_code(readme):
    assert wrong_tables(readme) == []


def test_regenerated_regions_are_there(readme):
    assert wrong_regions(readme) == []


def test_python_examples_run_on_the_tiny_model_or_are_marked(readme):
    python = [b for b in blocks(readme) if b.lang == "python"]
    assert any(not b.needs_default_model for b in python), "no example runs on the tiny model"
    assert failing_examples(readme) == []


# ---- each checker fails on a README that is wrong ----------------------------------------------
BAD = """# bad
See [the design](../shared/ARCHITECTURE.md) and `engine/no_such_module.py`, or /work/shared/x.

```bash
make serve
make deploy
sluice serve smollm2 --port 8000 --no-such-flag
sluice launch smollm2
python -m sluice.engine.no_such_module
python bench/serving.py --concurrency 1 --no-such-bench-flag
```

`--grace` is real; `--made-up-option` is not.

| key | what it sets |
| --- | --- |
| `max_num_sequence` | batch size |
| `max_made_up` | nothing |

| key | default | bounds |
| --- | --- | --- |
| `max_made_up_limit` | 1 | nothing |

| architecture | models | CPU float32 | CPU block formats | GPU | what is refused |
| --- | --- | --- | --- | --- | --- |
| `llama` | Llama | C++ stack | C++ stack | |
| `gemma7` | none | | | |

<!-- gguf-formats:begin -->

```python
raise SystemExit("an example that fails")
```

<!-- needs: default-model -->
```python
print("unclosed"
```
"""


def test_the_checkers_catch_a_wrong_readme():
    assert missing_paths(BAD) == ["engine/no_such_module.py", "module sluice.engine.no_such_module"]
    assert set(leaving_paths(BAD)) == {"../shared/ARCHITECTURE.md", "/work/shared/x.", "../shared/ARCHITECTURE.md"}
    assert missing_make_targets(BAD) == ["deploy"]
    assert wrong_commands(BAD) == [
        "sluice serve --no-such-flag: not in its --help",
        "sluice launch: no such subcommand",
        "python bench/serving.py --no-such-bench-flag: not in its --help",
        "--made-up-option: no sluice subcommand has it",
    ]
    tables = wrong_tables(BAD)
    assert "override max_made_up: not in engine.overrides.KEYS" in tables
    assert "override prefill_chunk_size: missing from the README's table" in tables
    assert "limit max_made_up_limit: not a RequestLimits field" in tables
    assert "architecture gemma7: not in engine.models.config.ARCHITECTURES" in tables
    assert "architecture qwen3: missing from the README's model table" in tables
    assert wrong_regions(BAD) == [
        "region json-schema-keywords: needs one <!-- json-schema-keywords:begin --> before one "
        "<!-- json-schema-keywords:end -->",
        "region gguf-formats: needs one <!-- gguf-formats:begin --> before one <!-- gguf-formats:end -->",
        "region models: needs one <!-- models:begin --> before one <!-- models:end -->"]
    failures = failing_examples(BAD)
    assert len(failures) == 2
    assert "exit 1" in failures[0] and "an example that fails" in failures[0]
    assert "does not compile" in failures[1]


def test_an_unmarked_example_cannot_use_the_default_model():
    text = "```python\nfrom sluice.engine import LLM\nLLM('smollm2')\n```\n"
    (failure,) = failing_examples(text)
    assert "not a file, a folder or a known model name" in failure
