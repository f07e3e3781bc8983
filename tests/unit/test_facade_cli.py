"""``sluice facade`` / ``sluice serve`` argument handling without starting anything: API keys
from flags, the environment and a file; constant-time key checks; CORS JSON lists; the serve
plan's engine and facade command lines (keys passed by environment, never on the command line);
unsupported flags refused with an error naming the flag."""
from __future__ import annotations

import argparse

import pytest

from sluice.http_facade.auth import AuthPolicy, load_keys
from sluice.http_facade.cli import add_facade_arguments, add_serve_arguments
from sluice.http_facade.options import facade_config
from sluice.http_facade.cors import parse_json_list
from sluice.http_facade.supervisor import build_plan, serve_from_args


def _serve_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(list(argv))


def test_keys_from_flags_env_and_file(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text("# ops keys\nk-file  \n\nk-flag\n")
    keys = load_keys(["k-flag"], str(f), env={"SLUICE_API_KEYS": "k-env1, k-env2,"})
    assert keys == ("k-flag", "k-env1", "k-env2", "k-file")
    with pytest.raises(ValueError, match="api_key_file"):
        load_keys([], str(tmp_path / "missing"), env={})


def test_key_check_is_exact():
    policy = AuthPolicy(keys=("abc", "xyz"))
    assert policy.accepts("xyz") and not policy.accepts("xy") and not policy.accepts("xyzz")
    assert not AuthPolicy().enabled


def test_cors_lists():
    assert parse_json_list('["http://a", "http://b"]', "--allowed-origins") == ("http://a", "http://b")
    for bad in ("*", '{"a": 1}', "[1]"):
        with pytest.raises(ValueError, match="--allowed-origins"):
            parse_json_list(bad, "--allowed-origins")


def test_facade_arguments():
    p = argparse.ArgumentParser()
    add_facade_arguments(p)
    args = p.parse_args(["--engine", "10.0.0.1:50051", "--api-key", "a", "--api-key", "b", "--allow-credentials",
                         "--allowed-origins", '["http://ui"]', "--max-body-bytes", "1024"])
    config = facade_config(args, args.engine)
    assert config.auth.keys[:2] == ("a", "b") and config.cors.allow_credentials
    assert config.cors.allowed_origins == ("http://ui",) and config.max_body_bytes == 1024
    with pytest.raises(SystemExit):
        p.parse_args([])     # --engine is required


def test_serve_plan(monkeypatch):
    monkeypatch.setenv("SLUICE_API_KEYS", "")
    args = _serve_args("smollm2", "--port", "8100", "--engine-port", "50123", "--mode", "server",
                       "--overrides", "max_waiting=4", "--api-key", "secret", "--enable-tracing")
    plan = build_plan(args)
    assert plan.engine_addr == "127.0.0.1:50123" and plan.facade_url == "http://127.0.0.1:8100"
    engine = " ".join(plan.engine_cmd)
    assert "-m sluice.engine.cli engine smollm2" in engine and "--overrides max_waiting=4" in engine
    assert "--mode server" in engine and "--port 50123" in engine
    facade = " ".join(plan.facade_cmd)
    assert "--engine 127.0.0.1:50123" in facade and "--enable-tracing" in facade
    assert "secret" not in facade and plan.facade_env == {"SLUICE_API_KEYS": "secret"}


def test_serve_plans_replicas_and_additional_models_as_engines_of_their_own():
    plan = build_plan(_serve_args("smollm2", "--data-parallel", "2", "--additional-models", "/m/qwen.gguf",
                                  "--routing", "round_robin"))
    assert [e.label for e in plan.engines] == ["engine 0 (smollm2)", "engine 1 (smollm2)", "engine 2 (/m/qwen.gguf)"]
    assert [e.cmd[e.cmd.index("engine") + 1] for e in plan.engines] == ["smollm2", "smollm2", "/m/qwen.gguf"]
    assert len({e.addr for e in plan.engines}) == 3
    facade = " ".join(plan.facade_cmd)
    assert all(f"--engine {e.addr}" in facade for e in plan.engines) and "--routing round_robin" in facade
    for e in plan.engines:   # an equal share of the cores each, and as many threads
        assert e.cpus and int(e.env["OMP_NUM_THREADS"]) <= len(e.cpus)
    one = build_plan(_serve_args("smollm2"))
    assert len(one.engines) == 1 and one.engines[0].cpus is None and one.engines[0].env == {}


@pytest.mark.parametrize("argv, flag", [
    (["--speculative-mode", "eagle"], "--additional-models: --speculative-mode eagle needs EAGLE heads"),
    (["--speculative-mode", "turbo"], "--speculative-mode: must be one of"),
    (["--data-parallel", "0"], "--data-parallel: must be a positive number of engines"),
    (["--data-parallel", "2", "--engine-port", "50100"], "--engine-port: one port cannot serve several engines"),
    (["--allowed-headers", "x"], "--allowed-headers"),
    (["--api-key", "a,b"], "--api-key"),
])
def test_serve_refuses_unsupported_or_bad_flags(argv, flag, capsys):
    assert serve_from_args(_serve_args("smollm2", *argv)) == 2
    assert flag in capsys.readouterr().err
