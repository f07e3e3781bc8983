"""Fill-in-the-middle through a real engine process.

A tiny Llama HF folder built in tmp_path: RANDOM weights (it checks the path, not the quality of
the middle) and a Llama-style tokenizer with CodeLlama's ``▁<PRE> ▁<SUF> ▁<MID> ▁<EOT>``. Proves:
GetModelInfo lists "infilling"; a Generate with an ``infill`` input runs on the prompt the
engine built (``<s> <PRE> prefix <SUF> suffix <MID>``, ids equal to ``build_infill_prompt``,
which tests/unit/test_infill.py checks against transformers) and stops; ``<EOT>`` ends an infill
but not a plain completion; empty prefix + suffix is INVALID_ARGUMENT; a model without FIM tokens
(the session's SmolLM2) answers UNIMPLEMENTED "does not support infilling"; and this engine,
started with ``--embedding-model none``, answers Embed and Rerank UNIMPLEMENTED.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch

from sluice.engine.client import EngineClient, EngineRpcError
from sluice.engine.input_processor import build_infill_prompt
from sluice.engine.tokenizer import Tokenizer
from tests.integration.conftest import REPO, EngineProcess, free_port, wait_serving
from tests.unit.test_infill import CODELLAMA_FIM, codellama_tokenizer_folder

pytestmark = pytest.mark.slow
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n    return result\n"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = codellama_tokenizer_folder(tmp_path_factory.mktemp("tiny_codellama"))
    vocab = Tokenizer.from_folder(folder).vocab_size
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)    # RANDOM weights
    return folder


@pytest.fixture(scope="module")
def fim_client(tmp_path_factory, model_folder: Path):
    log_path = tmp_path_factory.mktemp("fim_engine") / "engine.log"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    cmd = [sys.executable, "-m", "sluice.engine.cli", "engine", str(model_folder), "--device", "cpu", "--port", str(port),
           "--overrides", "max_total_seq_length=1024", "--embedding-model", "none"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    engine = EngineProcess(proc, port, log_path)
    try:
        wait_serving(engine)
        with EngineClient(engine.target, timeout=60) as c:
            yield c
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def tok(model_folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(model_folder)


def test_infill_runs_on_the_fim_prompt_and_stops(fim_client: EngineClient, tok: Tokenizer) -> None:
    assert "infilling" in fim_client.model_info().capabilities
    stream = fim_client.generate(PREFIX, suffix=SUFFIX, max_tokens=6, temperature=0.0)
    (choice,) = stream.collect()
    expected = build_infill_prompt(tok, PREFIX, SUFFIX).token_ids
    assert stream.prompt_token_ids == expected
    pre, suf, mid, _eot = (tok.token_to_id(t) for t in CODELLAMA_FIM)
    assert [t for t in expected if t in (pre, suf, mid)] == [pre, suf, mid] and expected[:2] == [1, pre]
    assert choice.finish_reason in ("length", "stop") and 1 <= choice.usage.completion_tokens <= 6
    assert choice.usage.prompt_tokens == len(expected)


def test_eot_ends_an_infill_but_not_a_plain_completion(fim_client: EngineClient, tok: Tokenizer) -> None:
    eot = tok.token_to_id(CODELLAMA_FIM[3])
    (infill,) = fim_client.generate(PREFIX, suffix=SUFFIX, max_tokens=5, logit_bias={eot: 100.0}).collect()
    assert (infill.finish_reason, infill.stop_reason, infill.token_ids) == ("stop", eot, [eot])
    (plain,) = fim_client.generate(PREFIX, max_tokens=3, logit_bias={eot: 100.0}).collect()
    assert plain.finish_reason == "length" and plain.token_ids == [eot] * 3


def test_infill_errors(fim_client: EngineClient, client: EngineClient) -> None:
    with pytest.raises(EngineRpcError) as info:
        fim_client.generate("", suffix="", max_tokens=2).collect()
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith("infill: prefix and suffix must not both be empty")
    with pytest.raises(EngineRpcError) as info:      # the session engine: SmolLM2 has no FIM tokens
        client.generate("def f(", suffix="):", max_tokens=2).collect()
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert info.value.message.startswith("infill: model smollm2 does not support infilling")


def test_no_embedding_model(fim_client: EngineClient) -> None:
    info = fim_client.model_info()
    assert not {"embeddings", "rerank"} & info.capabilities and info.rerank_method == ""
    for call, text in ((lambda: fim_client.embed(["a"]), "start it with --embedding-model"),
                       (lambda: fim_client.rerank("q", ["d"]), "serves no embedding or rerank model")):
        with pytest.raises(EngineRpcError) as err:
            call()
        assert err.value.code == grpc.StatusCode.UNIMPLEMENTED and text in err.value.message
