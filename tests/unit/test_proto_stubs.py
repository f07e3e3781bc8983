"""The committed gRPC stubs in engine/rpc/ are what the pinned grpcio-tools makes of
proto/sluice/v1/engine.proto today (regenerate with ``python -m sluice.engine.rpc.regen``), they
import as part of the ``sluice.engine.rpc`` package, and the runtime floors in pyproject.toml are
the versions the generated code checks for."""
from __future__ import annotations

import ast
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

from sluice.engine.rpc import regen

PYPROJECT = (regen.REPO_ROOT / "pyproject.toml").read_text()


def _serialized_descriptor(pb2_source: str) -> bytes:
    """The FileDescriptorProto bytes that a generated ``*_pb2.py`` registers."""
    m = re.search(r"AddSerializedFile\((b'.*?')\)\n", pb2_source, re.DOTALL)
    assert m, "no AddSerializedFile(...) in the generated module"
    return ast.literal_eval(m.group(1))


def _grpc_generated_version(grpc_source: str) -> str:
    m = re.search(r"^GRPC_GENERATED_VERSION = '([^']+)'", grpc_source, re.MULTILINE)
    assert m, "no GRPC_GENERATED_VERSION in the generated service module"
    return m.group(1)


def _protobuf_gencode_version(pb2_source: str) -> str:
    """The runtime version that ``ValidateProtobufRuntimeVersion(PUBLIC, major, minor, patch, ...)`` asks for."""
    m = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),",
                  pb2_source)
    assert m, "no ValidateProtobufRuntimeVersion(...) in the generated module"
    return ".".join(m.groups())


def _requirement(spec: str) -> str:
    """The requirement in pyproject.toml that starts with ``spec`` (e.g. "grpcio>=": the whole "grpcio>=1.71.2")."""
    m = re.search(rf'^\s*"({re.escape(spec)}[^"]*)"', PYPROJECT, re.MULTILINE)
    assert m, f"pyproject.toml has no requirement starting with {spec!r}"
    return m.group(1)


def _pinned_tools_version() -> str:
    return _requirement("grpcio-tools==").removeprefix("grpcio-tools==")


def _require_pinned_tools() -> None:
    pinned = _pinned_tools_version()
    try:
        installed = version("grpcio-tools")
    except PackageNotFoundError:
        installed = None
    if installed != pinned:
        pytest.fail(f"grpcio-tools {installed or '(not installed)'} is installed, but the stubs are generated and "
                    f"checked with the pinned grpcio-tools=={pinned} (the dev extra): run `make setup` "
                    f"(or `pip install -e '.[dev]'`)", pytrace=False)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    _require_pinned_tools()
    out = tmp_path_factory.mktemp("stubs")
    regen.generate(out)
    return out


def test_committed_descriptor_matches_the_proto(fresh: Path) -> None:
    committed = (regen.STUB_DIR / "engine_pb2.py").read_text()
    regenerated = (fresh / "engine_pb2.py").read_text()
    assert _serialized_descriptor(committed) == _serialized_descriptor(regenerated), (
        "engine/rpc/engine_pb2.py is stale: run `python -m sluice.engine.rpc.regen`")


def test_committed_files_are_byte_identical_with_the_pinned_tools(fresh: Path) -> None:
    for name in regen.GENERATED:
        assert (regen.STUB_DIR / name).read_text() == (fresh / name).read_text(), (
            f"engine/rpc/{name} is stale: run `python -m sluice.engine.rpc.regen`")


def test_runtime_floors_are_what_the_generated_code_checks_for() -> None:
    """grpcio's floor is the gencode's GRPC_GENERATED_VERSION and protobuf's the version its
    ValidateProtobufRuntimeVersion asks for: a lower floor would install a runtime the stubs refuse,
    a higher one would turn away environments they run in."""
    grpc_gen = _grpc_generated_version((regen.STUB_DIR / "engine_pb2_grpc.py").read_text())
    assert grpc_gen == _pinned_tools_version()
    assert _requirement("grpcio>=") == f"grpcio>={grpc_gen}"
    protobuf_gen = _protobuf_gencode_version((regen.STUB_DIR / "engine_pb2.py").read_text())
    floor = _requirement("protobuf>=").split(",")[0]
    assert floor == f"protobuf>={protobuf_gen}"


def test_stubs_import_as_a_package_without_absolute_sluice_imports() -> None:
    from sluice.engine.rpc import engine_pb2, engine_pb2_grpc

    source = (regen.STUB_DIR / "engine_pb2_grpc.py").read_text()
    assert "from sluice" not in source and "import sluice" not in source
    assert engine_pb2_grpc.sluice_dot_v1_dot_engine__pb2 is engine_pb2   # the same module, not a copy
    service = engine_pb2.DESCRIPTOR.services_by_name["EngineService"]
    assert service.full_name == "sluice.v1.EngineService"
    methods = {m.name: m for m in service.methods}
    assert {"Generate", "Abort", "Tokenize", "Detokenize", "GetModelInfo", "ListModels", "GetLoad"} <= set(methods)
    assert methods["Generate"].server_streaming and not methods["Generate"].client_streaming
    assert hasattr(engine_pb2_grpc, "EngineServiceStub")
    assert hasattr(engine_pb2_grpc, "add_EngineServiceServicer_to_server")
    # Every RPC is Foo(FooRequest) returns (FooResponse), the streaming Generate included.
    for m in service.methods:
        assert (m.input_type.name, m.output_type.name) == (f"{m.name}Request", f"{m.name}Response")


def test_unset_sampling_fields_are_distinguishable_from_zero() -> None:
    from sluice.engine.rpc import engine_pb2 as pb

    msg = pb.SamplingParams(temperature=0.0)
    assert msg.HasField("temperature") and not msg.HasField("top_p") and not msg.HasField("seed")


def test_regen_rewrites_the_absolute_import(tmp_path: Path) -> None:
    """The post-processing step is the only edit: without it the service module would import
    ``sluice.v1``, which is not a package here."""
    _require_pinned_tools()
    regen.run_protoc(tmp_path)
    raw = (tmp_path / "sluice/v1/engine_pb2_grpc.py").read_text()
    assert "from sluice.v1 import engine_pb2 as" in raw
    fixed = (regen.STUB_DIR / "engine_pb2_grpc.py").read_text()
    assert "from . import engine_pb2 as" in fixed
