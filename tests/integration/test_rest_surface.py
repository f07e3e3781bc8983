"""The REST surface that users' tools call, against a real ``sluice serve``: a tiny random-weight
Llama whose tokenizer has CodeLlama's FIM tokens and a chat template (it checks the plumbing, not
the quality of the words), with the packaged MiniLM as its encoder.

* the official ``openai`` SDK on ``/v1/responses``: ``client.responses.create`` whole and streamed
  (the documented event types, in order), with a function tool (``tool_choice`` "required": the
  grammar makes the call), ``previous_response_id`` with the tool's output, retrieve and delete;
  ``background`` (retrieved when done; cancelled mid-generation, the engine request gone),
  ``include`` logprobs (the chat path's, token for token) and ``reasoning`` refused by name;
* a FIM request (``prompt`` + ``suffix``) through ``client.completions.create``;
* ``/tokenize`` and ``/detokenize`` as vLLM's and llama.cpp's clients send them, checked against
  the engine's own gRPC Tokenize; token strings (``return_token_strs``, ``with_pieces``) against
  transformers;
* ``/v1/rerank`` (Jina / Cohere) and ``/v1/score`` (vLLM), checked against the engine's Rerank;
* ``sluice serve --served-model-name fim-coder fim --request-log json``: both aliases listed and
  answered, the folder's own name refused, metrics labelled by alias, ``X-Request-Id`` returned
  and in the request's JSON log line.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import requests
from openai import OpenAI

from sluice.engine.client import EngineClient
from tests.model_files import minilm_folder
from tests.reliability.serve import Serve
from tests.unit.test_infill import codellama_tokenizer_folder

pytestmark = pytest.mark.slow
KEY = "sk-rest"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}


def write_fim_model(folder: Path) -> Path:
    """A 2-layer Llama with RANDOM weights on CodeLlama's FIM tokenizer, plus a chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sluice.engine.tokenizer import Tokenizer

    codellama_tokenizer_folder(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    vocab = Tokenizer.from_folder(folder).vocab_size
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    root = tmp_path_factory.mktemp("rest_surface")
    s = Serve(write_fim_model(root / "fim"), root / "serve.log", api_key=KEY,
              overrides="max_total_seq_length=4096;max_num_sequence=4",
              extra=("--embedding-model", str(minilm_folder()), "--served-model-name", "fim-coder", "fim",
                     "--request-log", "json")).wait_ready(timeout=240)
    yield s
    s.stop()


@pytest.fixture
def sdk(serve) -> OpenAI:
    return OpenAI(base_url=serve.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_responses_create_whole_and_streamed(serve, sdk):
    resp = sdk.responses.create(model=serve.model, input="Say hi.", instructions="Be brief.", max_output_tokens=6,
                                temperature=0)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == serve.model
    assert resp.status in ("completed", "incomplete") and resp.output[0].type == "message"
    assert resp.output_text == resp.output[0].content[0].text
    assert 0 < resp.usage.output_tokens <= 6 and resp.usage.input_tokens > 0
    events = list(sdk.responses.create(model=serve.model, input="Say hi.", instructions="Be brief.",
                                       max_output_tokens=6, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == resp.output_text    # greedy: the same answer both ways
    assert events[-1].response.output_text == streamed


def test_responses_with_a_tool_and_previous_response_id(serve, sdk):
    first = sdk.responses.create(model=serve.model, input="What is the weather in Paris?", tools=[WEATHER],
                                 tool_choice="required", max_output_tokens=400, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert set(json.loads(calls[0].arguments)) == {"city"}          # the grammar held it to the schema
    streamed = list(sdk.responses.create(model=serve.model, input="What is the weather in Paris?", tools=[WEATHER],
                                         tool_choice="required", max_output_tokens=400, temperature=0, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments) == json.loads(calls[0].arguments)
    second = sdk.responses.create(model=serve.model, previous_response_id=first.id, tools=[WEATHER],
                                  tool_choice="none", max_output_tokens=4, temperature=0,
                                  input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": "sunny"}])
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    # the first turn came along: the prompt was the question, the call and its output
    call = {"id": calls[0].call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": calls[0].arguments}}
    whole = serve.post("/tokenize", json={"messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny"}]}).json()
    assert second.usage.input_tokens == whole["count"]
    assert sdk.responses.retrieve(second.id).output_text == second.output_text
    sdk.responses.delete(first.id)
    with pytest.raises(Exception) as err:
        sdk.responses.retrieve(first.id)
    assert getattr(err.value, "status_code", None) == 404


def _settled(sdk: OpenAI, resp_id: str):
    for _ in range(600):
        got = sdk.responses.retrieve(resp_id)
        if got.status not in ("queued", "in_progress"):
            return got
        time.sleep(0.1)
    raise AssertionError(f"{resp_id} is still {got.status}")


def test_responses_background_retrieve_and_cancel(serve, sdk):
    queued = sdk.responses.create(model=serve.model, input="Say hi.", max_output_tokens=6, temperature=0,
                                  background=True)
    assert queued.background and queued.status in ("queued", "in_progress", "completed", "incomplete")
    done = _settled(sdk, queued.id)
    whole = sdk.responses.create(model=serve.model, input="Say hi.", max_output_tokens=6, temperature=0)
    assert (done.status, done.output_text) == (whole.status, whole.output_text)    # greedy: the same answer
    long = sdk.responses.create(model=serve.model, input="Count to a thousand.", max_output_tokens=3000,
                                temperature=0, background=True)
    with EngineClient(serve.engine_target, timeout=60) as engine:
        for _ in range(300):
            if engine.load().num_running == 1:
                break
            time.sleep(0.05)
        assert sdk.responses.retrieve(long.id).status == "in_progress"
        cancelled = sdk.responses.cancel(long.id)
        assert cancelled.status == "cancelled" and cancelled.id == long.id
        for _ in range(100):
            load = engine.load()
            if load.num_in_flight == 0 and load.num_running == 0:
                break
            time.sleep(0.05)
        assert load.num_in_flight == 0 and load.num_running == 0          # aborted: its KV is free
    assert sdk.responses.retrieve(long.id).status == "cancelled"


def test_responses_include_logprobs_and_reasoning(serve, sdk):
    import openai

    resp = sdk.responses.create(model=serve.model, input="Say hi.", max_output_tokens=4, temperature=0,
                                include=["message.output_text.logprobs"], top_logprobs=2,
                                reasoning={"effort": None})
    chat = sdk.chat.completions.create(model=serve.model, messages=[{"role": "user", "content": "Say hi."}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    got = [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in resp.output[0].content[0].logprobs]
    want = [(lp.token, lp.logprob, [t.token for t in lp.top_logprobs]) for lp in chat.choices[0].logprobs.content]
    assert got == want and len(got) == resp.usage.output_tokens             # the engine's, as chat has them
    for kwargs, param in (({"reasoning": {"effort": "high"}}, "reasoning.effort"),
                          ({"include": ["reasoning.encrypted_content"]}, "include")):
        with pytest.raises(openai.BadRequestError) as err:
            sdk.responses.create(model=serve.model, input="hi", max_output_tokens=2, **kwargs)
        assert err.value.body["param"] == param


def test_fim_completion_with_suffix(serve, sdk):
    resp = sdk.completions.create(model=serve.model, prompt="def add(a, b):\n    ", suffix="\n    return result\n",
                                  max_tokens=5, temperature=0)
    assert resp.choices[0].finish_reason in ("stop", "length") and 0 < resp.usage.completion_tokens <= 5
    with EngineClient(serve.engine_target, timeout=60) as engine:
        (choice,) = engine.generate("def add(a, b):\n    ", suffix="\n    return result\n", max_tokens=5,
                                    temperature=0).collect()
    assert resp.choices[0].text == choice.text       # the facade's infill is the engine's


def test_tokenize_and_detokenize_shapes(serve):
    with EngineClient(serve.engine_target, timeout=60) as engine:
        ids = engine.tokenize("def add(a, b):").token_ids
        bare = engine.tokenize("def add(a, b):", add_special_tokens=False).token_ids
        chat = engine.tokenize(messages=[{"role": "user", "content": "hi"}])
    vllm = serve.post("/tokenize", json={"model": serve.model, "prompt": "def add(a, b):"}).json()
    assert vllm == {"tokens": ids, "count": len(ids), "max_model_len": vllm["max_model_len"]} and ids[0] == 1
    llama_cpp = serve.post("/tokenize", json={"content": "def add(a, b):"}).json()
    assert llama_cpp["tokens"] == bare
    msgs = serve.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert msgs["tokens"] == chat.token_ids and msgs["prompt"] == "user: hi\nassistant: "
    back = serve.post("/detokenize", json={"tokens": bare}).json()
    assert back == {"prompt": "def add(a, b):", "content": "def add(a, b):"}
    bad = serve.post("/detokenize", json={"tokens": [10 ** 6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_tokenize_token_strings_match_transformers(serve):
    """vLLM's ``token_strs`` are Hugging Face's ``convert_ids_to_tokens``; llama.cpp's pieces are
    each token's bytes: a character the vocabulary lacks goes through byte-fallback tokens, whose
    single bytes are not UTF-8 on their own and come back as byte lists."""
    from transformers import AutoTokenizer

    text = "def 🦙():"
    hf = AutoTokenizer.from_pretrained(str(serve.log.parent / "fim"))
    vllm = serve.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert vllm["tokens"] == hf(text)["input_ids"]
    assert vllm["token_strs"] == hf.convert_ids_to_tokens(vllm["tokens"])
    llama_cpp = serve.post("/tokenize", json={"content": text, "with_pieces": True}).json()
    pieces = [t["piece"] for t in llama_cpp["tokens"]]
    assert [t["id"] for t in llama_cpp["tokens"]] == vllm["tokens"][1:]          # llama.cpp: no BOS
    assert any(isinstance(p, list) for p in pieces) and any(isinstance(p, str) for p in pieces)
    spelled = b"".join(bytes(p) if isinstance(p, list) else p.encode() for p in pieces)
    assert spelled.decode() == " " + text        # SentencePiece's leading space, then the text exactly


def test_rerank_and_score_shapes(serve):
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "France's capital city is Paris."]
    with EngineClient(serve.engine_target, timeout=60) as engine:
        ref = engine.rerank("capital of France", documents=docs)
    body = serve.post("/v1/rerank", json={"model": serve.model, "query": "capital of France", "documents": docs,
                                          "top_n": 2}).json()
    assert [r["index"] for r in body["results"]] == [h.index for h in ref.results[:2]]
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([h.score for h in ref.results[:2]])
    assert body["results"][0]["document"] == {"text": docs[body["results"][0]["index"]]}
    assert body["usage"]["total_tokens"] > 0
    cohere = serve.post("/rerank", json={"model": serve.model, "query": "capital of France",
                                         "documents": [{"text": d} for d in docs], "return_documents": False}).json()
    assert [r["index"] for r in cohere["results"]] == [h.index for h in ref.results]
    assert "document" not in cohere["results"][0]
    score = serve.post("/v1/score", json={"model": serve.model, "text_1": "capital of France", "text_2": docs}).json()
    by_index = {h.index: h.score for h in ref.results}
    assert [d["score"] for d in score["data"]] == pytest.approx([by_index[i] for i in range(3)])
    assert requests.post(serve.url + "/v1/score", json={}, timeout=10).status_code == 401


def test_served_names_request_ids_and_the_json_log(serve):
    assert serve.model == "fim-coder"
    assert [m["id"] for m in serve.get("/v1/models").json()["data"]] == ["fim-coder", "fim"]
    resp = serve.post("/v1/completions", json={"model": "fim", "prompt": "def", "max_tokens": 2},
                      headers={"X-Request-Id": "rest-surface-1"})
    assert resp.status_code == 200 and resp.json()["model"] == "fim"
    assert resp.headers["X-Request-Id"] == "rest-surface-1"
    own = serve.post("/v1/completions", json={"model": "fim_model", "prompt": "def", "max_tokens": 2})
    assert own.status_code == 404 and "fim-coder, fim" in own.json()["error"]["message"]
    assert 'sluice_generation_tokens_total{model="fim"} 2.0' in serve.get("/metrics").text
    long = {"model": "fim", "prompt": "def", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with serve.post("/v1/completions", json=long, headers={"X-Request-Id": "twice"}, stream=True) as first:
        assert first.status_code == 200
        again = serve.post("/v1/completions", json={**long, "stream": False}, headers={"X-Request-Id": "twice"})
        assert again.status_code == 400 and again.json()["error"]["param"] == "X-Request-Id"
        assert "already in flight" in again.json()["error"]["message"]
    lines = [json.loads(line) for line in serve.log.read_text().splitlines() if line.startswith('{"ts"')]
    (mine,) = [line for line in lines if line["request_id"] == "rest-surface-1"]
    assert mine["model"] == "fim" and mine["status"] == 200 and mine["completion_tokens"] == 2
    assert mine["route"] == "/v1/completions" and mine["duration_s"] >= mine["ttft_s"] > 0
