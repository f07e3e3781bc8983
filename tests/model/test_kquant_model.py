"""A GGUF that mixes block types per tensor, as llama.cpp's Q4_K_M / Q5_K_M files do (Q4_K, Q5_K,
Q6_K, Q5_0, Q5_1, Q8_0, IQ4_XS and IQ4_NL here, with a fused q/k/v whose parts differ in type), on a tiny
random-weight Llama written by the test (tests/helpers/kquant_encode.py's encoder; gguf's own
for Q5_0 / Q5_1 / Q8_0).

* ``auto`` keeps every tensor as stored (w8a8): no block tensor is read as float32, each
  projection multiplies by exactly the file's values (gguf's ``dequantize``), the tied Q6_K
  table is held once, by the LM head, and lookups are the file's values.
* Against the same file in float32 (``quantization=none``, dequantized by gguf), with the same
  measures as tests/model/test_quantization.py: teacher-forced top-1 agreement and the logit
  change, never greedy-prefix agreement.
* Through the engine (the C++ layer stack): a request's greedy tokens are the same alone and in
  a batch with chunked prefill, and with n-gram speculation (verification rows) as without.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from sluice.engine.llm import LLM
from sluice.engine.loaders import load_model
from sluice.engine.loaders import gguf_loader
from sluice.engine.models import kquant, quant
from sluice.engine.models.llama import _Linear
from sluice.engine.sampling_params import SamplingParams
from tests.helpers.gguf_reads import load_recording_float_reads
from tests.helpers.kquant_encode import encode
from tests.helpers.pages import THP_BUILT, advised_huge, mapping_of
from tests.model import gguf_writing
from tests.model.test_logits import _prefill_logits

H, HEADS, KV_HEADS, INTER, LAYERS = 256, 4, 2, 512, 2
D = H // HEADS
TOKENS = ["<unk>", "<s>", "</s>", *"abcdefgh", "ab", "cd", *[f"z{i}" for i in range(243)]]   # 256
# Per layer, each projection's type (llama.cpp's Q4_K_M keeps attn_v and ffn_down in Q6_K on some
# layers); the tied embedding / LM head is Q6_K.
TYPES = [{"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
         {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q8_0", "attn_output": "IQ4_XS",
          "ffn_gate": "Q5_K", "ffn_up": "Q6_K", "ffn_down": "IQ4_NL"}]
HEAD_TYPE = "Q6_K"
MAX_LOGIT_CHANGE, MEAN_LOGIT_CHANGE, AGREEMENT = 2.5, 0.23, 0.9   # test_quantization's w8a8 bounds


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permutation of Q/K rows (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_mixed_gguf(path, untied: str | None = None) -> None:
    """``untied``: a token embedding of that type and a separate Q8_0 output matrix."""
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    gguf_writing.tiny_llama_keys(writer, layers=LAYERS, context=256, hidden=H, inter=INTER,
                                 heads=HEADS, kv_heads=KV_HEADS, tokens=TOKENS)

    def add(name: str, w: np.ndarray, kind: str | None) -> None:
        w = w.astype(np.float32)
        if kind is None:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, encode(w, kind), raw_dtype=T[kind])

    # Scaled so that the residual stream and the logits are of a trained model's size (logits of
    # several units, a clear best token at most positions).
    add("token_embd.weight", rng.standard_normal((len(TOKENS), H)) * 0.6, untied or HEAD_TYPE)
    if untied:
        add("output.weight", rng.standard_normal((len(TOKENS), H)) * 0.6, "Q8_0")
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(H), None)
    shapes = {"attn_q": (H, H), "attn_k": (KV_HEADS * D, H), "attn_v": (KV_HEADS * D, H), "attn_output": (H, H),
              "ffn_gate": (INTER, H), "ffn_up": (INTER, H), "ffn_down": (H, INTER)}
    for i, types in enumerate(TYPES):
        add(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(H), None)
        add(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(H), None)
        for name, shape in shapes.items():
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
            if name in ("attn_q", "attn_k"):
                w = _permute(w, HEADS if name == "attn_q" else KV_HEADS)
            add(f"blk.{i}.{name}.weight", w, types[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(path, the model kept as stored with what it read as float32, the float32 model)."""
    path = tmp_path_factory.mktemp("kquant") / "mixed.gguf"
    write_mixed_gguf(path)
    stored, read = load_recording_float_reads(path)
    return path, stored, read, load_model(path, dtype="float32", quantization="none")


def test_auto_keeps_every_tensor_as_stored(mixed):
    path, stored, read, _ = mixed
    assert stored.quantization == "w8a8"
    assert all(kind == "F32" for _name, kind in read), f"read as float32: {read}"
    model = stored.model
    layer0, layer1 = model.layers
    qkv0 = layer0.self_attn.qkv_proj.quantized
    assert isinstance(qkv0, kquant.StackedLinear)
    assert [(type(p).__name__, getattr(p, "fmt", None)) for p in qkv0.parts_] == [
        ("KQuantLinear", "Q4_K"), ("KQuantLinear", "Q6_K")]
    assert isinstance(layer0.mlp.gate_up_proj.quantized, kquant.KQuantLinear)      # Q4_K + Q4_K: one weight
    assert [getattr(p, "fmt", getattr(p, "bits", None)) for p in layer1.self_attn.qkv_proj.quantized.parts_] == [
        "Q5_0", "Q5_1", 8]
    assert (layer1.self_attn.o_proj.quantized.fmt, layer1.mlp.down_proj.quantized.fmt) == ("IQ4_XS", "IQ4_NL")
    assert isinstance(model.quant_lm_head, kquant.KQuantLinear) and model.quant_lm_head.fmt == "Q6_K"
    assert isinstance(model.quant_embedding, quant.TiedBlockEmbedding)
    assert model.quant_embedding.head is model.quant_lm_head and model.embed_tokens.weight is None
    assert model._cpu_decoder() is not None                                            # the C++ layer stack


def test_weights_are_the_files_values_bit_for_bit(mixed):
    _path, stored, _read, floats = mixed
    for i in range(LAYERS):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            got = stored.model.layers[i].get_submodule(name).dense_weight()
            assert torch.equal(got, floats.model.layers[i].get_submodule(name).dense_weight()), (i, name)
    table = floats.model.embed_tokens.weight
    assert torch.equal(stored.model.quant_lm_head.dequantize(), table)
    ids = torch.tensor([0, 5, 255, 5, 17])
    assert torch.equal(stored.model.embed(ids), table[ids])
    held = sum(m.quantized.nbytes for m in stored.model.modules() if isinstance(m, _Linear))
    held += stored.model.quant_lm_head.nbytes
    file_blocks = sum(int(t.n_bytes) for t in gguf_loader.open_gguf(_path).tensors if t.tensor_type.name != "F32")
    assert held <= 1.05 * file_blocks, (held, file_blocks)


def test_block_weights_are_loaded_onto_huge_pages(mixed, monkeypatch):
    """Every packed weight of the loaded model is its own mapping advised for huge pages (the
    threshold lowered to this tiny model's sizes), and the model computes the same bits as the
    shared one, whose weights are this small and so on the heap. (Whether heap memory is advised
    is not ours to say: numpy advises its own large buffers, which the heap may reuse.)"""
    from sluice.engine import heap
    from sluice.engine.models.kquant import block_cpp_parts

    from sluice.kernels import cpu_ext

    path, stored, _read, _floats = mixed
    monkeypatch.setattr(heap, "_HUGE_PAGE_MIN_BYTES", 4096)
    before = cpu_ext.module().huge_page_bytes()
    huge = load_model(path, quantization="auto").model
    linears = [m.quantized for m in huge.modules() if isinstance(m, _Linear)] + [huge.quant_lm_head]
    packed = [part[1] for w in linears for part in block_cpp_parts(w)]
    assert len(packed) == 13                      # stacked parts of differing types counted apart
    for t in packed:
        assert t.untyped_storage().data_ptr() % (2 << 20) == 0 and advised_huge(t.data_ptr()) is THP_BUILT
    assert cpu_ext.module().huge_page_bytes() - before >= sum(t.nbytes for t in packed)
    ids = [3, 9, 200, 11, 5, 40]
    assert torch.equal(_prefill_logits(huge, ids), _prefill_logits(stored.model, ids))


def test_a_prefaulted_arena_takes_the_packed_weights(mixed, monkeypatch):
    """``heap.prefault_weights`` before a load (what ``sluice engine`` does before its imports): the
    packed weights are pieces of the arena, advised for huge pages, the model computes the same bits
    as the shared one, the arena is no longer pending, and what the weights did not take is
    unmapped. A load that fails before its weights are built unmaps the whole arena."""
    from sluice.engine import heap
    from sluice.engine.errors import ModelLoadError
    from sluice.engine.models.kquant import block_cpp_parts

    path, stored, _read, _floats = mixed
    monkeypatch.setattr(heap, "_HUGE_PAGE_MIN_BYTES", 4096)
    assert heap.prefault_weights(path.stat().st_size + (4 << 20))
    arena = heap._arena["pending"]
    start, end = arena.address, arena.address + arena.length
    model = load_model(path, quantization="auto").model
    assert heap._arena["pending"] is None
    linears = [m.quantized for m in model.modules() if isinstance(m, _Linear)] + [model.quant_lm_head]
    packed = [part[1] for w in linears for part in block_cpp_parts(w)]
    assert len(packed) == 13
    for t in packed:
        assert start <= t.data_ptr() < end and advised_huge(t.data_ptr()) is THP_BUILT
    taken = max(t.untyped_storage().data_ptr() + t.untyped_storage().nbytes() for t in packed)
    rest = mapping_of(end - 4096)
    assert rest is None or rest[0] >= taken         # the untaken tail unmapped
    ids = [3, 9, 200, 11, 5, 40]
    assert torch.equal(_prefill_logits(model, ids), _prefill_logits(stored.model, ids))

    assert heap.prefault_weights(4 << 20)
    lost = heap._arena["pending"].address
    with pytest.raises(ModelLoadError):
        load_model(path.parent / "missing.gguf", quantization="auto")
    assert heap._arena["pending"] is None
    found = mapping_of(lost)
    assert found is None or found[0] > lost or found[1] <= lost

    # A float32 load has no block weights to take it: the arena goes before the weights are built.
    import sluice.engine.loaders as loaders

    pending_at_build = []
    build = loaders.build_model
    monkeypatch.setattr(loaders, "build_model", lambda *a, **k: pending_at_build.append(heap._arena["pending"])
                        or build(*a, **k))
    assert heap.prefault_weights(4 << 20)
    load_model(path, dtype="float32", quantization="none")
    assert pending_at_build == [None]


def test_the_load_unmaps_each_layers_file_pages_once_its_weights_are_built(mixed, monkeypatch):
    """``GGUFWeights.release_read``: ``load_hf_weights`` hands back the file pages of what it has
    read before each layer and after the last (a mapped page counts in the RSS while it stays
    mapped: the load's peak was the file plus the weights), each tensor's whole pages once, and a
    view read again afterwards reads the same bytes (from the page cache)."""
    import mmap

    path = mixed[0]
    batches: list[list[tuple[int, int]]] = []
    real = gguf_loader.GGUFWeights.release_read

    def spy(self):
        batches.append(list(self._read))
        real(self)

    monkeypatch.setattr(gguf_loader.GGUFWeights, "release_read", spy)
    load_model(path, quantization="auto")
    assert len(batches) == LAYERS + 1
    released = [r for batch in batches for r in batch]
    assert len(released) == len(set(released))
    tensors = gguf_loader.open_gguf(path).tensors
    for i in range(LAYERS):        # layer i's tensors, released before layer i + 1 is read
        assert {(int(t.data_offset), int(t.n_bytes)) for t in tensors if t.name.startswith(f"blk.{i}.")} <= \
            set(batches[i + 1])
    monkeypatch.undo()

    class Recording:
        def __init__(self, mapping) -> None:
            self.mapping, self.calls = mapping, []

        def madvise(self, *args):
            self.calls.append(args)
            return self.mapping.madvise(*args)

    _arch, weights, _reader = gguf_loader.load_gguf(path)
    weights._mapping = Recording(weights._mapping)
    _kind, raw = weights.blocks("model.layers.0.mlp.gate_proj.weight")
    before = raw.clone()
    gate = next(t for t in tensors if t.name == "blk.0.ffn_gate.weight")
    offset, size = int(gate.data_offset), int(gate.n_bytes)
    weights.release_read()
    [(advice, start, length)] = weights._mapping.calls
    assert advice == mmap.MADV_DONTNEED and start % mmap.PAGESIZE == 0 and length % mmap.PAGESIZE == 0
    assert offset <= start < start + length <= offset + size and length >= size - 2 * mmap.PAGESIZE
    assert torch.equal(raw, before)
    weights.release_read()         # nothing read since: nothing advised
    assert len(weights._mapping.calls) == 1


def test_logits_close_to_float32_teacher_forced(mixed):
    _path, stored, _read, floats = mixed
    rng = np.random.default_rng(1)
    agree = total = 0
    for length in (9, 40, 120):
        ids = [1, *rng.integers(3, len(TOKENS), length).tolist()]
        ref = _prefill_logits(floats.model, ids)
        ours = _prefill_logits(stored.model, ids)
        change = (ours - ref).abs()
        assert change.max() <= MAX_LOGIT_CHANGE, f"max logit change {change.max():.3f}"
        assert change.mean() <= MEAN_LOGIT_CHANGE, f"mean logit change {change.mean():.3f}"
        assert float(ref.std()) > 1.0                       # logits of a useful size, not all near 0
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= AGREEMENT, f"top-1 agreement {agree / total:.3f}"


def test_greedy_tokens_alone_in_a_batch_and_with_speculation(mixed):
    _path, stored, _read, _floats = mixed
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    target = [1, *range(20, 60)]
    others = [[1, *range(3, 200)], [1, 7, 8], [1, *range(100, 140)]]
    options = dict(quantization="w8a8", kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=48)
    alone = LLM(loaded=stored, **options).generate([target], greedy)[0].outputs[0].token_ids
    batch = LLM(loaded=stored, **options).generate([others[0], target, *others[1:]], greedy)
    assert batch[1].outputs[0].token_ids == alone
    spec = LLM(loaded=stored, speculative_mode="ngram", spec_draft_length=4, **options)
    repetitive = [1, *([30, 31, 32, 33] * 6)]
    plain = LLM(loaded=stored, **options).generate([repetitive, target], greedy)
    drafted = spec.generate([repetitive, target], greedy)
    assert [r.outputs[0].token_ids for r in drafted] == [r.outputs[0].token_ids for r in plain]
    assert spec.engine.spec.stats.num_accepted_tokens > 0      # verification rows ran and were kept


@pytest.mark.parametrize("kind", ["Q5_K", "IQ4_XS", "IQ4_NL", "Q4_0", "Q4_1"])
def test_an_untied_block_embedding_is_held_as_stored(tmp_path, kind):
    """An untied K-quant table is held in its own format, a Q4_0 / Q4_1 one as 4-bit blocks (not
    float32 rows: 7x the bytes), and its lookups are the file's values."""
    path = tmp_path / "untied.gguf"
    write_mixed_gguf(path, untied=kind)
    stored = load_model(path, dtype="float32", quantization="auto")
    floats = load_model(path, dtype="float32", quantization="none")
    model = stored.model
    assert isinstance(model.quant_lm_head, quant.BlockQLinear) and model.quant_lm_head.bits == 8
    assert isinstance(model.quant_embedding, quant.TiedBlockEmbedding)
    held = model.quant_embedding.head
    assert held is not model.quant_lm_head and model.quant_embedding.nbytes == held.nbytes > 0
    if kind in kquant.KQUANT_TYPES:
        assert isinstance(held, kquant.KQuantLinear) and held.fmt == kind
    else:
        assert isinstance(held, quant.BlockQLinear) and held.bits == 4
        assert held.nbytes <= len(TOKENS) * H * (0.5 + 4 / 32)      # the file's 4 bits and two float16 a block
    assert model.embed_tokens.weight is None
    ids = torch.tensor([3, 0, 255, 3])
    assert torch.equal(model.embed(ids), floats.model.embed_tokens.weight[ids])
    assert torch.equal(model.quant_lm_head.dequantize(), floats.model.lm_head.dense_weight())


def test_w4a8_keeps_the_4_bit_types_as_stored_and_rounds_the_wider_ones_to_4_bits(mixed):
    path, _stored, _read, floats = mixed
    model = load_model(path, dtype="float32", quantization="w4a8").model
    qkv0 = model.layers[0].self_attn.qkv_proj.quantized          # Q4_K q, k as stored; Q6_K v rounded
    assert [getattr(p, "fmt", None) or p.bits for p in qkv0.parts_] == ["Q4_K", 4]
    assert torch.equal(qkv0.parts_[0].dequantize(), floats.model.layers[0].self_attn.qkv_proj.dense_weight()[:H + KV_HEADS * D])
    assert isinstance(model.quant_lm_head, kquant.KQuantLinear)   # the head keeps its Q6_K
    # IQ4_XS / IQ4_NL hold 4-bit values too: kept as stored, the file's values
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        held = model.layers[1].get_submodule(name)
        assert held.quantized.fmt in ("IQ4_XS", "IQ4_NL")
        assert torch.equal(held.dense_weight(), floats.model.layers[1].get_submodule(name).dense_weight())
    ids = [1, *range(40, 80)]
    change = (_prefill_logits(model, ids) - _prefill_logits(floats.model, ids)).abs()
    assert change.mean() < 1.0, f"mean logit change {change.mean():.3f}"      # 4-bit re-rounding costs more
