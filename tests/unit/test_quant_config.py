"""``quantization``: validated in DeviceConfig, settable as an override and as ``--quantization``
on the CLI (``sluice serve`` passes it to the engine), refused where it cannot run before any
weights load, and ``auto`` decided by the projections' storage types. A tiny random-weight HF
folder (float32 safetensors) runs in every format."""
from __future__ import annotations

import argparse

import pytest
import torch

from sluice.engine import cli, overrides
from sluice.engine.config import DeviceConfig
from sluice.engine.loaders import load_model
from sluice.engine.loaders.quantized import resolve_quantization
from tests.helpers.cpu import needs_onednn_bf16


def test_device_config_validates_quantization():
    assert DeviceConfig().quantization == "auto"
    for fmt in ("none", "bf16", "int8", "int4", "w8a8", "w4a8", "auto"):
        assert DeviceConfig(device="cpu", quantization=fmt).quantization == fmt
    with pytest.raises(ValueError, match="quantization: must be one of none, bf16, int8, int4, w8a8, w4a8, auto, got 'int3'"):
        DeviceConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization: int4 runs on CPU only; use none \\(or auto\\) with device cuda:1"):
        DeviceConfig(device="cuda:1", quantization="int4")
    assert DeviceConfig(device="cuda", quantization="auto").quantization == "auto"


def test_override_sets_it_and_a_bad_value_names_it():
    config = overrides.build_engine_config("m.gguf", overrides="quantization=int8", device="cpu",
                                           context_window=lambda model: 2048)
    assert config.device.quantization == "int8"
    with pytest.raises(ValueError, match="overrides: quantization: must be one of"):
        overrides.build_engine_config("m.gguf", overrides="quantization=fp8", context_window=lambda m: 2048)


def test_cli_flag_folds_into_the_overrides_and_must_agree_with_them():
    args = argparse.Namespace(overrides="max_num_sequence=2", quantization="int4")
    assert cli.with_quantization(args) == {"max_num_sequence": 2, "quantization": "int4"}
    assert cli.with_quantization(argparse.Namespace(overrides="quantization=int8", quantization=None)) == \
        {"quantization": "int8"}
    with pytest.raises(ValueError, match="--quantization int4 disagrees with the override quantization=int8"):
        cli.with_quantization(argparse.Namespace(overrides="quantization=int8", quantization="int4"))


def test_cli_rejects_an_unknown_format_and_a_conflict_before_loading(capsys, monkeypatch):
    import sluice.engine.engine_core

    monkeypatch.setattr(sluice.engine.engine_core, "EngineCore", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(SystemExit) as info:
        cli.main(["engine", "smollm2", "--quantization", "int2"])
    assert info.value.code == 2 and "invalid choice: 'int2'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["engine", "smollm2", "--quantization", "int4", "--overrides", "quantization=none"])
    assert info.value.code == 2 and "disagrees" in capsys.readouterr().err


def test_serve_passes_the_flag_to_the_engine():
    from sluice.http_facade.cli import add_serve_arguments
    from sluice.http_facade.supervisor import build_plan

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    plan = build_plan(parser.parse_args(["smollm2", "--quantization", "int8", "--engine-port", "1"]))
    cmd = list(plan.engine_cmd)
    assert cmd[cmd.index("--quantization") + 1] == "int8"
    plain = list(build_plan(parser.parse_args(["smollm2", "--engine-port", "1"])).engine_cmd)
    assert "--quantization" not in plain


@pytest.mark.parametrize("device, dtype, words", [
    ("cuda", "auto", "quantization: int8 runs on CPU only (device is cuda)"),
    ("cpu", "bfloat16", "quantization: int8 keeps activations in float32; it needs dtype float32"),
])
def test_refused_before_any_file_is_read(device, dtype, words):
    with pytest.raises(ValueError) as info:
        load_model("/no/such/model.gguf", device=device, dtype=dtype, quantization="int8")
    assert words in str(info.value)


class _Typed(dict):
    """A checkpoint mapping that reports storage types, as GGUFWeights and SafetensorsWeights do."""

    def __init__(self, types: dict[str, str]) -> None:
        super().__init__({name: None for name in types})
        self._types = types

    def tensor_type(self, name: str) -> str:
        return self._types[name]


# (storage types, auto's pick with sluice's C++ kernels, and without them: no compiler here, or
# only the portable loop)
@pytest.mark.parametrize("types, picked, without_kernels", [
    ({"a.q_proj.weight": "Q4_0", "a.down_proj.weight": "Q4_1", "norm.weight": "F32"}, "w4a8", "int4"),
    ({"a.q_proj.weight": "Q4_1", "a.down_proj.weight": "Q8_0"}, "w8a8", "none"),
    ({"a.q_proj.weight": "Q4_1", "a.down_proj.weight": "Q6_K"}, "w8a8", "none"),
    ({"a.q_proj.weight": "Q4_K", "a.v_proj.weight": "Q6_K", "a.up_proj.weight": "Q5_0",
      "a.o_proj.weight": "Q5_K", "a.down_proj.weight": "Q8_0", "b.q_proj.weight": "Q5_1"}, "w8a8", "none"),
    ({"a.q_proj.weight": "Q8_0", "a.down_proj.weight": "Q8_0"}, "w8a8", "none"),
    # Q2_K / Q3_K kept as stored (llama.cpp's Q3_K_M, Q2_K presets); types without a kernel of
    # their own (2-4 bits a value) are rounded to 8-bit blocks beside them (IQ3_XXS...), never to
    # w4a8's 4 bits.
    ({"a.q_proj.weight": "Q4_K", "a.down_proj.weight": "Q3_K"}, "w8a8", "none"),
    ({"a.q_proj.weight": "Q4_0", "a.up_proj.weight": "Q2_K", "a.down_proj.weight": "Q3_K"}, "w8a8", "none"),
    ({"a.q_proj.weight": "IQ4_NL", "a.down_proj.weight": "IQ4_XS"}, "w8a8", "none"),
    ({"a.q_proj.weight": "IQ2_XXS", "a.k_proj.weight": "IQ1_M", "a.up_proj.weight": "IQ3_S",
      "a.down_proj.weight": "Q6_K"}, "w8a8", "none"),
    ({"a.q_proj.weight": "TQ2_0", "a.down_proj.weight": "MXFP4"}, "w8a8", "none"),
    # A float projection anywhere keeps the file float32, as an all-float file does; so does a
    # type not measured (Q1_0: gguf cannot read it, the load refuses it by name).
    ({"a.q_proj.weight": "Q3_K", "a.down_proj.weight": "F16"}, "none", "none"),
    ({"a.q_proj.weight": "BF16"}, "none", "none"),
    ({"a.q_proj.weight": "F16", "a.down_proj.weight": "F32"}, "none", "none"),
    ({"a.q_proj.weight": "Q3_K", "a.down_proj.weight": "Q1_0"}, "none", "none"),
])
def test_auto_rule(types, picked, without_kernels, monkeypatch):
    from sluice.kernels import cpu_blockq, cpu_ext

    assert cpu_ext.available(), cpu_ext.unavailable_reason()
    assert resolve_quantization("auto", _Typed(types), torch.device("cpu")) == picked
    assert resolve_quantization("auto", _Typed(types), torch.device("cuda")) == "none"
    monkeypatch.setattr(cpu_blockq, "isa", lambda: "portable")   # built, but no vector path for this CPU
    assert resolve_quantization("auto", _Typed(types), torch.device("cpu")) == without_kernels
    monkeypatch.undo()
    monkeypatch.setattr(cpu_ext, "available", lambda: False)
    assert resolve_quantization("auto", _Typed(types), torch.device("cpu")) == without_kernels


def test_block_formats_without_the_kernels_are_a_clear_error(monkeypatch):
    from sluice.engine.loaders.quantized import check_quantization
    from sluice.kernels import cpu_ext

    monkeypatch.setattr(cpu_ext, "available", lambda: False)
    monkeypatch.setattr(cpu_ext, "unavailable_reason", lambda: "CalledProcessError: no compiler")
    for fmt in ("w4a8", "w8a8"):
        with pytest.raises(ValueError, match=f"quantization: {fmt} needs the block-quantized CPU kernels, "
                                             r"which could not be built here \(CalledProcessError: no compiler\)"):
            check_quantization(fmt, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.tiny_model import write_tiny_folder

    return write_tiny_folder(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("fmt", [pytest.param("bf16", marks=needs_onednn_bf16),
                                 "int8", "int4", "w8a8", "w4a8", "auto"])
def test_a_float_safetensors_folder_runs_in_every_format(tiny_folder, fmt):
    from sluice.engine.llm import LLM
    from sluice.engine.sampling_params import SamplingParams
    from tests.tiny_model import prompt

    llm = LLM(str(tiny_folder), device="cpu", quantization=fmt, kv_cache_memory_bytes=4 << 20)
    assert llm.engine.loaded.quantization == ("none" if fmt == "auto" else fmt)   # F32 file: auto keeps it
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = llm.generate(prompt(5), params)[0].outputs[0].token_ids
    batch = llm.generate([prompt(9), prompt(5), prompt(3)], params)
    assert len(alone) == 6 and batch[1].outputs[0].token_ids == alone


def test_kv_cache_dtype_is_validated_set_by_override_and_refused_where_it_cannot_run():
    from sluice.engine.config import CacheConfig
    from sluice.engine.loaders import resolve_kv_dtype

    assert CacheConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of auto, float32, float16, got 'int8'"):
        CacheConfig(kv_cache_dtype="int8")
    config = overrides.build_engine_config("m.gguf", overrides="kv_cache_dtype=float16", device="cpu",
                                           context_window=lambda model: 2048)
    assert config.cache.kv_cache_dtype == "float16"
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert resolve_kv_dtype("float16", torch.float32, cpu) == torch.float16
    assert resolve_kv_dtype("float16", torch.float16, cuda) == torch.float16
    with pytest.raises(ValueError, match="float16 under a bfloat16 model runs on CPU only"):
        resolve_kv_dtype("float16", torch.bfloat16, cuda)
    with pytest.raises(ValueError, match="float32 needs a float32 model, got bfloat16"):
        resolve_kv_dtype("float32", torch.bfloat16, cpu)
