"""Speculative decoding on the command line: ``sluice engine`` / ``generate`` and ``sluice serve``
take ``--speculative-mode``, ``--additional-models`` and the spec_* overrides; bad values exit 2
naming the flag or key before any model is touched; serve hands the flags to the engine."""
from __future__ import annotations

import argparse

import pytest

from sluice.engine import cli, overrides
from sluice.http_facade.cli import add_serve_arguments
from sluice.http_facade.supervisor import build_plan, serve_from_args


@pytest.fixture
def nothing_loads(monkeypatch):
    import sluice.engine.engine_core
    import sluice.engine.llm

    def forbidden(*a, **k):
        raise AssertionError("a model was touched")

    monkeypatch.setattr(sluice.engine.engine_core, "EngineCore", forbidden)
    monkeypatch.setattr(sluice.engine.llm, "LLM", forbidden)
    monkeypatch.setattr(overrides, "model_context_window", forbidden)


@pytest.mark.parametrize("argv, words", [
    (["engine", "smollm2", "--speculative-mode", "turbo"], ["speculative_mode: must be one of"]),
    (["engine", "smollm2", "--speculative-mode", "eagle"], ["additional_models", "needs EAGLE heads"]),
    (["generate", "smollm2", "hi", "--speculative-mode", "medusa"], ["additional_models", "needs Medusa heads"]),
    (["generate", "smollm2", "hi", "--speculative-mode", "small_draft"], ["additional_models", "needs a draft model"]),
    (["engine", "smollm2", "--speculative-mode", "ngram", "--overrides", "spec_draft_length=0"],
     ["spec_draft_length: must be an integer in [1, 16]"]),
    (["engine", "smollm2", "--speculative-mode", "ngram", "--overrides", "spec_ngram_min=3;spec_ngram_max=2"],
     ["spec_ngram_min"]),
    (["chat", "smollm2", "--additional-models", "x.gguf"],
     ["additional_models: only speculative_mode small_draft, eagle or medusa load additional models, not disable"]),
])
def test_bad_speculative_options_exit_2_before_anything_loads(argv, words, capsys, nothing_loads):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    for w in words:
        assert w in err


def test_engine_config_carries_the_speculative_options(monkeypatch):
    monkeypatch.setattr(overrides, "model_context_window", lambda model: 4096)
    cfg = overrides.build_engine_config("m.gguf", overrides="spec_draft_length=6;spec_ngram_max=5;spec_max_batch_size=2",
                                        speculative_mode="ngram")
    spec = cfg.speculative
    assert (spec.speculative_mode, spec.spec_draft_length, spec.spec_ngram_max, spec.spec_max_batch_size) == \
        ("ngram", 6, 5, 2)
    cfg = overrides.build_engine_config("m.gguf", speculative_mode="small_draft", additional_models="d.gguf")
    assert cfg.speculative.additional_models == "d.gguf" and cfg.speculative.num_speculative_tokens == 4
    cfg = overrides.build_engine_config("m.gguf", speculative_mode="medusa", additional_models="/heads",
                                        overrides="spec_draft_length=3")
    assert (cfg.speculative.speculative_mode, cfg.speculative.additional_models) == ("medusa", "/heads")


def _serve_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(list(argv))


def test_serve_hands_the_flags_to_the_engine(monkeypatch):
    monkeypatch.setenv("SLUICE_API_KEYS", "")
    plan = build_plan(_serve_args("smollm2", "--speculative-mode", "small_draft", "--additional-models", "d.gguf",
                                  "--overrides", "spec_draft_length=3"))
    engine = " ".join(plan.engine_cmd)
    assert "--speculative-mode small_draft" in engine and "--additional-models d.gguf" in engine
    assert "spec_draft_length=3" in engine
    assert "--speculative-mode" not in " ".join(build_plan(_serve_args("smollm2")).engine_cmd)
    for mode in ("eagle", "medusa"):   # the heads' folder goes to the engine, which loads and checks it
        engine = " ".join(build_plan(_serve_args("smollm2", "--speculative-mode", mode, "--additional-models",
                                                 "/heads")).engine_cmd)
        assert f"--speculative-mode {mode}" in engine and "--additional-models /heads" in engine


@pytest.mark.parametrize("argv, words", [
    (["--speculative-mode", "medusa"], ["--additional-models: --speculative-mode medusa needs Medusa heads"]),
    (["--speculative-mode", "eagle"], ["--additional-models: --speculative-mode eagle needs EAGLE heads"]),
    (["--speculative-mode", "small_draft"], ["--additional-models", "needs a draft model"]),
    (["--speculative-mode", "ngram", "--additional-models", "h"], ["--additional-models: only --speculative-mode"]),
    (["--speculative-mode", "nope"], ["--speculative-mode: must be one of"]),
])
def test_serve_refuses_bad_speculative_flags(argv, words, capsys):
    assert serve_from_args(_serve_args("smollm2", *argv)) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err
