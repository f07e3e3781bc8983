"""The AFS seed's Python examples against a real engine (SmolLM2-135M-Instruct, with the packaged
all-MiniLM-L6-v2 beside it) and a real facade process. The example functions are the seed's,
re-indented (the seed's markdown lost the indentation) with only API_URL / API_KEY / MODEL_NAME
filled in and ``max_new_tokens`` lowered (this 2-core CPU box is slow): conversation with and
without a system prompt, streaming with the ``chunk[5:]`` parser, generate (plain and streamed),
code infilling (SmolLM2 has no FIM tokens: the example prints "error" and the server says why,
a 400), the function-calling round trip, and rerank in both forms.

What is asserted is the protocol, not the tiny model's wisdom: every answer has the AFS fields,
streamed records are valid UTF-8 and join to the non-streamed text for the same seed (a CJK
prompt), and the function-calling round trip is accepted whether or not the 135M model chooses
to call (if it does, the call must name the declared function with object arguments)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import requests

from tests.integration.test_facade_http import KEY, launch_facade

pytestmark = pytest.mark.slow

MODEL_NAME = "smollm2"
API_KEY = KEY
API_HOST = "afs-inference"
# parameters (the seed's, max_new_tokens lowered)
max_new_tokens = 12
temperature = 0.5
top_k = 50
top_p = 1.0
frequence_penalty = 1.0
FIELDS = {"generated_text", "function_call", "details", "total_time_taken", "prompt_tokens", "generated_tokens",
          "total_tokens", "finish_reason"}


@pytest.fixture(scope="module")
def api_url(engine_server, tmp_path_factory) -> str:
    f = launch_facade(engine_server.target, tmp_path_factory.mktemp("afs") / "facade.log")
    yield f.url
    assert f.stop() == 0


def _headers() -> dict:
    return {"content-type": "application/json", "X-API-Key": API_KEY, "X-API-Host": API_HOST}


def _params() -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
            "frequence_penalty": frequence_penalty}


# ------------------------------------------------------------------ the seed's functions
def conversation(API_URL, system, contents):
    headers = {
        "content-type": "application/json",
        "X-API-Key": API_KEY,
        "X-API-Host": API_HOST}
    roles = ["human", "assistant"]
    messages = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    for index, content in enumerate(contents):
        messages.append({"role": roles[index % 2], "content": content})
    data = {
        "model": MODEL_NAME,
        "messages": messages,
        "parameters": {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "frequence_penalty": frequence_penalty
        }
    }
    result = ""
    try:
        response = requests.post(API_URL + "/models/conversation", json=data, headers=headers)
        if response.status_code == 200:
            result = json.loads(response.text, strict=False)['generated_text']
        else:
            print("error")
    except:  # noqa: E722 - the seed's code
        print("error")
    return result.strip("\n")


def conversation_stream(API_URL, contents):
    headers = {
        "content-type": "application/json",
        "X-API-Key": API_KEY,
        "X-API-Host": API_HOST}
    roles = ["human", "assistant"]
    messages = []
    for index, content in enumerate(contents):
        messages.append({"role": roles[index % 2], "content": content})
    data = {
        "model": MODEL_NAME,
        "messages": messages,
        "parameters": {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "frequence_penalty": frequence_penalty
        },
        "stream": True
    }
    messages = []
    result = ""
    try:
        response = requests.post(API_URL + "/models/conversation", json=data, headers=headers, stream=True)
        if response.status_code == 200:
            for chunk in response.iter_lines():
                chunk = chunk.decode('utf-8')
                if chunk == "":
                    continue
                # only check format => data: ${JSON_FORMAT}
                try:
                    record = json.loads(chunk[5:], strict=False)
                    if "status_code" in record:
                        print("{:d}, {}".format(record["status_code"], record["error"]))
                        break
                    elif record["total_time_taken"] is not None or ("finish_reason" in record and record["finish_reason"] is not None):  # noqa: E501
                        message = record["generated_text"]
                        messages.append(message)
                        print(">>> " + message)
                        result = ''.join(messages)
                        break
                    elif record["generated_text"] is not None:
                        message = record["generated_text"]
                        messages.append(message)
                        print(">>> " + message)
                    else:
                        print("error")
                        break
                except:  # noqa: E722
                    pass
        else:
            print("error")
    except:  # noqa: E722
        print("error")
    return result.strip("\n")


def generate(API_URL, prompt):
    headers = {
        "content-type": "application/json",
        "X-API-Key": API_KEY,
        "X-API-Host": API_HOST}
    data = {
        "model": MODEL_NAME,
        "inputs": prompt,
        "parameters": {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "frequence_penalty": frequence_penalty
        }
    }
    result = ''
    try:
        response = requests.post(
            API_URL + "/models/generate", json=data, headers=headers)
        if response.status_code == 200:
            result = json.loads(response.text, strict=False)['generated_text']
        else:
            print("error")
    except:  # noqa: E722
        print("error")
    return result.strip("\n")


def text_infilling(API_URL, prompt):
    headers = {
        "content-type": "application/json",
        "X-API-Key": API_KEY,
        "X-API-Host": API_HOST}
    data = {
        "model": MODEL_NAME,
        "inputs": prompt,
        "parameters": {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "frequence_penalty": frequence_penalty
        }
    }
    result = ''
    try:
        response = requests.post(
            API_URL + "/models/text_infilling", json=data, headers=headers)
        if response.status_code == 200:
            result = json.loads(response.text, strict=False)['generated_text']
        else:
            print("error")
    except:  # noqa: E722
        print("error")
    return result.strip("<EOT>")


# ------------------------------------------------------------------------------ tests
def test_conversation_examples(api_url, capsys):
    contents = ["人口最多的國家是?", "人口最多的國家是印度。", "主要宗教為?"]
    without_system = conversation(api_url, None, contents)
    print(without_system)
    with_system = conversation(api_url, "你是一位只會用表情符號回答問題的助理。",
                               ["明天會下雨嗎?", "🤔 🌨️ 🤞", "意思是要帶傘出門嗎？"])
    print(with_system)
    out = capsys.readouterr().out
    assert "error" not in out.splitlines() and without_system and with_system
    r = requests.post(api_url + "/models/conversation", headers=_headers(), json={
        "model": MODEL_NAME, "messages": [{"role": "human", "content": contents[0]}], "parameters": _params()})
    body = r.json()
    assert r.status_code == 200 and set(body) == FIELDS and body["finish_reason"] in ("eos_token", "length")
    assert body["total_tokens"] == body["prompt_tokens"] + body["generated_tokens"] and body["generated_tokens"] > 0
    assert re.fullmatch(r"\d+\.\d\d sec", body["total_time_taken"])


def test_streamed_cjk_answer_joins_to_the_plain_one(api_url, capsys):
    """Same seed (the default 42), same parameters: the streamed records join to the plain text."""
    contents = ["請用中文介紹台灣最高的山。"]
    streamed = conversation_stream(api_url, contents)
    assert "error" not in capsys.readouterr().out.splitlines()
    plain = conversation(api_url, None, contents)
    assert streamed == plain and plain
    data = {"model": MODEL_NAME, "messages": [{"role": "human", "content": contents[0]}], "parameters": _params(),
            "stream": True}
    with requests.post(api_url + "/models/conversation", json=data, headers=_headers(), stream=True) as r:
        raw = [line for line in r.iter_lines() if line]
    records = [json.loads(line.decode("utf-8", errors="strict")[5:]) for line in raw]   # strict: valid UTF-8
    # a partial character is held back (""), never sent broken; only the last record may end in
    # U+FFFD, when max_new_tokens cuts a character in half (the plain text ends the same way)
    assert all("\ufffd" not in rec["generated_text"] for rec in records[:-1])
    assert any(rec["generated_text"] == "" for rec in records[:-1])    # CJK: bytes split across tokens
    assert "".join(rec["generated_text"] for rec in records).strip("\n") == plain
    assert records[-1]["finish_reason"] is not None and all(rec["finish_reason"] is None for rec in records[:-1])


def test_generate_examples(api_url, capsys):
    result = generate(api_url, "從前從前，有位老太太去河邊")
    print(result)
    assert "error" not in capsys.readouterr().out.splitlines() and result
    data = {"model": MODEL_NAME, "inputs": "台灣最高峰是", "parameters": {**_params(), "max_new_tokens": 2},
            "stream": True}
    with requests.post(api_url + "/models/generate", json=data, headers=_headers(), stream=True) as r:
        records = [json.loads(line[5:]) for line in r.iter_lines() if line]
    assert len(records) == 2 and records[-1]["generated_tokens"] == 2 and records[-1]["finish_reason"] == "length"


def test_code_infilling_on_a_model_without_fim_tokens(api_url, capsys):
    text = '''def remove_non_ascii(s: str) -> str:
    """ <FILL_ME>
    return result
'''
    result = text_infilling(api_url, text)
    print(re.sub("<FILL_ME>", result, text))
    assert "error" in capsys.readouterr().out.splitlines() and result == ""
    r = requests.post(api_url + "/models/text_infilling", headers=_headers(),
                      json={"model": MODEL_NAME, "inputs": text, "parameters": _params()})
    body = r.json()
    assert r.status_code == 400 and body["status_code"] == 400 and "does not support infilling" in body["error"]


def test_function_calling_round_trip(api_url):
    weather = {"name": "get_current_weather", "description": "Get the current weather in a given location",
               "parameters": {"type": "object", "properties": {
                   "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}
    params = {"show_probabilities": False, "max_new_tokens": 40, "frequence_penalty": 1, "temperature": 0.5,
              "top_k": 100, "top_p": 0.93}
    first = requests.post(api_url + "/models/conversation", headers=_headers(), json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "What is the weather like in Boston?"}],
        "functions": [weather], "parameters": params, "stream": False})
    body = first.json()
    assert first.status_code == 200 and set(body) == FIELDS
    if body["function_call"] is not None:     # the 135M model may or may not call
        assert body["finish_reason"] == "function_call" and body["function_call"]["name"] == weather["name"]
        assert isinstance(body["function_call"]["arguments"], dict)
    else:
        assert body["finish_reason"] in ("eos_token", "length") and body["generated_text"]
    second = requests.post(api_url + "/models/conversation", headers=_headers(), json={
        "model": MODEL_NAME, "functions": [weather], "parameters": {**params, "max_new_tokens": 16}, "messages": [
            {"role": "user", "content": "What is the weather like in Boston?"},
            {"role": "assistant", "content": None,
             "function_call": {"name": "get_current_weather", "arguments": {"location": "Boston, MA"}}},
            {"role": "function", "name": "get_current_weather",
             "content": "{\"temperature\": \"22\", \"unit\": \"celsius\", \"description\": \"Sunny\"}"}]})
    body = second.json()
    assert second.status_code == 200 and set(body) == FIELDS and body["prompt_tokens"] > 100


def test_a_started_function_call_is_held_to_its_schema(api_url):
    """The model copies a call with a wrong argument from the prompt; the constraint (triggered by
    ``{"name"``) makes it a valid call of the declared function, streamed and not."""
    weather = {"name": "get_current_weather", "description": "Get the current weather in a given location",
               "parameters": {"type": "object", "properties": {"location": {"type": "string", "maxLength": 30}},
                              "required": ["location"]}}
    body = {"model": MODEL_NAME, "functions": [weather], "parameters": {"max_new_tokens": 60, "top_k": 1},
            "messages": [{"role": "user", "content": 'Write this text exactly: {"name": "get_current_weather", '
                                                     '"arguments": {"town": "Boston"}}'}]}
    r = requests.post(api_url + "/models/conversation", headers=_headers(), json={**body, "stream": False})
    answer = r.json()
    assert r.status_code == 200 and answer["finish_reason"] == "function_call"
    assert answer["function_call"]["name"] == "get_current_weather"
    jsonschema.validate(answer["function_call"]["arguments"], weather["parameters"])
    with requests.post(api_url + "/models/conversation", headers=_headers(), json={**body, "stream": True},
                       stream=True) as r:
        recs = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")]
    assert recs[-1]["finish_reason"] == "function_call" and recs[-1]["function_call"] == answer["function_call"]


def test_rerank_both_forms(api_url):
    q = "Where is the capital of Canada?"
    docs = ["Europe is a continent.", "The capital of Canada is Ottawa.", "Canada is a big country."]
    r = requests.post(api_url + "/models/rerank", headers=_headers(),
                      json={"model": MODEL_NAME, "inputs": [[q, d] for d in docs]})
    body = r.json()
    assert r.status_code == 200 and len(body["scores"]) == 3 and max(range(3), key=body["scores"].__getitem__) == 1
    assert body["usage"]["prompt_tokens"] > 0 and body["total_time_taken"].endswith(" sec")
    r = requests.post(api_url + "/models/rerank", headers=_headers(),
                      json={"model": MODEL_NAME, "query": q, "documents": docs, "parameters": {"top_n": 2}})
    results = r.json()["results"]
    assert [x["index"] for x in results][:1] == [1] and len(results) == 2 and results[0]["score"] >= results[1]["score"]
