"""Speculative decoding as an operator and a client see it, on a real ``sluice serve`` of the tiny
model with ``--speculative-mode ngram``: GetModelInfo reports the mode and K; each request's final
record (gRPC) and OpenAI ``usage`` report its draft and accepted tokens; GetLoad and ``/metrics``
carry the engine's running totals, acceptance per draft position included, and they add up to the
per-request counts."""
from __future__ import annotations

import pytest

from sluice.engine.client import EngineClient, SamplingOptions
from tests.reliability.serve import Serve, wait_idle
from tests.tiny_model import prompt, write_tiny_folder

pytestmark = pytest.mark.timeout(300)
K = 3
# A text that repeats itself: its last tokens occur earlier, so the n-gram proposer drafts at once.
REPEATED = " ".join([prompt(12)] * 4)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec")
    s = Serve(write_tiny_folder(tmp / "tiny"), tmp / "serve.log",
              overrides=f"max_total_seq_length=1024;max_num_sequence=4;spec_draft_length={K}",
              extra=("--speculative-mode", "ngram"))
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def _metric(text: str, name: str) -> dict[str, float]:
    """``name``'s samples in a Prometheus text page, by their label text ('' when unlabelled)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            if key == name or key.startswith(name + "{"):
                out[key[len(name):]] = float(value)
    return out


def test_draft_and_accepted_tokens_reach_every_surface(serve):
    wait_idle(serve)
    with EngineClient(serve.engine_target, timeout=120) as client:
        info = client.model_info()
        assert (info.speculative_mode, info.spec_draft_length) == ("ngram", K)
        [choice] = client.generate(REPEATED, SamplingOptions(max_tokens=24, temperature=0, ignore_eos=True)).collect()
        usage = choice.usage
        assert usage.draft_tokens > 0 and 0 <= usage.accepted_tokens <= usage.draft_tokens
        assert usage.accepted_tokens <= usage.completion_tokens

        r = serve.post("/v1/completions", json={"model": serve.model, "prompt": REPEATED, "max_tokens": 24,
                                                "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        details = r.json()["usage"]["completion_tokens_details"]
        # The same greedy request: the same drafts and verdicts as over gRPC.
        assert details == {"accepted_prediction_tokens": usage.accepted_tokens,
                           "rejected_prediction_tokens": usage.draft_tokens - usage.accepted_tokens}

        wait_idle(serve)
        load = client.load()
    assert load.spec_draft_tokens == 2 * usage.draft_tokens
    assert load.spec_accepted_tokens == 2 * usage.accepted_tokens == sum(load.spec_accepted_per_position)
    assert len(load.spec_accepted_per_position) == K
    assert list(load.spec_accepted_per_position) == sorted(load.spec_accepted_per_position, reverse=True)
    assert 0 < load.spec_num_drafts <= load.spec_draft_tokens

    page = serve.get("/metrics").text
    assert _metric(page, "sluice_spec_decode_draft_tokens") == {"": load.spec_draft_tokens}
    assert _metric(page, "sluice_spec_decode_accepted_tokens") == {"": load.spec_accepted_tokens}
    assert _metric(page, "sluice_spec_decode_drafts") == {"": load.spec_num_drafts}
    per_position = _metric(page, "sluice_spec_decode_accepted_tokens_per_position")
    assert per_position == {f'{{position="{j}"}}': float(n) for j, n in enumerate(load.spec_accepted_per_position)}


def test_usage_has_no_prediction_details_without_drafts(serve):
    # One token out: the first step samples it from the prompt, so nothing was drafted.
    r = serve.post("/v1/completions", json={"model": serve.model, "prompt": prompt(5), "max_tokens": 1,
                                            "temperature": 0})
    assert r.status_code == 200, r.text
    assert "completion_tokens_details" not in r.json()["usage"]
