"""SmolLM2-135M re-quantized the way llama.cpp's Q4_K_M and IQ4_XS presets treat it, held as stored
(w8a8), against the same file in float32.

SmolLM2's rows of 576 are not whole K-quant super-blocks (256), so llama-quantize falls back to
Q5_0 for most of its tensors; only ffn_down (rows of 1536) takes K-quants. The file written here:
ffn_down Q4_K on even layers and Q6_K on odd ones, the other projections Q5_0 (Q5_1 for the
MLP's up), the embedding Q8_0 (tests/helpers/kquant_encode.py and gguf's encoder, from the
shipped Q4_1 file's values). IQ4_XS falls back to IQ4_NL (blocks of 32) the same way: ffn_down
IQ4_XS, the other projections IQ4_NL. Bounds are tests/model/test_quantization.py's for w8a8.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from sluice.engine.loaders import load_model
from sluice.engine.models import kquant
from tests.helpers.kquant_encode import encode
from tests.model.test_logits import _prefill_logits
from tests.model_files import smollm2_gguf

TEXT = (Path(__file__).parent / "perplexity_text.txt").read_text()


def _type_for(name: str, layer: int, preset: str) -> str | None:
    if not name.endswith(".weight") or "norm" in name:
        return None
    if name == "token_embd.weight":
        return "Q8_0"
    if preset == "IQ4_XS":
        return "IQ4_XS" if "ffn_down" in name else "IQ4_NL"
    if "ffn_down" in name:
        return "Q4_K" if layer % 2 == 0 else "Q6_K"
    return "Q5_1" if "ffn_up" in name else "Q5_0"


def write_requantized(path: Path, preset: str) -> None:
    import gguf
    from gguf.quants import dequantize

    from sluice.engine.loaders.gguf_loader import open_gguf

    reader = open_gguf(smollm2_gguf())
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        w = dequantize(np.asarray(tensor.data), tensor.tensor_type).astype(np.float32)   # GGUF's own row order
        parts = tensor.name.split(".")
        kind = _type_for(tensor.name, int(parts[1]) if parts[0] == "blk" else -1, preset)
        if kind is None:
            writer.add_tensor(tensor.name, w)
        else:
            writer.add_tensor(tensor.name, encode(w, kind), raw_dtype=T[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=["Q4_K_M", "IQ4_XS"])
def requantized(request, tmp_path_factory, smollm2):
    path = tmp_path_factory.mktemp("smollm2_k") / f"smollm2-{request.param}.gguf"
    write_requantized(path, request.param)
    return (request.param, load_model(path, dtype="float32", quantization="auto"),
            load_model(path, dtype="float32", quantization="none"))


def _perplexity(model, ids: list[int]) -> tuple[float, torch.Tensor]:
    logits = _prefill_logits(model, ids)
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    return math.exp(float(-logp.gather(1, torch.tensor(ids[1:])[:, None]).mean())), logits


def test_requantized_smollm2_is_held_as_stored_and_close_to_its_float32(requantized, smollm2):
    preset, stored, floats = requantized
    assert stored.quantization == "w8a8"
    down = [layer.mlp.down_proj.quantized for layer in stored.model.layers]
    assert all(isinstance(d, kquant.KQuantLinear) for d in down)
    gate_up = stored.model.layers[0].mlp.gate_up_proj.quantized
    if preset == "IQ4_XS":
        assert {d.fmt for d in down} == {"IQ4_XS"} and gate_up.fmt == "IQ4_NL"
    else:
        assert [d.fmt for d in down[:2]] == ["Q4_K", "Q6_K"]
        assert [p.fmt for p in gate_up.parts_] == ["Q5_0", "Q5_1"]
    ids = smollm2.tokenizer.encode(TEXT)
    ref_ppl, ref = _perplexity(floats.model, ids)
    ppl, ours = _perplexity(stored.model, ids)
    assert 10 < ref_ppl < 60
    # A file's perplexity moves with the mere order of float operations elsewhere, each change
    # re-rounded by the next product's int8 inputs: IQ4_XS (float32 38.42) measured 38.56 through
    # the C++ stack with the old attention kernel, 39.13 with its tiled successor and 38.94 through
    # the Python layers, so its bound is 3%. Since the K-quant products round their input per 256
    # (llama.cpp's Q8_K) rather than per 32, Q4_K_M (float32 31.28) measures 31.56 (+0.9%; 31.18 to
    # 31.32 per 32) and IQ4_XS 38.76: 2% for Q4_K_M, inside the 5% of the weight-only int4 format.
    bound = 0.03 if preset == "IQ4_XS" else 0.02
    assert abs(ppl / ref_ppl - 1) <= bound, f"perplexity {ppl:.3f} vs float32 {ref_ppl:.3f}"
    change = (ours - ref).abs()
    assert change.mean() <= 0.23, f"mean logit change {change.mean():.3f}"
    assert change.max() <= 2.5, f"max logit change {change.max():.3f}"
    top1 = float((ours.argmax(-1) == ref.argmax(-1)).double().mean())
    assert top1 >= 0.9, f"teacher-forced top-1 agreement {top1:.3f}"
    print(f"requantized SmolLM2 ({preset}): perplexity {ppl:.3f} vs {ref_ppl:.3f}, mean |dlogit| {change.mean():.3f}, "
          f"max {change.max():.3f}, top-1 {top1:.3f}")
