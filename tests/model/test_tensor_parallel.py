"""Tensor parallelism on this CPU: SmolLM2 split over 2 ranks (gloo), against the same model whole.

Proves: the shards hold exactly the whole model's weights (float32 slices, and a block format's
blocks, in both splits: o_proj/down_proj by output rows for the exact split, by input columns
cut between whole blocks for the row-parallel one); 16 mixed requests run together (prompts of
several lengths, chunked prefill beside decodes, a grammar-constrained one, n-gram speculation)
give greedy outputs token-identical to one shard, with logprobs equal to the last bit in a block
format (w4a8: the exact split computes every number as one rank does) and within float32
tolerance in float32 (oneDNN may block a narrower product otherwise); the row-parallel split
(the Python layers, SLUICE_CPU_CPP_LAYERS=0) stays token-identical in float32; a model that
cannot be split is refused by name; a rank that dies ends the engine with a message naming it,
never a hang.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sluice.engine.llm import LLM
from sluice.engine.loaders.gguf_loader import load_gguf
from sluice.engine.loaders.quantized import Quantizer
from sluice.engine.parallel.tensor import ShardedWeights, plan_shard
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured import GrammarSpec
from tests.model_files import smollm2_gguf

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

PROMPTS = [("Tell me about the sea. " * (1 + i % 4)) + f"Question {i}:" for i in range(16)]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


def _params(i: int) -> SamplingParams:
    if i == 3:
        return SamplingParams(max_tokens=20, temperature=0.0, logprobs=2,
                              structured=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    return SamplingParams(max_tokens=8 + i % 5, temperature=0.0, ignore_eos=True, logprobs=2)


def _run(quantization: str, shards: int, **options) -> list:
    llm = LLM("smollm2", quantization=quantization, tensor_parallel_shards=shards, kv_cache_memory_bytes=64 << 20,
              max_num_batched_tokens=64, **options)
    try:
        return [r.outputs[0] for r in llm.generate(PROMPTS, [_params(i) for i in range(16)])]
    finally:
        llm.close()


@pytest.mark.parametrize("exact", [True, False])
def test_shards_hold_exactly_the_whole_models_weights(exact):
    arch, weights, _ = load_gguf(smollm2_gguf())
    shards = [plan_shard(arch, r, 2, exact) for r in range(2)]
    assert [(s.kv_heads, s.q_heads, s.inter) for s in shards] == [(2, 6, 768), (1, 3, 768)]
    assert [(s.out_start, s.out_rows) for s in shards] == ([(0, 288), (288, 288)] if exact else [(0, 0), (0, 0)])
    out_dim = 0 if exact else 1
    for name, shape, dim in [("model.layers.3.self_attn.q_proj.weight", (576, 576), 0),
                             ("model.layers.3.self_attn.o_proj.weight", (576, 576), out_dim),
                             ("model.layers.3.mlp.down_proj.weight", (576, 1536), out_dim)]:
        whole = weights[name]
        cut = torch.cat([ShardedWeights(weights, arch, s)[name] for s in shards], dim)
        assert torch.equal(cut, whole), name
        blocks = Quantizer("w4a8")
        whole_q = blocks.linear(weights, [(name, shape)]).dequantize()
        parts = [blocks.linear(sw, [(name, sw.shape(name))]).dequantize()
                 for sw in (ShardedWeights(weights, arch, s) for s in shards)]
        assert torch.equal(torch.cat(parts, dim), whole_q), name
    with pytest.raises(ValueError, match="tensor_parallel_shards: 4 ranks need at least 4 key/value heads"):
        plan_shard(arch, 0, 4)


def _same_tokens(whole, split, tolerance: float) -> None:
    for a, b in zip(whole, split):
        assert a.token_ids == b.token_ids and a.text == b.text
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) <= tolerance and x.top[0][0] == y.top[0][0]
    json.loads(whole[3].text)                                  # the grammar held on both


@pytest.mark.parametrize("split", ["exact", "row-parallel"])
def test_float32_outputs_are_token_identical_to_one_shard(split, monkeypatch):
    if split == "row-parallel":    # the Python layers (workers inherit the environment)
        monkeypatch.setenv("SLUICE_CPU_CPP_LAYERS", "0")
    options = {"speculative_mode": "ngram", "spec_draft_length": 3} if split == "exact" else {}
    _same_tokens(_run("none", 1, **options), _run("none", 2, **options), 1e-3)


def test_a_block_format_is_identical_to_one_shard_to_the_last_bit():
    options = {"speculative_mode": "ngram", "spec_draft_length": 3}
    _same_tokens(_run("w4a8", 1), _run("w4a8", 2), 0.0)
    _same_tokens(_run("w4a8", 1, **options), _run("w4a8", 2, **options), 0.0)


def test_eagle_draft_trees_run_over_the_exact_split():
    """The C++ stack attends through a draft tree on every rank (the tree rows travel with the
    step's metadata, accepted nodes' K/V moves by broadcast): the same tokens as one shard."""
    sys.path.insert(0, str(REPO))
    from bench.greedy_golden import random_heads

    arch = load_gguf(smollm2_gguf())[0]
    options = dict(speculative_mode="eagle", additional_models="random eagle heads", spec_tree_width=3,
                   spec_draft_length=4)
    whole = _run("w4a8", 1, heads=random_heads(arch, "eagle"), **options)
    split = _run("w4a8", 2, heads=random_heads(arch, "eagle"), **options)
    _same_tokens(whole, split, 0.0)


def test_a_dead_rank_ends_the_engine_with_a_clear_error(tiny_smollm2, tmp_path):
    from tests.integration.conftest import free_port

    log = tmp_path / "engine.log"
    port = free_port()
    cmd = [sys.executable, "-m", "sluice.engine.cli", "engine", str(tiny_smollm2), "--device", "cpu",
           "--port", str(port), "--embedding-model", "none", "--overrides", "tensor_parallel_shards=2"]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=fh,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        worker = None
        while time.monotonic() < deadline and worker is None:
            assert proc.poll() is None, log.read_text()[-3000:]
            if "engine ready" in log.read_text(errors="replace"):
                kids = [k for t in Path(f"/proc/{proc.pid}/task").iterdir() for k in (t / "children").read_text().split()]
                worker = next((int(k) for k in kids if b"parallel.worker" in Path(f"/proc/{k}/cmdline").read_bytes()),
                              None)
            time.sleep(0.3)
        assert worker is not None, log.read_text()[-3000:]
        os.kill(worker, signal.SIGKILL)
        assert proc.wait(30) == 3
        assert "tensor-parallel rank 1" in log.read_text() and "exited with code -9" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
