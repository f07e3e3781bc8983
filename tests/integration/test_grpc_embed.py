"""Embed and Rerank through a real engine process.

The session engine (``tests/integration/conftest.py``) starts with the default embedding model,
the packaged all-MiniLM-L6-v2. Proves: Embed equals sentence-transformers' vectors within 1e-5
(CJK and a text past the 256-token limit included), with per-input token counts and truncation
flags; ``dimensions`` keeps the first N values (renormalised), ``normalize=false`` gives the raw
mean-pooled vector, token-id input and an explicit prefix behave as documented; Rerank (cosine
path) ranks the right document first with scores equal to sentence-transformers' cosine, cuts at
``top_n``, returns documents, and scores pairs in input order; GetModelInfo reports the
capabilities and the rerank method; and every bad input is INVALID_ARGUMENT naming its field.
A second engine, started with ``--embedding-model none --rerank-model <folder>`` (a tiny
BertForSequenceClassification with RANDOM weights: it checks the cross-encoder path, not ranking
quality; its chat model is the tiny random-weight SmolLM2 of tests/model_files.py, which it never
asks), answers Embed UNIMPLEMENTED and Rerank with transformers' scores.
"""
from __future__ import annotations

import asyncio
import shutil

import grpc
import pytest
import torch
import torch.nn.functional as F

from sluice.engine.client import AsyncEngineClient, EngineClient, EngineRpcError
from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc import engine_pb2_grpc as pb_grpc
from tests.integration.conftest import launch_engine, wait_serving
from tests.model_files import minilm_folder

# sentence_transformers and transformers (~5 s to import here) are imported where they are used:
# every xdist worker collects this module, and only one runs it.

pytestmark = pytest.mark.slow
LONG = "The quick brown fox jumps over the lazy dog near the riverbank. " * 40        # > 256 tokens
TEXTS = ["A man is eating food.", LONG, "台北101曾經是世界最高的建築物。", "I love pizza 🍕!", "x"]
QUERY = "What is the capital of Japan?"
DOCS = ["Paris is the capital of France.", "Pizza is a popular Italian dish.",
        "Tokyo is the capital city of Japan.", "Berlin has many museums."]


@pytest.fixture(scope="module")
def oracle():
    import sentence_transformers

    return sentence_transformers.SentenceTransformer(str(minilm_folder()), device="cpu")


def _close(ours, ref, atol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.tensor(ours), torch.as_tensor(ref, dtype=torch.float32), atol=atol, rtol=0)


def _error(fn) -> EngineRpcError:
    with pytest.raises(EngineRpcError) as info:
        fn()
    return info.value


def test_embed_equals_sentence_transformers(client: EngineClient, oracle) -> None:
    res = client.embed(TEXTS)
    _close(res.vectors, oracle.encode(TEXTS, convert_to_numpy=True))
    counts = [min(len(ids), 256) for ids in oracle.tokenizer(TEXTS, truncation=False)["input_ids"]]
    assert res.token_counts == counts and res.truncated == [False, True, False, False, False]
    assert res.prompt_tokens == sum(counts) and res.model == "all-MiniLM-L6-v2"


def test_dimensions_normalize_token_ids_and_prefix(client: EngineClient, oracle) -> None:
    import sentence_transformers

    full = torch.tensor(oracle.encode(TEXTS[:3], convert_to_numpy=True))                      # [3, 384]
    cut = client.embed(TEXTS[:3], dimensions=64)
    assert all(len(v) == 64 for v in cut.vectors)
    _close(cut.vectors, F.normalize(full[:, :64], dim=-1))
    pooled = sentence_transformers.SentenceTransformer(modules=[oracle[0], oracle[1]], device="cpu")
    raw = torch.tensor(pooled.encode(TEXTS[:3], convert_to_numpy=True))                      # unnormalised
    _close(client.embed(TEXTS[:3], normalize=False, dimensions=100).vectors, raw[:, :100])
    ids = oracle.tokenizer(TEXTS[0])["input_ids"]
    _close(client.embed([ids]).vectors, full[:1])
    _close(client.embed(TEXTS[0], prefix="query: ").vectors, oracle.encode(["query: " + TEXTS[0]]))
    # MiniLM names no prompts: input_type adds the (empty) prefix GetModelInfo reports.
    _close(client.embed(TEXTS[0], input_type="query").vectors, full[:1])


async def test_async_embeds_run_beside_generation(engine_server) -> None:
    async with AsyncEngineClient(engine_server.target, timeout=120) as client:
        stream = client.generate("Count to twenty:", max_tokens=24, temperature=0.0, ignore_eos=True)
        sequential = [(await client.embed(t)).vectors[0] for t in TEXTS]
        results, choices = await asyncio.gather(asyncio.gather(*(client.embed(t) for t in TEXTS)), stream.collect())
    assert choices[0].usage.completion_tokens == 24
    _close([r.vectors[0] for r in results], sequential)


def test_rerank_cosine(client: EngineClient, oracle) -> None:
    res = client.rerank(QUERY, DOCS, top_n=2, return_documents=True)
    assert res.method == "embedding-cosine" and res.model == "all-MiniLM-L6-v2"
    q, d = torch.tensor(oracle.encode([QUERY])), torch.tensor(oracle.encode(DOCS))
    cosine = (q @ d.T)[0]                                                                       # [4]
    _close(res.scores, cosine)
    assert [h.index for h in res.results] == cosine.argsort(descending=True)[:2].tolist()
    assert res.results[0].index == 2 and res.results[0].document == DOCS[2]
    pairs = client.rerank(pairs=[(QUERY, doc) for doc in DOCS])
    assert [h.index for h in pairs.results] == [0, 1, 2, 3] and pairs.results[0].document is None
    _close([h.score for h in pairs.results], cosine)
    assert pairs.prompt_tokens > 0


def test_model_info_reports_embedding_side(client: EngineClient) -> None:
    info = client.model_info()
    assert {"generate", "embeddings", "rerank"} <= info.capabilities and "infilling" not in info.capabilities
    assert (info.embedding_model, info.embedding_dimension, info.embedding_max_length) == ("all-MiniLM-L6-v2", 384, 256)
    assert info.rerank_method == "embedding-cosine" and info.embedding_normalize
    assert client.list_models()[0].capabilities == info.capabilities


@pytest.mark.parametrize("request_, field", [
    (pb.EmbedRequest(), "texts: at least one"),
    (pb.EmbedRequest(texts=["a", ""]), "texts[1]: must be a non-empty string"),
    (pb.EmbedRequest(texts=["a"], token_ids=[pb.TokenIds(ids=[101])]), "texts: give texts or token_ids"),
    (pb.EmbedRequest(token_ids=[pb.TokenIds(ids=[101, 30522])]), "token_ids[0]: token id 30522 is outside"),
    (pb.EmbedRequest(token_ids=[pb.TokenIds()]), "token_ids[0]: must hold at least one"),
    (pb.EmbedRequest(texts=["a"], dimensions=385), "dimensions: must be 0 (full) or in [1, 384], got 385"),
    (pb.EmbedRequest(texts=["a"], dimensions=-1), "dimensions: must be 0"),
    (pb.EmbedRequest(token_ids=[pb.TokenIds(ids=[101])], prefix="q: "), "prefix: the prefix 'q: ' cannot"),
    (pb.EmbedRequest(texts=["a", LONG], truncate=False), "texts[1]: longer than the embedding model's max length"),
])
def test_embed_errors(client: EngineClient, request_, field: str) -> None:
    with grpc.insecure_channel(client.target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.EngineServiceStub(channel).Embed(request_, timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field), info.value.details()


@pytest.mark.parametrize("kwargs, field", [
    (dict(query="", documents=["d"]), "query: must be a non-empty string"),
    (dict(query="q", documents=[]), "documents: must hold at least one"),
    (dict(query="q", documents=["d", ""]), "documents[1]: must be a non-empty string"),
    (dict(query="q", documents=["d"], top_n=0), "top_n: must be >= 1, got 0"),
    (dict(query="q", pairs=[("q", "d")]), "pairs: cannot be combined"),
    (dict(pairs=[("q", "d")], top_n=1), "top_n: applies to query + documents only"),
    (dict(pairs=[("q", "d"), ("q", "")]), "pairs[1].document: must be a non-empty string"),
])
def test_rerank_errors(client: EngineClient, kwargs: dict, field: str) -> None:
    err = _error(lambda: client.rerank(**kwargs))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.message.startswith(field), err.message


# ------------------------------------------------------- no embedding model, a cross-encoder
@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    import transformers

    folder = tmp_path_factory.mktemp("cross")
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, num_labels=1,
                                  architectures=["BertForSequenceClassification"])
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification(cfg).eval()      # RANDOM weights
    hf.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_folder() / name, folder / name)
    return folder, hf, transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def cross_client(tmp_path_factory, cross_encoder, tiny_smollm2):
    engine = launch_engine(tmp_path_factory.mktemp("cross_engine") / "engine.log", "--overrides",
                           "max_total_seq_length=1024", "--embedding-model", "none",
                           "--rerank-model", str(cross_encoder[0]), model=tiny_smollm2)
    try:
        wait_serving(engine)
        with EngineClient(engine.target, timeout=60) as c:
            yield c
    finally:
        engine.stop()


def test_cross_encoder_without_embedding_model(cross_client: EngineClient, cross_encoder) -> None:
    _folder, hf, tok = cross_encoder
    info = cross_client.model_info()
    assert "rerank" in info.capabilities and "embeddings" not in info.capabilities
    assert info.rerank_method == "cross-encoder" and info.embedding_model == ""
    err = _error(lambda: cross_client.embed(["a"]))
    assert err.code == grpc.StatusCode.UNIMPLEMENTED
    assert "serves no embedding model; start it with --embedding-model" in err.message
    res = cross_client.rerank(QUERY, DOCS)
    enc = tok([QUERY] * len(DOCS), DOCS, padding=True, truncation=True, max_length=64, return_tensors="pt")
    with torch.no_grad():
        ref = torch.sigmoid(hf(**enc).logits[:, 0])                                             # [4]
    assert res.method == "cross-encoder"
    _close(res.scores, ref)
    assert [h.index for h in res.results] == ref.argsort(descending=True).tolist()
