"""The .proto is a sufficient contract: a client whose stubs are regenerated from
proto/sluice/v1/engine.proto into a temporary folder with grpcio-tools (in a fresh interpreter
that refuses to import this repository) streams a generation that equals the SDK's. Server reflection
lists the service and describes its methods; health says SERVING after load."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.engine.client import EngineClient, EngineRpcError
from tests.integration.conftest import REPO

pytestmark = pytest.mark.slow

_CLIENT = r'''
import json, sys


class _BlockRepo:
    """The repository may be installed (editable) in this interpreter: refuse its packages so
    that only the stubs regenerated from the .proto can serve this client."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[:2] in (["sluice", "engine"], ["sluice", "kernels"], ["sluice", "http_facade"]):
            raise ImportError(f"{name}: blocked, this client may use only the regenerated stubs")
        return None


sys.meta_path.insert(0, _BlockRepo())
sys.path.insert(0, sys.argv[1])
import grpc
from sluice.v1 import engine_pb2 as pb, engine_pb2_grpc as pb_grpc
try:
    import sluice.engine
    raise SystemExit("the repository is importable: this client would not prove anything")
except ImportError:
    pass
with grpc.insecure_channel(sys.argv[2]) as channel:
    stub = pb_grpc.EngineServiceStub(channel)
    sampling = pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    req = pb.GenerateRequest(text="The river flows", sampling=sampling)
    msgs = list(stub.Generate(req, timeout=120))
choices = [c for m in msgs for c in m.choices]
print(json.dumps({
    "messages": len(msgs),
    "text": "".join(c.text for c in choices),
    "token_ids": [t for c in choices for t in c.token_ids],
    "finish": pb.FinishReason.Name(choices[-1].final.finish_reason),
    "completion_tokens": choices[-1].final.usage.completion_tokens,
}))
'''


def test_client_built_only_from_the_proto_streams(engine_server, tmp_path: Path) -> None:
    from grpc_tools import protoc

    out = tmp_path / "stubs"
    out.mkdir()
    rc = protoc.main(["protoc", f"-I{REPO / 'proto'}", f"--python_out={out}", f"--grpc_python_out={out}",
                      str(REPO / "proto/sluice/v1/engine.proto")])
    assert rc == 0 and (out / "sluice/v1/engine_pb2_grpc.py").is_file()
    script = tmp_path / "client.py"
    script.write_text(_CLIENT)
    proc = subprocess.run([sys.executable, "-I", str(script), str(out), engine_server.target],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["finish"] == "FINISH_REASON_LENGTH" and got["completion_tokens"] == 6
    assert got["messages"] >= 2                      # streamed, not one reply
    with EngineClient(engine_server.target, timeout=120) as client:
        ref = client.generate("The river flows", max_tokens=6, temperature=0.0, ignore_eos=True).collect()[0]
    assert (got["text"], got["token_ids"]) == (ref.text, ref.token_ids)


def test_reflection_lists_and_describes_the_service(engine_server) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    from google.protobuf.descriptor_pool import DescriptorPool

    with grpc.insecure_channel(engine_server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"sluice.v1.EngineService", "grpc.health.v1.Health"} <= services
        pool = DescriptorPool(db)
        service = pool.FindServiceByName("sluice.v1.EngineService")
        methods = {m.name for m in service.methods}
    assert {"Generate", "Abort", "Tokenize", "Detokenize", "GetModelInfo", "ListModels", "GetLoad"} <= methods


def test_health_is_serving_after_load(engine_server) -> None:
    with EngineClient(engine_server.target, timeout=10) as client:
        assert client.health() == "SERVING"
        assert client.health("sluice.v1.EngineService") == "SERVING"
        with pytest.raises(EngineRpcError) as info:
            client.health("no.such.Service")
        assert info.value.code == grpc.StatusCode.NOT_FOUND
    with grpc.insecure_channel(engine_server.target) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
