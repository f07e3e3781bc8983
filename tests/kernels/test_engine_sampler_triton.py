"""The engine sampler's triton backend (penalties kernel + sampling kernel) against its torch backend,
under the Triton interpreter on CPU (tiny vocabularies), or on CUDA when present.

Proves: backend selection ("auto" is torch on CPU and triton on CUDA; triton forced on CPU needs
TRITON_INTERPRET=1, else a ValueError saying so; unknown names rejected); greedy and top_k=1 rows
give exactly the torch backend's tokens, with repetition/presence/frequency penalties, logit bias
and min_tokens applied, and the same logprobs, while the caller's logits stay untouched; random
rows (seeded and unseeded) follow the torch backend's distribution ``processed_probs``
(chi-square); a seeded request draws the same tokens alone and inside shuffled mixed batches.

The chi-square tests use fixed seeds, so they are deterministic; with fresh random seeds a
correct sampler would fail each of them with probability P_MIN = 1e-3.
"""
from __future__ import annotations

import random

import pytest
import torch

from sluice.engine.request import Request
from sluice.engine.sampler import GeneratorCache, Sampler, SamplingBatch, processed_probs, resolve_sampler_backend
from sluice.engine.sampling_params import SamplingParams
from tests.kernels.stats import chi_square_pvalue

P_MIN = 1e-3


def _req(rid: str, prompt=(1, 2), output=(), seed=None, eos=(), **params) -> Request:
    req = Request(rid, list(prompt), SamplingParams(**params), eos_token_ids=frozenset(eos), seed=seed)
    req.output_token_ids = list(output)
    return req


def _batch(reqs, vocab, device, engine_seed=0) -> SamplingBatch:
    return SamplingBatch.from_requests(reqs, vocab, device, GeneratorCache(seed=engine_seed, device=device))


def test_backend_selection(monkeypatch):
    assert Sampler().backend == "torch"
    assert Sampler("auto", "cpu").backend == "torch"
    assert resolve_sampler_backend("auto", "cuda") == "triton"
    assert Sampler("torch", "cuda").backend == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert Sampler("triton", "cpu").backend == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"^sampler_backend=triton needs a CUDA device or TRITON_INTERPRET=1, "
                                         r"got device cpu"):
        Sampler("triton", "cpu")
    with pytest.raises(ValueError, match=r"^sampler_backend: must be one of \('auto', 'torch', 'triton'\)"):
        Sampler("flashinfer", "cpu")


def test_triton_sampler_refuses_cpu_logits_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sampler = Sampler("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="^logits: the triton sampler needs them on a CUDA device"):
        sampler(torch.zeros(1, 5), _batch([_req("a", temperature=0.0)], 5, "cpu"))


def test_greedy_rows_equal_the_torch_backend(device):
    vocab = 37
    logits = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(device)
    top = logits.argmax(-1).tolist()
    reqs = [
        _req("plain", temperature=0.0, logprobs=3),
        _req("pen", prompt=[top[1], 2], output=[top[1], 4, 4, 9], temperature=0.0, repetition_penalty=1.7,
             presence_penalty=0.4, frequency_penalty=0.6, logprobs=2),
        _req("bias", temperature=0.0, logit_bias={top[2]: -50.0, 3: 7.5}),
        _req("k1_min_tokens", output=[5], eos=[top[3]], min_tokens=3, top_k=1, temperature=1.3),
        _req("random", temperature=0.8, top_p=0.9, logprobs=1),
        _req("k1_bias", top_k=1, temperature=0.5, logit_bias={0: 100.0}, presence_penalty=-0.5, output=[0]),
    ]
    before = logits.clone()
    ref = Sampler("torch")(logits, _batch(reqs, vocab, device))
    got = Sampler("triton", device)(logits, _batch(reqs, vocab, device))
    assert torch.equal(logits, before), "the caller's logits were changed"
    greedy = [0, 1, 2, 3, 5]
    assert torch.equal(got.token_ids[greedy], ref.token_ids[greedy])
    # Penalties, bias and min_tokens really moved these rows off the raw argmax.
    assert all(got.token_ids[i].item() != top[i] for i in (1, 2, 3)) and got.token_ids[5].item() == 0
    torch.testing.assert_close(got.logprobs[greedy], ref.logprobs[greedy])
    assert torch.equal(got.top_ids, ref.top_ids)
    torch.testing.assert_close(got.top_logprobs, ref.top_logprobs)


@pytest.mark.parametrize("params", [
    # top-p renormalised over the top-k survivors, after penalties and bias
    dict(temperature=1.5, top_k=6, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5, logit_bias={2: 1.0}),
    dict(temperature=1.4, min_p=0.08, frequency_penalty=0.3),
])
def test_random_rows_follow_the_torch_distribution(device, params):
    vocab, rows = 10, 300
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(4)) * 1.5
    logits = base.repeat(rows, 1).to(device)                          # [rows, vocab]
    # Even rows carry their own seed, odd rows draw keys from the shared generator.
    reqs = [_req(f"r{i}", prompt=[3, 7], output=[1, 1, 4], seed=i if i % 2 == 0 else None, **params)
            for i in range(rows)]
    tokens = Sampler("triton", device)(logits, _batch(reqs, vocab, device, engine_seed=5)).token_ids
    probs = processed_probs(logits[:1], _batch(reqs[:1], vocab, device))[0].cpu()   # torch reference
    counts = torch.bincount(tokens, minlength=vocab).cpu()
    assert counts[probs == 0].sum() == 0, "a token the torch sampler excludes was drawn"
    assert (probs > 0).sum() >= 3 and (probs == 0).any(), "the case must leave a real, filtered choice"
    assert chi_square_pvalue(counts, probs) > P_MIN


def _run(requests: list[Request], tables: dict[str, torch.Tensor], device, engine_seed: int,
         shuffle: random.Random | None, steps: int) -> None:
    sampler = Sampler("triton", device)
    cache = GeneratorCache(seed=engine_seed, device=device)
    for step in range(steps):
        order = list(requests)
        if shuffle is not None:
            shuffle.shuffle(order)
        logits = torch.stack([tables[r.request_id][step] for r in order]).to(device)
        out = sampler(logits, SamplingBatch.from_requests(order, logits.shape[1], device, cache))
        for r, tok in zip(order, out.token_ids.tolist()):
            r.append_output_token(tok)


def test_seeded_request_repeats_alone_and_in_mixed_batches(device):
    vocab, steps = 16, 6
    g = torch.Generator().manual_seed(8)
    tables = {rid: torch.randn(steps, vocab, generator=g) * 1.5 for rid in ("s", "u", "g", "s2")}
    params = dict(temperature=1.0, top_p=0.95, presence_penalty=0.3, max_tokens=steps)
    alone = _req("s", seed=7, **params)
    _run([alone], tables, device, engine_seed=0, shuffle=None, steps=steps)
    mixed = _req("s", seed=7, **params)
    others = [_req("u", temperature=1.0), _req("g", temperature=0.0), _req("s2", seed=8, temperature=1.2, top_k=5)]
    _run([mixed] + others, tables, device, engine_seed=99, shuffle=random.Random(3), steps=steps)
    assert mixed.output_token_ids == alone.output_token_ids
    other_seed = _req("s", seed=8, **params)
    _run([other_seed], tables, device, engine_seed=0, shuffle=None, steps=steps)
    assert other_seed.output_token_ids != alone.output_token_ids


def test_grammar_bitmask_stage_equals_the_torch_backend(device):
    """The triton sampler masks with kernels/bitmask.py: with penalties and bias on the same rows,
    greedy picks equal the torch backend's, each within its row's allowed tokens."""
    vocab = 70
    logits = (torch.randn(3, vocab, generator=torch.Generator().manual_seed(4)) * 3).to(device)
    top = logits.argmax(-1).tolist()
    mask = torch.zeros(3, 3, dtype=torch.int32)
    mask[0] = -1                                              # unconstrained
    mask[1, 1] = 0b1011                                       # tokens 32, 33, 35
    mask[2, 2] = 1 << 3                                       # token 67 only
    reqs = [_req("a", temperature=0.0), _req("b", temperature=0.0, logit_bias={33: 5.0}),
            _req("c", temperature=0.0, repetition_penalty=1.5, output=[67])]
    def batch():
        return SamplingBatch.from_requests(reqs, vocab, device, GeneratorCache(seed=0, device=device),
                                           grammar_bitmask=mask.to(device))
    ref = Sampler("torch")(logits, batch())
    got = Sampler("triton", device)(logits, batch())
    assert torch.equal(got.token_ids, ref.token_ids)
    assert got.token_ids[0].item() == top[0] and got.token_ids[1].item() in (32, 33, 35)
    assert got.token_ids[2].item() == 67
