"""GGUF types sluice has no kernel for (the IQ types below IQ4...: ``quantized._ROUNDED_TYPES``)
go to w8a8 under ``auto``, rounded to 8-bit blocks of 32 one tensor at a time, while the types it
keeps as stored stay so in the same file (llama.cpp's IQ3_XXS / IQ2_XXS presets mix those with
Q2_K / Q3_K / Q4_K / Q6_K / IQ4_NL / IQ4_XS).

Tiny random-weight Llamas written here: the rounded types' blocks are random bytes with their
float16 scales set so that the weights have a trained model's size (gguf dequantizes them, so
``quantization=none`` is the float32 reference), and so are the kept Q2_K / Q3_K / IQ4_NL /
IQ4_XS ones; Q4_K / Q6_K from tests/helpers/kquant_encode.py.

* Each rounded weight is within half a step of the 8-bit rounding (d / 2, d = its 32-block's
  largest |w| / 127 as float16) of gguf's float32, an exact bound of Q8_0's rule; the kept types
  are the file's values bit for bit.
* Logits against ``none``: test_quantization's w8a8 bounds (most of w8a8's change is its int8
  rounding of activations, which every block type has).
* The token embedding: a tied IQ3_XXS table is held once, by the 8-bit LM head; an untied IQ3_S
  table as int8 blocks (Q8_0's rule), beside a Q6_K output kept as stored; a tied Q2_K table is
  the head's Q2_K blocks, in w8a8 and w4a8.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from sluice.engine.loaders import load_model
from sluice.engine.loaders.quantized import _ROUNDED_TYPES
from sluice.engine.models import kquant, quant
from tests.helpers.gguf_reads import load_recording_float_reads
from tests.helpers.kquant_encode import encode
from tests.model import gguf_writing
from tests.model.test_logits import _prefill_logits

H, HEADS, KV_HEADS, INTER = 256, 4, 2, 512
D = H // HEADS
VOCAB = 256
TOKENS = ["<unk>", "<s>", "</s>", *"abcdefgh", "ab", "cd", *[f"z{i}" for i in range(VOCAB - 13)]]
SHAPES = {"attn_q": (H, H), "attn_k": (KV_HEADS * D, H), "attn_v": (KV_HEADS * D, H), "attn_output": (H, H),
          "ffn_gate": (INTER, H), "ffn_up": (INTER, H), "ffn_down": (H, INTER)}
# Layer 0: a fused q/k/v of three types, a gate/up of one rounded type; layer 1: IQ types, rounded
# (IQ3_S) and kept (IQ4_XS, IQ4_NL), and Q2_K kept; Q3_K kept in both.
MIXED = [{"attn_q": "IQ3_S", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "IQ4_NL",
          "ffn_gate": "IQ3_S", "ffn_up": "IQ3_S", "ffn_down": "Q3_K"},
         {"attn_q": "IQ3_S", "attn_k": "IQ3_S", "attn_v": "IQ4_XS", "attn_output": "Q3_K",
          "ffn_gate": "IQ4_XS", "ffn_up": "Q2_K", "ffn_down": "IQ3_S"}]
MAX_LOGIT_CHANGE, MEAN_LOGIT_CHANGE, AGREEMENT = 2.5, 0.23, 0.9   # test_quantization's w8a8 bounds
# Byte offsets of the float16 scales in one block (llama.cpp's block_q3_K: hmask, qs, scales, d;
# block_q2_K: scales, qs, d, dmin; block_iq3_xxs / block_iq3_s / block_iq4_nl / block_iq4_xs: d first).
_SCALE_OFFSETS = {"Q3_K": (108,), "Q2_K": (80, 82), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,)}


def random_blocks(rng, kind: str, shape: tuple[int, int], std: float) -> np.ndarray:
    """[rows, bytes] random ``kind`` blocks whose dequantized values have standard deviation ~``std``:
    random bytes, then each block's float16 scales set to a random factor of one common size.
    The values are linear in the scales, so the size is found from unit scales and applied."""
    block, size = GGML_QUANT_SIZES[T[kind]]
    rows, cols = shape
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    factor = rng.uniform(0.5, 1.5, (rows, cols // block)).astype(np.float32)

    def set_scales(values: np.ndarray) -> None:
        for offset in _SCALE_OFFSETS[kind]:
            raw[..., offset:offset + 2] = values.astype(np.float16).view(np.uint8).reshape(rows, cols // block, 2)

    set_scales(factor)
    unit = float(dequantize(raw.reshape(rows, -1), T[kind]).std())
    set_scales(factor * (std / unit))
    return raw.reshape(rows, -1)


def write_gguf(path, types: list[dict[str, str]], table: str, output: str | None = None) -> None:
    """A Llama with ``types`` per layer; a ``table`` token embedding, tied unless ``output`` (its type) is given."""
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    gguf_writing.tiny_llama_keys(writer, layers=len(types), context=256, hidden=H, inter=INTER,
                                 heads=HEADS, kv_heads=KV_HEADS, tokens=TOKENS)

    def add(name: str, shape: tuple[int, int], kind: str, std: float) -> None:
        if kind in _SCALE_OFFSETS:
            writer.add_tensor(name, random_blocks(rng, kind, shape, std), raw_dtype=T[kind])
        elif kind == "F16":
            writer.add_tensor(name, (rng.standard_normal(shape) * std).astype(np.float16))
        else:
            writer.add_tensor(name, encode((rng.standard_normal(shape) * std).astype(np.float32), kind), raw_dtype=T[kind])

    # Sizes of a trained model's (tests/model/test_kquant_model.py): logits of several units.
    add("token_embd.weight", (VOCAB, H), table, 0.6)
    if output is not None:
        add("output.weight", (VOCAB, H), output, 0.6)
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    for i, layer in enumerate(types):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
        for name, shape in SHAPES.items():
            add(f"blk.{i}.{name}.weight", shape, layer[name], 1 / np.sqrt(shape[1]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(auto's model, the tensors it read as float32 with their types, the float32 model), tied IQ3_XXS table."""
    path = tmp_path_factory.mktemp("rounded") / "mixed.gguf"
    write_gguf(path, MIXED, table="IQ3_XXS")
    auto, read = load_recording_float_reads(path)
    return auto, read, load_model(path, dtype="float32", quantization="none")


def _parts(linear) -> list:
    held = linear.quantized
    return list(held.parts_) if isinstance(held, kquant.StackedLinear) else [held]


def _describe(part) -> str:
    return part.fmt if isinstance(part, kquant.KQuantLinear) else f"{part.bits}-bit blocks"


def test_auto_rounds_only_the_types_it_has_no_kernel_for(mixed):
    auto, read, _floats = mixed
    assert auto.quantization == "w8a8"
    # Only the rounded types (and the float norms) were read as float32: Q2_K / Q3_K / Q4_K / Q6_K / IQ4 as blocks.
    assert {kind for _name, kind in read} == {"F32", "IQ3_XXS", "IQ3_S"}
    layer0, layer1 = auto.model.layers
    assert [_describe(p) for p in _parts(layer0.self_attn.qkv_proj)] == ["8-bit blocks", "Q4_K", "Q6_K"]
    assert [_describe(p) for p in _parts(layer0.self_attn.o_proj)] == ["IQ4_NL"]
    assert [_describe(p) for p in _parts(layer0.mlp.gate_up_proj)] == ["8-bit blocks"]       # IQ3_S + IQ3_S: one weight
    assert [_describe(p) for p in _parts(layer0.mlp.down_proj)] == ["Q3_K"]
    assert [_describe(p) for p in _parts(layer1.self_attn.o_proj)] == ["Q3_K"]
    assert [_describe(p) for p in _parts(layer1.self_attn.qkv_proj)] == ["8-bit blocks", "IQ4_XS"]   # IQ3_S, IQ3_S | IQ4_XS
    assert [_describe(p) for p in _parts(layer1.mlp.gate_up_proj)] == ["IQ4_XS", "Q2_K"]
    assert auto.model._cpu_decoder() is not None                                              # the C++ layer stack


def _within_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """|got - want| <= d / 2 per block of 32, d = the block's max |want| / 127 rounded to float16
    (Q8_0's rule; a d rounded down by float16 clamps the largest value by at most 127 d 2^-11)."""
    blocks = want.reshape(want.shape[0], -1, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    error = (got.reshape(blocks.shape) - blocks).abs()
    assert (error <= d * 0.5001 + 1e-12).all(), f"worst |error| / d: {float((error / d).max()):.3f}"
    assert float(error.max()) > 0                                                              # it was rounded


def test_weights_are_the_files_values_or_their_8_bit_rounding(mixed):
    auto, _read, floats = mixed
    for i, types in enumerate(MIXED):
        rows = {"self_attn.qkv_proj": ["attn_q", "attn_k", "attn_v"], "self_attn.o_proj": ["attn_output"],
                "mlp.gate_up_proj": ["ffn_gate", "ffn_up"], "mlp.down_proj": ["ffn_down"]}
        for module, names in rows.items():
            got = auto.model.layers[i].get_submodule(module).dense_weight()
            want = floats.model.layers[i].get_submodule(module).dense_weight()
            start = 0
            for name in names:
                n = SHAPES[name][0]
                if types[name] in _ROUNDED_TYPES:
                    _within_rounding(got[start:start + n], want[start:start + n])
                else:
                    assert torch.equal(got[start:start + n], want[start:start + n]), (i, name)
                start += n


def test_a_tied_iq3_xxs_table_is_held_once_by_the_8_bit_head(mixed):
    auto, _read, floats = mixed
    model = auto.model
    assert isinstance(model.quant_lm_head, quant.BlockQLinear) and model.quant_lm_head.bits == 8
    assert isinstance(model.quant_embedding, quant.TiedBlockEmbedding)
    assert model.quant_embedding.head is model.quant_lm_head and model.embed_tokens.weight is None
    table = model.quant_lm_head.dequantize()
    _within_rounding(table, floats.model.embed_tokens.weight)
    ids = torch.tensor([0, 5, 255, 5, 17])
    assert torch.equal(model.embed(ids), table[ids])


def test_logits_close_to_float32_teacher_forced(mixed):
    auto, _read, floats = mixed
    rng = np.random.default_rng(1)
    agree = total = 0
    for length in (9, 40, 120):
        ids = [1, *rng.integers(3, VOCAB, length).tolist()]
        ref = _prefill_logits(floats.model, ids)
        ours = _prefill_logits(auto.model, ids)
        change = (ours - ref).abs()
        assert float(ref.std()) > 1.0                       # logits of a useful size, not all near 0
        assert change.max() <= MAX_LOGIT_CHANGE, f"max logit change {change.max():.3f}"
        assert change.mean() <= MEAN_LOGIT_CHANGE, f"mean logit change {change.mean():.3f}"
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= AGREEMENT, f"top-1 agreement {agree / total:.3f}"


def test_an_untied_iq3_s_table_is_held_as_int8_blocks(tmp_path):
    path = tmp_path / "untied.gguf"
    write_gguf(path, [{name: "Q2_K" for name in SHAPES}], table="IQ3_S", output="Q6_K")
    auto = load_model(path, dtype="float32", quantization="auto")
    floats = load_model(path, dtype="float32", quantization="none")
    model = auto.model
    assert auto.quantization == "w8a8"
    assert isinstance(model.quant_lm_head, kquant.KQuantLinear) and model.quant_lm_head.fmt == "Q6_K"
    assert torch.equal(model.quant_lm_head.dequantize(), floats.model.lm_head.dense_weight())
    embedding = model.quant_embedding
    assert isinstance(embedding, quant.BlockInt8Embedding) and model.embed_tokens.weight is None
    assert embedding.nbytes == VOCAB * H * (1 + 4 / 32)                                       # not 4 bytes a value
    _within_rounding(embedding.dequantize(), floats.model.embed_tokens.weight)
    ids = torch.tensor([3, 0, 255, 3])
    assert torch.equal(model.embed(ids), embedding.dequantize()[ids])


def test_a_float16_projection_keeps_float32_and_cuda_keeps_none(tmp_path):
    """The rule judges every projection: one float16 among block ones would be rounded below the
    file's precision, so the file stays float32; off CPU every file does."""
    from sluice.engine.loaders.gguf_loader import load_gguf
    from sluice.engine.loaders.quantized import resolve_quantization

    for name, down, cpu in (("q2_k.gguf", "Q2_K", "w8a8"), ("f16-down.gguf", "F16", "none")):
        write_gguf(tmp_path / name, [{**MIXED[0], "ffn_down": down}], table="IQ3_XXS")
        _arch, weights, _reader = load_gguf(tmp_path / name)
        assert weights.tensor_type("model.layers.0.mlp.down_proj.weight") == down
        assert resolve_quantization("auto", weights, torch.device("cpu")) == cpu
        assert resolve_quantization("auto", weights, torch.device("cuda")) == "none"


def test_a_tied_q4_0_table_is_read_from_the_head_exactly(tmp_path):
    """llama-quantize --pure writes a Q4_0 table beside Q3_K projections: the 8-bit head holds its
    4-bit values as they are, so lookups read the head and are the file's values."""
    path = tmp_path / "q4_0-table.gguf"
    write_gguf(path, [{name: "Q3_K" for name in SHAPES}], table="Q4_0")
    model = load_model(path, dtype="float32", quantization="auto").model
    floats = load_model(path, dtype="float32", quantization="none").model
    assert isinstance(model.quant_embedding, quant.TiedBlockEmbedding)
    assert model.quant_embedding.head is model.quant_lm_head and model.embed_tokens.weight is None
    ids = torch.tensor([3, 0, 255, 3])
    assert torch.equal(model.embed(ids), floats.embed_tokens.weight[ids])


def test_a_q2_k_model_keeps_its_blocks_in_w8a8_and_w4a8(tmp_path):
    """Every projection and a tied table Q2_K (llama-quantize --pure Q2_K): kept as stored in both
    block formats, the head's blocks read by lookups; logits within the w8a8 bounds of float32's."""
    path = tmp_path / "q2_k.gguf"
    write_gguf(path, [{name: "Q2_K" for name in SHAPES}], table="Q2_K")
    floats = load_model(path, dtype="float32", quantization="none").model
    for fmt in ("auto", "w4a8"):
        held = load_model(path, dtype="float32", quantization=fmt)
        assert held.quantization == ("w8a8" if fmt == "auto" else "w4a8")
        model = held.model
        layer = model.layers[0]
        assert all(_describe(p) == "Q2_K" for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj) for p in _parts(m))
        assert isinstance(model.quant_lm_head, kquant.KQuantLinear) and model.quant_lm_head.fmt == "Q2_K"
        assert model.quant_embedding.head is model.quant_lm_head and model.embed_tokens.weight is None
        ids = torch.tensor([3, 0, 255, 3])
        assert torch.equal(model.embed(ids), floats.embed_tokens.weight[ids])
        assert torch.equal(layer.mlp.gate_up_proj.dense_weight(), floats.layers[0].mlp.gate_up_proj.dense_weight())
        ref = _prefill_logits(floats, [1, *range(3, 40)])
        ours = _prefill_logits(model, [1, *range(3, 40)])
        assert (ours - ref).abs().max() <= MAX_LOGIT_CHANGE and (ours - ref).abs().mean() <= MEAN_LOGIT_CHANGE
