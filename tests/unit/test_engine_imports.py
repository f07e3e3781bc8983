"""What a CPU engine process does not import: triton (its library is ~64 MiB resident, and the
C++ kernels are all a w4a8 engine runs) and torch._dynamo (with sympy: ~2 s and ~100 MiB,
pulled in by initialising parameters on the meta device). And what ``sluice``'s command line
does not import before a subcommand needs it: torch (~1.2 s here, which ``sluice serve``'s
supervising process and the facade never need; the ready time of a tiny-model server went from
4.1 to 2.9 s)."""
from __future__ import annotations

import ast
import subprocess
import sys


def _unwanted_modules(code: str, unwanted: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; the first few imported modules for which the
    expression ``unwanted`` (over ``m``, a module name) is true."""
    code = f"import sys\n{code}print(sorted(m for m in sys.modules if {unwanted})[:3])\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return ast.literal_eval(r.stdout.strip().splitlines()[-1])


def test_a_cpu_engine_and_its_embedding_model_import_neither_triton_nor_dynamo(tiny_smollm2):
    code = ("from sluice.engine.llm import LLM\n"
            "from sluice.engine.loaders.bert_loader import load_embedding_model\n"
            "from sluice.engine.sampling_params import SamplingParams\n"
            f"llm = LLM({str(tiny_smollm2)!r}, quantization='w4a8', kv_cache_memory_bytes=4 << 20)\n"
            "out = llm.generate(['hi there'], SamplingParams(max_tokens=3, ignore_eos=True))\n"
            "assert len(out[0].outputs[0].token_ids) == 3 and llm.engine.loaded.model._cpu_decoder() is not None\n"
            "assert load_embedding_model('all-minilm-l6-v2').encoder is not None\n")
    assert _unwanted_modules(code, "m.split('.')[0] == 'triton' or m.startswith('torch._dynamo')") == []


def test_the_command_line_and_the_facade_import_no_torch():
    code = ("from sluice.engine.cli import _build_parser\n"
            "from sluice.http_facade.supervisor import build_plan\n"
            "import sluice.http_facade.app\n"
            "args = _build_parser().parse_args(['serve', 'smollm2'])\n"
            "assert build_plan(args).engine_cmd\n")
    assert _unwanted_modules(code, "m.split('.')[0] == 'torch'") == []


def test_the_supervisor_and_the_engines_parser_import_none_of_the_facades_libraries():
    """``sluice serve`` checks every flag and starts the engine before the facade's libraries could
    load (aiohttp, gRPC, protobuf, pydantic, prometheus: 0.3-0.5 s here, on the way to the engine
    process and again inside it); they are imported only by the process that serves HTTP."""
    code = ("from sluice.engine.cli import _build_parser\n"
            "from sluice.http_facade.supervisor import build_plan\n"
            "args = _build_parser().parse_args(['serve', 'smollm2', '--api-key', 'k', '--routing', 'round_robin'])\n"
            "assert build_plan(args).engine_cmd\n"
            "_build_parser().parse_args(['engine', 'smollm2'])\n")
    heavy = ("aiohttp", "grpc", "grpc_health", "google", "pydantic", "prometheus_client", "torch")
    assert _unwanted_modules(code, f"m.split('.')[0] in {heavy!r}") == []
