"""``sluice`` CLI: bad modes, overrides and devices fail with exit code 2 and a message naming
the key before any model loads; ``sluice engine`` hands the mode/overrides/host/port/grace to the
server; ``sluice generate`` and ``sluice chat --message`` print what the offline API generates."""
from __future__ import annotations

import pytest

from sluice.engine import cli, overrides


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if a model's weights (or, with ``metadata=False``, its header) are touched."""
    import sluice.engine.engine_core
    import sluice.engine.llm

    def forbidden(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(sluice.engine.engine_core, "EngineCore", forbidden)
    monkeypatch.setattr(sluice.engine.llm, "LLM", forbidden)
    monkeypatch.setattr(overrides, "model_context_window", forbidden)


def _exit(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["engine", "smollm2", "--overrides", "max_num_seqs=8"], ["unknown key 'max_num_seqs'"]),
    (["engine", "smollm2", "--overrides", "max_num_sequence=many"], ["max_num_sequence='many'"]),
    (["generate", "smollm2", "hi", "--overrides", "attention_sink_size=four"], ["attention_sink_size='four'"]),
    (["chat", "smollm2", "--overrides", "block_size"], ["key=value"]),
    (["engine", "smollm2", "--mode", "turbo"], ["invalid choice", "turbo"]),
])
def test_bad_options_exit_2_before_anything_loads(argv, words, capsys, nothing_loads) -> None:
    code, err = _exit(argv, capsys)
    assert code == 2
    for w in words:
        assert w in err


@pytest.mark.parametrize("argv, words", [
    (["engine", "smollm2", "--overrides", "max_num_sequence=0"], ["max_num_sequence", "positive"]),
    (["engine", "smollm2", "--device", "tpu"], ["device"]),
    (["generate", "smollm2", "hi", "--overrides", "gpu_memory_utilization=2"], ["gpu_memory_utilization"]),
])
def test_bad_values_exit_2_before_weights_load(argv, words, capsys, monkeypatch) -> None:
    import sluice.engine.engine_core
    import sluice.engine.llm

    def forbidden(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(sluice.engine.engine_core, "EngineCore", forbidden)
    monkeypatch.setattr(sluice.engine.llm, "LLM", forbidden)
    monkeypatch.setattr(overrides, "model_context_window", lambda model: 8192)
    code, err = _exit(argv, capsys)
    assert code == 2
    for w in words:
        assert w in err


def test_engine_command_wires_mode_overrides_and_server_options(monkeypatch) -> None:
    import sluice.engine.engine_core
    import sluice.engine.rpc.server

    seen = {}
    built = []
    monkeypatch.setattr(overrides, "model_context_window", lambda model: 4096)
    monkeypatch.setattr(sluice.engine.engine_core, "EngineCore", lambda config, progress: built.append((config, progress)))

    async def fake_serve(factory, server_config, on_started, embedding_factory=None):
        seen["server"] = server_config
        factory()                       # what the engine thread would call
        return 0

    monkeypatch.setattr(sluice.engine.rpc.server, "serve", fake_serve)
    code = cli.main(["engine", "my.gguf", "--host", "0.0.0.0", "--port", "6000", "--grace", "2.5",
                     "--device", "cpu", "--mode", "server", "--overrides", "prefill_chunk_size=512;max_waiting=7"])
    assert code == 0
    server = seen["server"]
    assert (server.host, server.port, server.grace_s) == ("0.0.0.0", 6000, 2.5)
    (config, progress), = built
    assert progress is True and config.model == "my.gguf" and config.device.device == "cpu"
    sched = config.scheduler
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_waiting) == (128, 512, 7)


def test_serve_and_facade_are_registered(capsys) -> None:
    """``sluice serve`` / ``sluice facade`` come from the HTTP facade; a bad flag fails before
    anything starts."""
    code, err = _exit(["serve", "smollm2", "--overrides", "bogus=1"], capsys)
    assert code == 2 and "overrides: unknown key 'bogus'" in err
    code, err = _exit(["facade"], capsys)
    assert code == 2 and "--engine" in err


# ---- the offline commands, on the tiny random-weight SmolLM2 (tests/model_files.py) ----------
# They check the CLI's plumbing: arguments → engine config → the offline API → what is printed.
@pytest.fixture(scope="module")
def model(tiny_smollm2) -> str:
    return str(tiny_smollm2)


@pytest.fixture(scope="module")
def shared_llm(model):
    from sluice.engine.llm import LLM

    return LLM(config=overrides.build_engine_config(model, device="cpu"))


@pytest.fixture
def cli_llm(shared_llm, monkeypatch):
    """The CLI's ``LLM(config=...)`` gets the already loaded model if its config is the same."""
    import sluice.engine.llm

    def make(*, config, progress):
        assert config == shared_llm.engine.config
        return shared_llm

    monkeypatch.setattr(sluice.engine.llm, "LLM", make)
    return shared_llm


def test_generate_prints_the_offline_completion(cli_llm, model, capsys) -> None:
    from sluice.engine.sampling_params import SamplingParams

    assert cli.main(["generate", model, "The capital of France is", "--device", "cpu",
                     "--max-tokens", "6", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    ref = cli_llm.generate("The capital of France is", SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert printed == ref.outputs[0].text + "\n"


def test_chat_one_shot_and_repl(cli_llm, model, capsys, monkeypatch) -> None:
    from sluice.engine.sampling_params import SamplingParams

    assert cli.main(["chat", model, "--device", "cpu", "--message", "Say hi.", "--max-tokens", "8",
                     "--temperature", "0"]) == 0
    one_shot = capsys.readouterr().out
    ref = cli_llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert one_shot == ref.outputs[0].text + "\n"

    lines = iter(["Say hi.", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert cli.main(["chat", model, "--device", "cpu", "--max-tokens", "8", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == one_shot


@pytest.mark.parametrize("extra, prefaults", [
    ([], True),
    (["--device", "cpu", "--quantization", "w8a8"], True),
    (["--quantization", "none"], False),                    # float32: several times the file
    (["--overrides", "quantization=bf16"], False),
    (["--device", "cuda"], False),
    (["--tensor-parallel-size", "2"], False),               # each rank builds a slice
])
def test_which_commands_prefault_the_weights_of_a_gguf_file(extra, prefaults, tmp_path, monkeypatch):
    """``sluice engine``/``generate``/``chat`` start faulting in a GGUF file's worth of memory before
    their imports (engine/heap.py's prefault_weights) when the weights will be a CPU block format."""
    from sluice.engine import heap

    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 12345)
    calls: list[int] = []
    monkeypatch.setattr(heap, "prefault_weights", lambda n: calls.append(n) or True)
    for argv in (["engine", str(model)], ["generate", str(model), "hi"], ["chat", str(model)]):
        cli._prefault_weights(cli._build_parser().parse_args(argv + extra))
    assert calls == ([12345] * 3 if prefaults else [])
    cli._prefault_weights(cli._build_parser().parse_args(["engine", str(tmp_path)]))       # a folder: no
    cli._prefault_weights(cli._build_parser().parse_args(["engine", str(tmp_path / "x.gguf")]))   # missing: no
    assert len(calls) == (3 if prefaults else 0)


def test_an_arena_the_command_did_not_load_into_is_unmapped(tmp_path, monkeypatch, nothing_loads, capsys):
    from sluice.engine import heap

    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * (3 << 20))
    taken: list = []
    real = heap.prefault_weights
    monkeypatch.setattr(heap, "prefault_weights", lambda n: taken.append(real(n)) or taken[-1])
    with pytest.raises(AssertionError, match="a model was loaded"):
        cli.main(["generate", str(model), "hi", "--device", "cpu"])
    assert taken == [True] and heap._arena["pending"] is None
