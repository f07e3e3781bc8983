"""Greedy output with speculative decoding is token-for-token the output without it, on the
default model (SmolLM2-135M-Instruct) in its default weight format (w4a8): single requests, and 16
mixed concurrent requests (different lengths, stop strings, n > 1, preemptions in a small KV
pool). ``small_draft`` runs with a random-weight 2-layer draft of the same vocabulary (almost
none accepted, output still identical) and, for single requests, with the target as its own
draft (every greedy draft must be accepted)."""
from __future__ import annotations

import pytest

from sluice.engine.llm import LLM
from sluice.engine.loaders import load_model
from sluice.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

TEXT = ("The river rose for three days. On the fourth morning the bridge was under water, the school "
        "was closed, and the baker on Mill Street handed out bread to anyone who came to his door.")
CODE = "def area(w, h):\n    result = w * h\n    return result\n\nprint(area(3, 4))\n"
GROUNDED = [
    f"Repeat this text exactly, but write 'creek' instead of 'river':\n\n{TEXT}",
    f"Rewrite this Python code with the variable 'result' renamed to 'total':\n\n{CODE}",
    f"Summarise in one sentence:\n\n{TEXT}",
]
OPEN = ["Write a short poem about the sea.", "What is the capital of France?", "Tell me a joke.",
        "List three fruits.", "Why is the sky blue?"]


def _chat(llm: LLM, prompts: list[str], params: list[SamplingParams]):
    texts = [llm.engine.render_chat([{"role": "user", "content": p}]) for p in prompts]
    return llm._run(texts, params, add_special_tokens=False)


def _mixed() -> tuple[list[str], list[SamplingParams]]:
    prompts, params = [], []
    for i in range(16):
        prompts.append((GROUNDED + OPEN)[i % 8])
        kw = dict(temperature=0.0, max_tokens=(24, 40, 32, 12)[i % 4])
        if i % 5 == 1:
            kw["stop"] = ["."]
        if i % 7 == 3:
            kw["n"] = 2
        params.append(SamplingParams(**kw))
    return prompts, params


@pytest.fixture(scope="module")
def tiny_draft(tiny_smollm2):
    return load_model(str(tiny_smollm2), dtype="float32", device="cpu")


def _engines(smollm2_default, tiny_draft, self_draft: bool = True, **opts):
    yield "ngram", LLM(loaded=smollm2_default, speculative_mode="ngram", spec_draft_length=5, **opts)
    if self_draft:
        yield "self_draft", LLM(loaded=smollm2_default, draft_loaded=smollm2_default, speculative_mode="small_draft",
                                additional_models="smollm2", spec_draft_length=3, **opts)
    yield "tiny_draft", LLM(loaded=smollm2_default, draft_loaded=tiny_draft, speculative_mode="small_draft",
                            additional_models="tiny-smollm2", spec_draft_length=3, **opts)


def test_single_requests_identical(smollm2_default, tiny_draft):
    base = LLM(loaded=smollm2_default)
    prompts = GROUNDED[:1] + OPEN[:1]
    params = [SamplingParams(temperature=0.0, max_tokens=48)] * len(prompts)
    want = [[o.token_ids for o in r.outputs] for r in _chat(base, prompts, params)]
    for name, llm in _engines(smollm2_default, tiny_draft):
        got = []
        for p, sp in zip(prompts, params):   # one at a time: batch 1
            got += [[o.token_ids for o in r.outputs] for r in _chat(llm, [p], [sp])]
        assert got == want, name
        stats = llm.engine.spec.stats
        if name == "self_draft":
            assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
        elif name == "tiny_draft":
            assert stats.num_accepted_tokens <= 0.1 * stats.num_draft_tokens
        else:
            assert stats.mean_accepted_length > 1.5   # the grounded prompts copy their input


def test_sixteen_mixed_concurrent_requests_identical_with_preemption(smollm2_default, tiny_draft):
    # 40 blocks of 16 tokens for 16 requests of ~50-130 tokens each (8 distinct prompts, whose
    # full blocks the prefix cache shares): preemptions happen. Without the target as its own
    # draft (the costliest engine here, 13 s): ngram's runs on the grounded prompts are accepted
    # through these preemptions, and tests/unit/test_spec_decode.py's pool test runs a draft that
    # is always accepted through preemptions on the tiny model.
    opts = dict(max_total_tokens=640, max_num_seqs=16, spec_max_batch_size=16)
    prompts, params = _mixed()
    base = LLM(loaded=smollm2_default, max_total_tokens=640, max_num_seqs=16)
    want = [[o.token_ids for o in r.outputs] for r in _chat(base, prompts, params)]
    assert base.engine.scheduler.num_preemptions > 0
    for name, llm in _engines(smollm2_default, tiny_draft, self_draft=False, **opts):
        results = _chat(llm, prompts, params)
        assert [[o.token_ids for o in r.outputs] for r in results] == want, name
        assert llm.engine.scheduler.num_preemptions > 0, name
        assert any(r.outputs[0].finish_reason == "stop" and r.outputs[0].stop_reason == "." for r in results)
        assert sum(r.usage.draft_tokens for r in results) > 0, name
        llm.engine.kv.check_invariants()
        assert llm.engine.kv.stats().in_use == 0
