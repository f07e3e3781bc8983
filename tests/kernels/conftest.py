"""Kernel tests run on CUDA when present, else on CPU under the Triton interpreter.

TRITON_INTERPRET must be set before ``triton.jit`` decorates the kernels, i.e. before anything
imports ``kernels``; this conftest is imported before the test modules of this folder. (If
another folder's tests import ``kernels`` first in the same session, the kernels stay compiled
for CUDA: run ``tests/kernels`` in its own pytest process on CPU.)
"""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Triton's interpreter keeps bf16 as raw uint16 and multiplies those bit patterns in ``tl.dot``
# (triton-lang/triton#11584, "not supported yet"): bf16 kernels that use tl.dot run on CUDA only.
# fp16 goes through the interpreter, and bf16 kernels without tl.dot do too.
BF16_DOT = pytest.param(torch.bfloat16, marks=pytest.mark.gpu, id="bfloat16")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")
