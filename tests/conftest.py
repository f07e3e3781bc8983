"""Suite-wide set-up. Without CUDA, Triton kernels run under the interpreter; the variable must
be set before anything imports triton, so it is set here, at the root, first."""
from __future__ import annotations

import os

# Every engine step checks that no request is tracked without being scheduled, waiting or
# reported (engine.envs.debug_invariants); engine processes started by tests inherit it.
os.environ.setdefault("SLUICE_DEBUG_INVARIANTS", "1")

if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        os.environ["TRITON_INTERPRET"] = "1"
