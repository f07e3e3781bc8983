"""What a test needs of the CPU it runs on, as pytest marks with the reason printed."""
from __future__ import annotations

import pytest

from sluice.engine.models import quant

# bf16 weights need oneDNN's bfloat16 (AVX-512); elsewhere the format is refused by name, which
# tests/unit/test_quant_kernels.py::test_bf16_is_refused_clearly_where_onednn_lacks_it checks.
needs_onednn_bf16 = pytest.mark.skipif(quant.bf16_unavailable_reason() is not None,
                                       reason=str(quant.bf16_unavailable_reason()))
