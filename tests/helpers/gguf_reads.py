"""Loading a GGUF while recording which tensors the loader asked for as float32 arrays: a block
kept as stored is read as raw bytes and never shows up here."""
from __future__ import annotations

import pytest

from sluice.engine.loaders import gguf_loader, load_model


def load_recording_float_reads(path, quantization: str = "auto"):
    """(the loaded model, [(tensor name, its GGUF type)] of every tensor read as float32)."""
    read = []
    getitem = gguf_loader.GGUFWeights.__getitem__

    def spy(self, name):
        read.append((name, self.tensor_type(name)))
        return getitem(self, name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_loader.GGUFWeights, "__getitem__", spy)
        model = load_model(path, dtype="float32", quantization=quantization)
    return model, read
