"""tests/triton_interpreter.py is in force under the interpreter: one language patch per launch
however many helper calls the kernel makes, and no overflow sanitizer. (If a Triton release
changes the interpreter's layout, ``install`` leaves it alone and this test says so.)"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import HAS_CUDA

pytestmark = pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without CUDA")


def test_one_language_patch_per_launch_and_no_overflow_sanitizer(monkeypatch):
    from triton.runtime import interpreter

    from sluice.kernels.sampling import sample
    from tests.kernels.test_sampling import _params

    assert getattr(interpreter._patch_lang, "once_per_launch", False), "tests/triton_interpreter.py not installed"
    assert not interpreter.interpreter_builder.options.sanitize_overflow
    patched, calls = [], []
    real_builtin, real_lang = interpreter._patch_builtin, interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda pkg, *a: patched.append(pkg) or real_builtin(pkg, *a))
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: calls.append(fn) or real_lang(fn))
    # Three rows of top-k with top-p: the kernel's bisection calls a helper up to 31 times a row,
    # and Triton asks for the language to be patched at each call.
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    assert sample(logits, **_params(3, "cpu", temperature=1.0, top_k=5, top_p=0.5)).shape == (3,)
    assert len(calls) > 50, len(calls)
    # Patched once for the launch (4 objects: the language module, its tensor class, tl.math,
    # tensor descriptors) and once more for each helper module of Triton's own that sees other
    # language modules (tl.rand's, which imports triton.language.core): never per call.
    assert len(patched) <= 12, len(patched)
