"""Float32 (and bfloat16) CPU weights in oneDNN's packed layout, and the products over them.

MKL's sgemv/small-M sgemm behind ``F.linear`` streams a row-major weight at about a third of the
memory bandwidth, oneDNN's packed inner product at about two thirds. Both the decoder's float32
projections (``models.llama``) and the ``bf16`` format (``models.quant.Bf16Linear``) use these,
so they live below both: the quantized formats need nothing from the model that holds them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# The row count oneDNN lays packed weights out for. Measured on 2 EPYC cores (float32, 30
# matrices of 3456x576 streamed from memory): packed with this hint the product ran 2.2x faster
# than F.linear at 1 row, 2.9x at 8, 2.2x at 32 and 1.4x at 512 rows.
_CPU_PACK_ROWS_HINT = 32


def cpu_packing_available() -> bool:
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] float32 weight reordered into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _CPU_PACK_ROWS_HINT)


# oneDNN (and ideep in front of it) build and cache one JIT-compiled primitive per input shape:
# about 0.5-1 MB and 1.5 ms each, in two LRU caches of 1024 entries. A step's row count (tokens
# in the batch) takes hundreds of values under mixed prefill, so an engine that saw each one
# grew by ~1 GB before the caches filled (the soak: +130 MB in 60 s on the tiny model). Rows are
# therefore zero-padded up to a bucket: exact from _MIN_ROWS to _EXACT_ROWS, then four
# buckets per doubling (at most 25% padding, ~12% on average): 41 shapes per projection up to
# 2048 rows, 49 up to 8192, all compiled within the first few hundred steps.
# Below _MIN_ROWS rows, _MIN_ROWS: oneDNN streams a weight from memory faster for 4-6 rows than
# for 1-3 (80 distinct SmolLM2 MLP weights, cold: 25-26 GB/s at 4-6 rows, 22 at 1, 20 at 2, 21
# at 7-8), so a batch-1 float32 decode step padded to 4 rows takes 24 ms instead of 29 here.
_MIN_ROWS = 4
_EXACT_ROWS = 16


def row_bucket(rows: int) -> int:
    """The row count a packed projection of ``rows`` rows runs at (>= rows; few distinct values)."""
    if rows < _MIN_ROWS:
        return _MIN_ROWS
    if rows <= _EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 3)   # a quarter of the doubling rows falls in
    return -(-rows // step) * step


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    padded = row_bucket(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, padded - rows))   # rows are independent
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def warm_up_row_buckets(shapes: dict[tuple[int, int], torch.Tensor], max_rows: int, done: int) -> None:
    """Run each packed weight of ``shapes`` ((in, out) -> packed weight) once at every row bucket
    in (``done``, ``max_rows``], so that oneDNN compiles and caches all the primitives a step can
    need now rather than one by one under load (each ~0.5 MB: an engine that meets them
    gradually grows by ~100 MB over hours, which looks like a leak and is not one)."""
    buckets = sorted({row_bucket(r) for r in range(done + 1, max_rows + 1)})
    with torch.inference_mode():
        for (inp, _out), packed in shapes.items():
            for rows in buckets:
                torch.ops.mkldnn._linear_pointwise(torch.zeros(rows, inp), packed, None, "none", [], "")
