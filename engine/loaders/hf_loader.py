"""Read a Hugging Face model folder: ``config.json`` plus ``*.safetensors`` (one file, or shards
listed by ``model.safetensors.index.json``). Never pickle (no ``*.bin``), never a hub download.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from sluice.engine.errors import ModelLoadError
from sluice.engine.models.config import ModelArchConfig

ProgressFn = Callable[[int, int], None]   # (files done, files total)

_INDEX = "model.safetensors.index.json"


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ModelLoadError(f"{path}: unreadable config.json: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{path}: config.json must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def arch_from_folder(folder: Path) -> ModelArchConfig:
    try:
        return ModelArchConfig.from_hf_config(read_config(folder))
    except ValueError as exc:
        raise ModelLoadError(f"{folder}: {exc}") from exc


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files: the shards an index names, else every ``*.safetensors`` in the folder."""
    index = folder / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{index}: unreadable shard index: {exc}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shards named in {_INDEX} are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (found {pickled}: pickle checkpoints are never loaded; convert to safetensors)" if pickled else ""
        raise ModelLoadError(f"{folder}: no *.safetensors weights{hint}")
    return files


class SafetensorsWeights(Mapping):
    """Tensor name → tensor, read from its file on access (memory-mapped; nothing unpickled)."""

    def __init__(self, files: list[Path], progress: ProgressFn | None = None) -> None:
        from safetensors import safe_open

        self._handles, self._where = [], {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:  # SafetensorError, OSError, ...: the header does not parse
                raise ModelLoadError(f"{path}: not a readable safetensors file (corrupt or truncated?): {exc}") from exc
            self._handles.append(handle)
            for key in handle.keys():
                self._where[key] = (handle, path)
        self._progress, self._done = progress, 0

    def __getitem__(self, name: str) -> torch.Tensor:
        handle, path = self._where[name]
        try:
            t = handle.get_tensor(name)
        except Exception as exc:
            raise ModelLoadError(f"{path}: tensor {name!r} is unreadable (truncated file?): {exc}") from exc
        self._done += 1
        if self._progress is not None:
            self._progress(min(self._done, len(self._where)), len(self._where))
        return t

    def __contains__(self, name: object) -> bool:
        # Mapping's default would read (dequantize) the tensor just to test membership.
        return name in self._where

    def tensor_type(self, name: str) -> str:
        """The stored dtype as safetensors names it (``F32``, ``F16``, ``BF16``...), read from the header."""
        handle, _path = self._where[name]
        return handle.get_slice(name).get_dtype()

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def load_hf_folder(
    folder: str | Path, progress: ProgressFn | None = None
) -> tuple[ModelArchConfig, SafetensorsWeights]:
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: no such model folder")
    arch = arch_from_folder(folder)
    return arch, SafetensorsWeights(safetensors_files(folder), progress)
