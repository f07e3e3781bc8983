"""The BERT embedding/rerank path against its oracles.

Proves that all-MiniLM-L6-v2 as loaded by ``engine.loaders.bert_loader`` and run by
``EmbeddingEngine`` gives sentence-transformers' vectors (cosine > 0.9999, max |diff| < 1e-5)
on a corpus with CJK, emoji, accents and text past the 256-token limit, batched in several
length-sorted batches and returned in the caller's order; that token counts and truncation flags
match sentence-transformers' tokenizer; that ``normalize``, ``dimensions``, ``prefix`` and
token-id inputs behave as documented; that cosine reranking orders documents as
sentence-transformers' cosine does (and puts the right document first); and that a
cross-encoder's scores equal transformers' ``BertForSequenceClassification`` output. The
cross-encoder has RANDOM weights: it checks the code path (tokenization of pairs, pooler,
classifier, sigmoid / softmax), not ranking quality.
"""
from __future__ import annotations

import shutil
import time

import pytest
import torch
import torch.nn.functional as F

from sluice.engine.embedding import CROSS_ENCODER, EMBEDDING_COSINE, EmbeddingEngine
from sluice.engine.loaders.bert_loader import load_embedding_model
from tests.model_files import minilm_folder

# sentence_transformers and transformers (~5 s to import here) are imported where they are used:
# every xdist worker collects this module, and only one runs it.

pytestmark = pytest.mark.slow

COS_MIN, ABS_TOL = 0.9999, 1e-5
LONG = "The quick brown fox jumps over the lazy dog near the riverbank. " * 60   # > 256 tokens
CORPUS = [
    "A man is eating food.",
    "東京は日本の首都で、世界最大の都市圏の一つです。",
    "台北101曾經是世界最高的建築物。",
    "I love pizza 🍕🔥 and tacos 🌮!",
    LONG,
    "Café naïve résumé — façade.",
    "A man is riding a horse.",
    "x",
    "   padded with spaces   ",
    "안녕하세요, 만나서 반갑습니다.",
]


@pytest.fixture(scope="module")
def model():
    minilm_folder()   # a missing wheel fails here, naming the fix
    torch.manual_seed(0)
    return load_embedding_model("all-minilm-l6-v2", dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def oracle(model):
    import sentence_transformers

    return sentence_transformers.SentenceTransformer(str(model.path), device="cpu")


@pytest.fixture(scope="module")
def engine(model):
    # A small budget forces several batches, so order restoration is exercised.
    return EmbeddingEngine(model, max_batch_tokens=300)


def _assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.shape == ref.shape
    assert F.cosine_similarity(got, ref, dim=-1).min().item() > COS_MIN
    assert (got - ref).abs().max().item() < ABS_TOL


def test_vectors_match_sentence_transformers(engine, oracle):
    result = engine.embed(CORPUS)
    ref = oracle.encode(CORPUS, batch_size=3, convert_to_tensor=True)                 # [N, 384]
    _assert_close(torch.tensor(result.vectors), ref.float())
    norms = torch.tensor(result.vectors).norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones(len(CORPUS)))


def test_token_counts_and_truncation_match_oracle(engine, oracle):
    result = engine.embed(CORPUS)
    features = oracle.tokenize(CORPUS)
    assert result.token_counts == features["attention_mask"].sum(dim=1).tolist()
    assert result.truncated == [t is LONG for t in CORPUS]
    assert result.token_counts[CORPUS.index(LONG)] == oracle.max_seq_length == 256
    assert result.total_tokens == sum(result.token_counts)


def test_batched_order_equals_one_at_a_time(engine):
    together = torch.tensor(engine.embed(CORPUS).vectors)
    alone = torch.tensor([engine.embed([t]).vectors[0] for t in CORPUS])
    _assert_close(together, alone)


def test_unnormalized_equals_pooling_without_normalize(engine, oracle):
    import sentence_transformers

    raw = sentence_transformers.SentenceTransformer(modules=[oracle[0], oracle[1]], device="cpu")
    ref = raw.encode(CORPUS[:4], convert_to_tensor=True)
    got = torch.tensor(engine.embed(CORPUS[:4], normalize=False).vectors)
    _assert_close(got, ref)
    assert (got.norm(dim=-1) - 1).abs().min() > 1e-3          # really not normalised


def test_dimensions_truncate_then_renormalize(engine, oracle):
    full = oracle.encode(CORPUS[:4], convert_to_tensor=True)
    got = torch.tensor(engine.embed(CORPUS[:4], dimensions=64).vectors)
    assert got.shape == (4, 64)
    _assert_close(got, F.normalize(full[:, :64], dim=-1))
    raw = torch.tensor(engine.embed(CORPUS[:4], normalize=False).vectors)
    cut = torch.tensor(engine.embed(CORPUS[:4], normalize=False, dimensions=64).vectors)
    torch.testing.assert_close(cut, raw[:, :64])


def test_token_ids_and_prefix(engine, model):
    ids = [model.tokenizer.encode(t).ids for t in CORPUS[:3]]
    by_ids = engine.embed(ids)
    _assert_close(torch.tensor(by_ids.vectors), torch.tensor(engine.embed(CORPUS[:3]).vectors))
    assert by_ids.token_counts == [len(x) for x in ids]
    prefixed = engine.embed(["how do plants grow"], prefix="query: ")
    _assert_close(torch.tensor(prefixed.vectors), torch.tensor(engine.embed(["query: how do plants grow"]).vectors))


def test_cosine_rerank_orders_as_sentence_transformers(engine, oracle):
    import sentence_transformers

    query = "Which city is the capital of France?"
    docs = ["Berlin is the capital of Germany.", "Paris is the capital and largest city of France.",
            "Bananas are rich in potassium.", "France is a country in Western Europe.",
            "The Eiffel Tower stands in Paris."]
    ranked = engine.rerank(query, docs, return_documents=True)
    q = oracle.encode([query], convert_to_tensor=True)
    d = oracle.encode(docs, convert_to_tensor=True)
    ref = sentence_transformers.util.cos_sim(q, d)[0]                                     # [5]
    assert [i for i, _ in ranked.results] == ref.argsort(descending=True).tolist()
    assert ranked.results[0][0] == 1
    torch.testing.assert_close(torch.tensor([s for _, s in ranked.results]), ref.sort(descending=True).values,
                               atol=ABS_TOL, rtol=0)
    assert ranked.documents == [docs[i] for i, _ in ranked.results]
    assert ranked.method == engine.rerank_method == EMBEDDING_COSINE
    assert [i for i, _ in engine.rerank(query, docs, top_n=2).results] == [i for i, _ in ranked.results[:2]]


@pytest.fixture(scope="module", params=[1, 2], ids=["one-label", "two-label"])
def cross_encoder_folder(request, tmp_path_factory, model):
    import transformers

    folder = tmp_path_factory.mktemp(f"cross{request.param}")
    cfg = transformers.BertConfig(vocab_size=model.config.vocab_size, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=48,
                                  num_labels=request.param, architectures=["BertForSequenceClassification"])
    torch.manual_seed(request.param)
    hf = transformers.BertForSequenceClassification(cfg).eval()      # random weights
    hf.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(model.path / name, folder / name)
    return folder, hf


def test_cross_encoder_scores_equal_transformers(cross_encoder_folder, model):
    import transformers

    folder, hf = cross_encoder_folder
    engine = EmbeddingEngine(model, rerank_model=load_embedding_model(folder, device="cpu"), max_batch_tokens=100)
    query = "what is the tallest building in Taipei?"
    docs = ["台北101是台北最高的建築。", "Pizza 🍕 is tasty.", LONG, "Taipei 101 was the world's tallest."]
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    enc = tok([query] * len(docs), docs, padding=True, truncation="longest_first", max_length=48,
              return_tensors="pt")
    with torch.no_grad():
        logits = hf(**enc).logits                                                           # [4, L]
    ref = torch.sigmoid(logits[:, 0]) if logits.shape[1] == 1 else logits.softmax(-1)[:, 1]
    scored = engine.score_pairs([(query, d) for d in docs])
    torch.testing.assert_close(torch.tensor(scored.scores), ref, atol=1e-5, rtol=0)
    assert scored.total_tokens == int(enc["attention_mask"].sum())
    ranked = engine.rerank(query, docs)
    assert [i for i, _ in ranked.results] == ref.argsort(descending=True).tolist()
    assert ranked.method == engine.rerank_method == CROSS_ENCODER


def test_throughput_64_short_sentences(model):
    engine = EmbeddingEngine(model)
    texts = [f"Sentence number {i} says something short about topic {i % 7}." for i in range(64)]
    engine.embed(texts[:8])                                                        # warm-up
    start = time.perf_counter()
    result = engine.embed(texts)
    rate = len(texts) / (time.perf_counter() - start)
    print(f"\nembedding throughput: {rate:.0f} texts/s (64 short sentences, "
          f"{torch.get_num_threads()} threads, {result.total_tokens} tokens)")
    assert len(result.vectors) == 64
    assert rate > 20, f"{rate:.1f} texts/s: far below what a 6-layer 384-wide encoder should reach"
