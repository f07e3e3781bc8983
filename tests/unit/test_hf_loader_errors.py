"""Hugging Face folders that do not load are one clean line, as GGUF files are: a
``ModelLoadError`` naming the folder and the field or tensor, and, from ``sluice engine``, no
traceback. A config.json with a string where a number belongs used to escape as a TypeError."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.engine.errors import ModelLoadError
from sluice.engine.loaders import load_model
from tests.tiny_model import write_tiny_folder

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def folder(tmp_path):
    return write_tiny_folder(tmp_path / "m")


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | changes))


@pytest.mark.parametrize(("field", "value"), [("hidden_size", "64"), ("num_hidden_layers", 2.5),
                                              ("vocab_size", True), ("num_key_value_heads", -1),
                                              ("rope_theta", "1e4")])
def test_a_config_field_of_the_wrong_type_names_the_field(folder, field, value):
    _edit_config(folder, **{field: value})
    with pytest.raises(ModelLoadError, match=rf"^{folder}: {field}: must be a "):
        load_model(folder)


def test_a_config_that_is_not_an_object(folder):
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="config.json must hold a JSON object, got list"):
        load_model(folder)


def test_the_engine_prints_one_line_and_no_traceback(folder):
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"][:10]
    save_file(weights, str(folder / "model.safetensors"))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "sluice.engine.cli", "engine", str(folder), "--device", "cpu",
                           "--port", "0"], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "tensor 'model.layers.0.mlp.up_proj.weight' has shape (10, 64), expected (128, 64)" in proc.stderr
