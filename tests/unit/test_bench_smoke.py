"""The bench scripts run end to end on tiny settings, and the serving metrics are computed as
documented. No benchmark is measured here.

* ``bench/offline.py --quick`` runs every engine section in a subprocess and writes its JSON.
* ``bench/serving.py`` starts a real sluice facade + engine (``sluice serve``) and a real gRPC
  engine, drives both, and the server-reported usage shows exactly the requested input and output
  token counts.
* The metric arithmetic (TPOT, goodput, percentiles) and the conversation set are checked on known
  values, and ``--plot`` without matplotlib exits 2 with the install hint.

The end-to-end runs check the scripts' plumbing, so they run on the tiny random-weight SmolLM2
(tests/model_files.py) with one thread per process: seconds instead of half a minute.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.model_files import TINY_CONFIG

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import serving  # noqa: E402


def _run(args: list[str], timeout: float, tmpdir: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


# ------------------------------------------------------------------------------ pure functions
def test_summarize_tpot_goodput_and_percentiles():
    recs = [serving.Record(ok=True, ttft=0.1, e2e=1.1, chunk_times=[0.1, 0.6, 1.1], prompt_tokens=8, output_tokens=3),
            serving.Record(ok=True, ttft=0.5, e2e=0.9, chunk_times=[0.5, 0.9], prompt_tokens=8, output_tokens=2),
            serving.Record(ok=False, error="HTTP 500: boom")]
    m = serving.summarize(recs, duration=2.0, slo={"ttft_ms": 200.0, "tpot_ms": None, "e2e_ms": None})
    assert (m["completed"], m["failed"], m["errors"]) == (2, 1, ["HTTP 500: boom"])
    # TPOT = (E2E - TTFT) / (output tokens - 1): 1.0/2 = 500 ms and 0.4/1 = 400 ms.
    assert m["tpot_ms"]["mean"] == pytest.approx(450.0)
    assert m["itl_ms"]["p50"] == pytest.approx(500.0)     # gaps 500, 500, 400
    assert m["ttft_ms"]["p50"] == pytest.approx(300.0)
    assert m["output_throughput"] == pytest.approx(2.5)    # 5 tokens / 2 s, from usage
    assert m["goodput_req_s"] == pytest.approx(0.5)       # only the first meets TTFT <= 200 ms
    assert m["goodput_tok_s"] == pytest.approx(1.5)


def test_ratios_pair_each_load_point_with_the_peer():
    def res(name, load, tok_s, ttft):
        return {"target": name, "load": load, "metrics": {"output_throughput": tok_s, "ttft_ms": {"p90": ttft},
                                                          "tpot_ms": {"mean": 10.0}}}
    rows = serving.ratios([res("sluice-http", "c=1", 30, 100), res("llamacpp", "c=1", 60, 50),
                           res("sluice-http", "c=8", 120, 200)], "sluice-http", "llamacpp")
    assert rows == [{"load": "c=1", "ours": "sluice-http", "peer": "llamacpp", "output_throughput_ratio": 0.5,
                     "ttft_p90_ratio": 2.0, "tpot_mean_ratio": 1.0}]


def test_conversation_set_is_multi_turn_and_ends_with_a_user_turn():
    items = serving.conversation_items(serving.CONVERSATIONS, 50, None)
    assert len(items) == 50 and all(it.kind == "chat" and not it.exact for it in items)
    convs = [json.loads(line) for line in serving.CONVERSATIONS.read_text().splitlines()]
    assert len(convs) >= 40
    assert all(c["messages"][-1]["role"] == "user" and c["max_tokens"] > 0 for c in convs)
    assert sum(any(m["role"] == "assistant" for m in c["messages"]) for c in convs) >= 10


def test_each_load_point_gets_its_own_prompts_unless_asked_to_repeat(tiny_smollm2):
    # Reused prompts would let llama-server answer a later load point from the KV its slots kept.
    tok = serving._load_tokenizer(str(tiny_smollm2))
    args = serving.build_parser().parse_args(["--url", "http://x", "--num-prompts", "3", "--input-len", "10",
                                              "--concurrency", "1,4"])
    warmup, loads = serving._items(args, tok, 2)
    texts = [[it.text for it in items] for items in loads]
    assert len(loads) == 2 and all(len(t) == 3 for t in texts)
    assert not set(texts[0]) & set(texts[1]) and not {w.text for w in warmup} & set(texts[0] + texts[1])
    assert all(len(it.token_ids) == 10 and it.exact for items in loads for it in items)
    args.repeat_prompts = True
    assert serving._items(args, tok, 2)[1][0] == serving._items(args, tok, 2)[1][1] == loads[0]
    args.repeat_prompts, args.dataset, args.num_prompts = False, "grounded", 4
    chats = [[it.messages[0]["content"] for it in items] for items in serving._items(args, tok, 2)[1]]
    assert chats[0] == chats[1] == serving.GROUNDED                     # 4 prompts: the set, in turn
    args.num_prompts = 2
    chats = [[it.messages[0]["content"] for it in items] for items in serving._items(args, tok, 2)[1]]
    assert chats == [serving.GROUNDED[:2], serving.GROUNDED[2:]]


def test_serving_needs_a_target_and_positive_lengths():
    r = _run(["bench/serving.py", "--concurrency", "2"], timeout=60)
    assert r.returncode == 2 and "give a target" in r.stderr
    r = _run(["bench/serving.py", "--url", "http://127.0.0.1:9", "--input-len", "0"], timeout=60)
    assert r.returncode == 2 and "--input-len: must be a positive integer" in r.stderr
    r = _run(["bench/serving.py", "--url", "http://127.0.0.1:9", "--rounds", "0"], timeout=60)
    assert r.returncode == 2 and "--rounds: must be a positive integer" in r.stderr


def test_launched_servers_keep_the_callers_pythonpath_first_and_a_url_target_takes_a_name(tmp_path, monkeypatch):
    """Two sluice versions side by side: one already running (--url, named), one launched with the
    caller's PYTHONPATH (a package folder linking `sluice` to another checkout) ahead of the repo."""
    seen = {}

    def fake_popen(cmd, cwd, env, **kw):
        seen["path"] = env["PYTHONPATH"]
        return None

    monkeypatch.setattr(serving.subprocess, "Popen", fake_popen)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere/pkg")
    serving._spawn("x", ["true"], tmp_path, threads=1)
    assert seen["path"] == os.pathsep.join(["/elsewhere/pkg", str(REPO)])
    monkeypatch.delenv("PYTHONPATH")
    serving._spawn("x", ["true"], tmp_path, threads=1)
    assert seen["path"] == str(REPO)
    args = serving.build_parser().parse_args(["--url", "http://x", "--url-name", "sluice-main"])
    assert args.url_name == "sluice-main"
    assert serving.build_parser().parse_args(["--url", "http://x"]).url_name == "sluice-http"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed")
def test_plot_without_matplotlib_exits_2_with_the_install_hint(tmp_path):
    r = _run(["bench/serving.py", "--url", "http://127.0.0.1:9", "--plot", str(tmp_path)], timeout=60)
    assert r.returncode == 2 and "pip install matplotlib" in r.stderr


# ------------------------------------------------------------------------------ end to end
def _tiny_decode_bytes(vocab: int) -> int:
    """What one decode step of the tiny model streams: projections, tied LM head, norms (fp32)."""
    c = TINY_CONFIG
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head_dim = hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    return 4 * (layers * per_layer + vocab * hidden + hidden)


@pytest.mark.timeout(600)
def test_offline_quick_runs_every_section(tmp_path, tiny_smollm2):
    out = tmp_path / "offline.json"
    r = _run(["bench/offline.py", "--model", str(tiny_smollm2), "--threads", "1", "--quick", "--skip-hf",
              "--json", str(out)], timeout=580)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["throughput"]["engine"]["batch1_tok_s"] > 0
    assert 0 < res["decode"]["fraction_of_ceiling"]
    assert res["decode"]["weight_bytes"] == _tiny_decode_bytes(vocab=49152)
    assert res["prefix"]["cached_tokens"] >= 48          # the 64-token prefix, in whole blocks
    assert set(res["chunked"]) == {"16", "64"}
    assert "prefix (64 tokens): TTFT hit" in r.stdout


@pytest.mark.timeout(600)
def test_serving_against_real_facade_and_grpc_engine(tmp_path, tiny_smollm2):
    out = tmp_path / "serving.json"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    r = _run(["bench/serving.py", "--model", str(tiny_smollm2), "--threads", "1",
              "--launch", "http", "--launch", "grpc", "--num-prompts", "3", "--input-len", "12",
              "--output-len", "4", "--concurrency", "2", "--rounds", "2", "--slo-ttft-ms", "600000", "--json", str(out)],
             timeout=580, tmpdir=scratch)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert not list(scratch.iterdir())     # the servers' logs went with them
    res = json.loads(out.read_text())
    assert {x["target"] for x in res["results"]} == {"sluice-http", "sluice-grpc"}
    for x in res["results"]:
        m = x["metrics"]
        assert (m["completed"], m["failed"]) == (6, 0), m["errors"]             # 3 prompts in each of 2 rounds
        assert m["mean_prompt_tokens"] == 12 and m["mean_output_tokens"] == 4   # the servers' own usage
        assert m["goodput_req_s"] == pytest.approx(m["request_throughput"])
    assert "sluice-grpc" in r.stdout and "TTFT p90" in r.stdout and "c=2 round 2/2" in r.stdout


def test_sampling_bench_times_every_setting_against_greedy(tmp_path, tiny_smollm2):
    out = tmp_path / "sampling.json"
    r = _run(["bench/sampling.py", "--model", str(tiny_smollm2), "--quick", "--json", str(out)], timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["ms_per_step"]) == {"greedy", "T=1.0", "T=0.7, top_p=0.9", "T=0.8, top_k=40", "T=1.0, min_p=0.05"}
    assert all(ms > 0 for ms in res["ms_per_step"].values())
    assert "| T=0.7, top_p=0.9 |" in r.stdout


def test_step_bench_splits_a_step_into_phases_that_add_up(tmp_path, tiny_smollm2):
    out = tmp_path / "step.json"
    r = _run(["bench/step.py", "--model", str(tiny_smollm2), "--quick", "--penalties", "--context", "48",
              "--kv-cache-dtype", "float16", "--json", str(out)], timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["kv_cache_dtype"] == "torch.float16" and res["penalties"] and res["context"] == 48
    ms = res["ms"]["2"]
    phases = ("schedule", "inputs", "layers", "forward_python", "lm_head", "sampling_batch", "sampler",
              "sample_other", "outputs")
    assert all(ms[p] > 0 for p in phases), ms
    # The phases are disjoint: what is left of the step is small, never negative beyond timer noise.
    assert -0.05 * ms["step"] < ms["other"] < 0.5 * ms["step"], ms
    assert "| layers |" in r.stdout and "KV cache torch.float16" in r.stdout


@pytest.mark.parametrize("cold", [[], ["--cold", "--cold-mib", "1"]], ids=["cached", "cold"])
def test_attention_bench_checks_and_times_both_cache_types(cold):
    r = _run(["bench/attention.py", "--shapes", "2x8/2x64x20,1x3/1x16x5", "--budget", "0.01", "--threads", "1",
              *cold], timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert ("caches from memory (1 MiB of copies)" in r.stdout) == bool(cold), r.stdout
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 2x8") or line.startswith("| 1x3")]
    assert [row.split("|")[2].strip() for row in rows] == ["float32", "float16"] * 2, r.stdout


def test_replicas_bench_compares_routing_policies_and_times_tp_communication(tmp_path, tiny_smollm2):
    out = tmp_path / "replicas.json"
    r = _run(["bench/replicas.py", "--model", str(tiny_smollm2), "--replicas", "1,2", "--groups", "2",
              "--questions", "2", "--prefix-words", "40", "--kv-tokens", "512", "--concurrency", "2",
              "--threads", "1", "--json", str(out)], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    points = json.loads(out.read_text())
    assert [(p["replicas"], p["policy"]) for p in points] == [(1, "prefix"), (2, "prefix"), (2, "round_robin")]
    assert all(p["requests"] == 4 and 0 <= p["cached_share"] <= 1 and p["req_per_s"] > 0 for p in points)
    assert "replicas 2: prefix-aware / round robin: throughput" in r.stdout
    r = _run(["bench/replicas.py", "--tp-bench", "--model", str(tiny_smollm2), "--rows", "1,4", "--steps", "3"],
             timeout=300)
    assert r.returncode == 0 and r.stdout.count("tensor parallel, 2 ranks") == 2, r.stderr[-3000:]
