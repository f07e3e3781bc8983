"""Embeddings through the facade from a real engine serving all-MiniLM-L6-v2 (the packaged wheel)
beside SmolLM2: ``/v1/embeddings`` (also through the OpenAI SDK) and ``/models/embeddings`` (V1
and V2) equal sentence-transformers' vectors for the same model folder within 1e-5
(sentence-transformers is the test-only oracle); base64 decodes to the same float32 values;
``dimensions`` keeps the first N values (normalised); ``normalize: false`` gives the raw mean
pooling; the seed's LangChain-style wrapper runs on LangChain's ``Embeddings`` interface (from
langchain-core, the dev extra; the wrapper's code is the seed's)."""
from __future__ import annotations

import base64
import json
from typing import List

import numpy as np
import pytest
import requests
from pydantic import BaseModel

from tests.integration.test_facade_http import KEY, launch_facade
from tests.model_files import minilm_folder

try:
    from langchain.embeddings.base import Embeddings          # the seed's import
except ImportError:
    # The dev extra installs langchain-core (through langchain-openai), whose Embeddings is the
    # same interface under its current module path.
    from langchain_core.embeddings import Embeddings

pytestmark = pytest.mark.slow

TEXTS = ["search string 1", "請問台灣最高的山是？", "The capital of Canada is Ottawa."]
TOL = 1e-5


@pytest.fixture(scope="module")
def api_url(engine_server, tmp_path_factory) -> str:
    f = launch_facade(engine_server.target, tmp_path_factory.mktemp("emb") / "facade.log")
    yield f.url
    assert f.stop() == 0


@pytest.fixture(scope="module")
def oracle():
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_folder()), device="cpu")
    return lambda texts: model.encode(texts, convert_to_numpy=True)    # the model's pipeline: mean pool, normalise


def _post(url: str, path: str, body: dict) -> dict:
    r = requests.post(url + path, json=body, headers={"X-API-KEY": KEY})
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_embeddings_equal_sentence_transformers(api_url, oracle):
    want = oracle(TEXTS)
    body = _post(api_url, "/v1/embeddings", {"model": "smollm2", "input": TEXTS})
    got = np.array([d["embedding"] for d in body["data"]])
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    assert body["usage"]["prompt_tokens"] > len(TEXTS) and body["model"]
    b64 = _post(api_url, "/v1/embeddings", {"model": "smollm2", "input": TEXTS, "encoding_format": "base64"})
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in b64["data"]])
    np.testing.assert_array_equal(decoded, got.astype(np.float32))
    cut = _post(api_url, "/v1/embeddings", {"model": "smollm2", "input": TEXTS, "dimensions": 8})
    short = np.array([d["embedding"] for d in cut["data"]])
    first8 = want[:, :8]      # a prefix of the normalised vector, normalised again = the raw prefix normalised
    np.testing.assert_allclose(short, first8 / np.linalg.norm(first8, axis=1, keepdims=True), atol=TOL, rtol=0)


def test_openai_sdk_embeddings(api_url, oracle):
    from openai import OpenAI

    sdk = OpenAI(base_url=api_url + "/v1", api_key=KEY)
    resp = sdk.embeddings.create(model="smollm2", input=TEXTS[:2])   # the SDK asks for base64 and decodes
    np.testing.assert_allclose(np.array([d.embedding for d in resp.data]), oracle(TEXTS[:2]), atol=TOL, rtol=0)


def test_afs_embeddings_v1_v2(api_url, oracle):
    v1 = _post(api_url, "/models/embeddings", {"model": "smollm2", "inputs": TEXTS})
    assert set(v1) == {"data", "total_time_taken", "usage"} and [d["index"] for d in v1["data"]] == [0, 1, 2]
    np.testing.assert_allclose(np.array([d["embedding"] for d in v1["data"]]), oracle(TEXTS), atol=TOL, rtol=0)
    raw = _post(api_url, "/models/embeddings", {"model": "smollm2", "input": TEXTS, "parameters": {"normalize": False}})
    raw = np.array([d["embedding"] for d in raw["data"]])
    norms = np.linalg.norm(raw, axis=1, keepdims=True)
    assert np.all(np.abs(norms - 1) > 1e-2)        # the mean pooling before the pipeline's Normalize
    np.testing.assert_allclose(raw / norms, oracle(TEXTS), atol=TOL, rtol=0)
    v2 = _post(api_url, "/models/embeddings", {"model": "smollm2", "input": TEXTS[:2], "encoding_format": "base64",
                                               "dimensions": 4})
    first = np.frombuffer(base64.b64decode(v2["data"][0]["embedding"]), dtype="<f4")
    assert first.shape == (4,) and abs(np.linalg.norm(first) - 1) < 1e-5


class CustomEmbeddingModel(BaseModel, Embeddings):
    """The seed's wrapper (V1 form), as written."""
    base_url: str = "http://localhost:12345"
    api_key: str = ""
    model: str = ""

    def get_embeddings(self, payload):
        endpoint_url = f"{self.base_url}/models/embeddings"
        embeddings = []
        headers = {
            "Content-type": "application/json",
            "accept": "application/json",
            "X-API-KEY": self.api_key,
            "X-API-HOST": "afs-inference"
        }
        response = requests.post(endpoint_url, headers=headers, data=payload)
        body = response.json()
        datas = body["data"]
        for data in datas:
            embeddings.append(data["embedding"])
        return embeddings

    def embed_documents(self, texts: List[str]) -> List[List[float]]:
        payload = json.dumps({"model": self.model, "inputs": texts})
        return self.get_embeddings(payload)

    def embed_query(self, text: str) -> List[List[float]]:
        payload = json.dumps({"model": self.model, "inputs": [text]})
        emb = self.get_embeddings(payload)
        return emb[0]


def test_langchain_wrapper(api_url, oracle):
    embeddings = CustomEmbeddingModel(base_url=api_url, api_key=KEY, model="smollm2")
    query = embeddings.embed_query("請問台灣最高的山是？")
    np.testing.assert_allclose(query, oracle(["請問台灣最高的山是？"])[0], atol=TOL, rtol=0)
    docs = embeddings.embed_documents(["test1", "test2", "test3"])
    np.testing.assert_allclose(np.array(docs), oracle(["test1", "test2", "test3"]), atol=TOL, rtol=0)
