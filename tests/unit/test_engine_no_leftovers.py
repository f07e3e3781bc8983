"""Requests that are over leave nothing behind, on the tiny random-weight model through the real
``AsyncEngine`` + ``EngineCore`` (the soak's mix, in process): streams read to their end, streams
left early (abort), ``n=2``, seeded sampling (a per-request generator), penalties, stop strings,
requests refused by validation, with and without n-gram speculative decoding (per-request draft
state). Once every stream is closed and the engine is
idle, every per-request structure is empty: the async side's streams and live ids, the core's
groups / choices / news, the scheduler's requests and finished ids, the KV manager's per-request
blocks and hashes, the runner's generators and draft distributions, the grammar matchers.
(Grammars are left out of the mix: on the tiny word-level vocabulary a grammar row sampled
beside another random row can draw a masked token, a structured-output bug of its own.)

Also: a packed CPU projection runs at one of a few row counts (``row_bucket``), so oneDNN's
per-shape primitive caches stay small whatever batch sizes the steps have (the soak's growth).
"""
from __future__ import annotations

import asyncio
import contextlib
import random

import pytest
import torch
import torch.nn.functional as F

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.llm import LLM
from sluice.engine.loaders import load_model
from sluice.engine.models.cpu_linear import cpu_packing_available, row_bucket
from sluice.engine.models.llama import _Linear
from sluice.engine.sampling_params import SamplingParams
from tests.tiny_model import prompt, write_tiny_folder

pytestmark = pytest.mark.timeout(120)
OPTS = dict(device="cpu", block_size=4, max_total_tokens=512, max_num_seqs=4, max_waiting=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_model(str(write_tiny_folder(tmp_path_factory.mktemp("tiny"))))


def _params(rng: random.Random, i: int) -> SamplingParams:
    p = dict(max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.5,
             temperature=rng.choice([0.0, 0.8]))
    if i % 3 == 0:
        p |= dict(seed=i)
    if i % 4 == 0:
        p |= dict(n=2, temperature=0.8)
    if i % 5 == 0:
        p |= dict(presence_penalty=0.5, repetition_penalty=1.2)
    if i % 6 == 0:
        p |= dict(stop=["w7"])
    return SamplingParams(**p)


async def _one(engine: AsyncEngine, rng: random.Random, i: int) -> None:
    params = _params(rng, i)
    text = prompt(rng.randint(1, 40))
    if i % 13 == 0:   # refused by validation: nothing may be left of it either
        params = SamplingParams(max_tokens=2000)
    keep = rng.randint(1, 3) if i % 2 else None   # odd: leave the stream after a few outputs
    with contextlib.suppress(ValueError):
        async with contextlib.aclosing(engine.generate(f"r{i}", text, params)) as stream:
            seen = 0
            async for _ in stream:
                seen += 1
                if keep is not None and seen >= keep:
                    break


def _leftovers(engine: AsyncEngine) -> dict[str, int]:
    core = engine._core
    kv, runner = core.kv, core.runner
    sizes = {
        "async._streams": len(engine._streams), "async._live": len(engine._live),
        "outputs.groups": len(core.outputs.groups), "outputs.choice_of": len(core.outputs.choice_of),
        "outputs.dirty": len(core.outputs.dirty),
        # Not scheduler._finished_ids: the ids finished since the last step, a hand-off that the
        # next schedule() drains; a request aborted after the last step stays in it until then.
        "scheduler._requests": len(core.scheduler._requests),
        "scheduler.running": len(core.scheduler.running), "scheduler.waiting": len(core.scheduler.waiting),
        "kv._req_blocks": len(kv._req_blocks), "kv._req_hashes": len(kv._req_hashes),
        "kv._req_num_registered": len(kv._req_num_registered),
        "runner.generators": len(runner.generators), "runner.spec.draft_probs": len(runner.spec.draft_probs),
        "structured matchers": len(core.structured.request_ids()),
    }
    return {k: v for k, v in sizes.items() if v}


@pytest.mark.parametrize("mode", [None, "ngram"])
def test_finished_aborted_and_refused_requests_leave_no_per_request_state(tiny, mode):
    spec = {} if mode is None else dict(speculative_mode=mode, spec_max_batch_size=8)
    llm = LLM(loaded=tiny, **OPTS, **spec)

    async def main() -> dict[str, int]:
        engine = AsyncEngine(lambda: llm.engine)
        engine.start()
        await asyncio.wait_for(engine.wait_ready(), 30)
        try:
            rng = random.Random(0)
            for wave in range(6):   # 6 waves of 8 concurrent requests
                await asyncio.gather(*(_one(engine, rng, wave * 8 + j) for j in range(8)))
            await engine.call(lambda core: None)   # the aborts queued by the last closed streams
            for _ in range(200):
                if not await engine.call(lambda core: core.has_unfinished_requests()):
                    break
                await asyncio.sleep(0.01)
            return await engine.call(lambda core: _leftovers(engine))
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == {}
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_total_blocks
    kv.check_invariants()


def test_row_buckets_are_few_cover_every_row_count_and_pad_at_most_a_quarter_above_4_rows():
    # Decode batches run exact from 4 rows; 1-3 rows at 4, which oneDNN streams faster.
    assert [row_bucket(m) for m in range(1, 17)] == [4, 4, 4] + list(range(4, 17))
    buckets = {row_bucket(m) for m in range(1, 8193)}
    assert len(buckets) == 49
    for m in range(1, 8193):
        assert m <= row_bucket(m) <= max(4, m + m // 4) and row_bucket(row_bucket(m)) == row_bucket(m)


@pytest.mark.skipif(not cpu_packing_available(), reason="this torch build has no oneDNN packing")
@pytest.mark.parametrize("shape", [(17,), (3, 21), (100,)])
def test_padded_packed_projection_equals_dense(shape):
    torch.manual_seed(0)
    lin = _Linear(64, 48, bias=True)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        lin.bias.normal_()
    weight = lin.weight.detach().clone()
    x = torch.randn(*shape, 64)
    want = F.linear(x, weight, lin.bias)
    lin.pack_for_cpu()
    with torch.inference_mode():
        got = lin(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
