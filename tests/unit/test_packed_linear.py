"""Float32 CPU projections packed for oneDNN compute what F.linear computes (to float32
reassociation), with and without bias, for every row count a step can have, and keep the
dense weight recoverable."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.engine.models.llama import _Linear, cpu_packing_available

pytestmark = pytest.mark.skipif(not cpu_packing_available(), reason="this torch build has no oneDNN packing")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 32, 77])
def test_packed_equals_dense(rows, bias):
    torch.manual_seed(rows)
    lin = _Linear(96, 200, bias=bias)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05)
        if bias:
            lin.bias.normal_()
    weight = lin.weight.detach().clone()
    x = torch.randn(rows, 96)
    want = F.linear(x, weight, lin.bias)
    lin.pack_for_cpu()
    assert lin.weight is None and lin.packed is not None        # no second dense copy kept
    with torch.inference_mode():
        got = lin(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(lin.dense_weight(), weight)
