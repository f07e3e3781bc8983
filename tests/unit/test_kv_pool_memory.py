"""The CPU KV pool's memory (``model_runner.zeroed_pool``): zero, cache-line aligned, and
resident only where written, so making a large pool neither takes time nor memory."""
from __future__ import annotations

import torch

from sluice.engine.model_runner import zeroed_pool


def _rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        line = next(ln for ln in fh if ln.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_a_cpu_pool_is_zero_aligned_and_resident_only_where_written():
    # A heap that has held and freed large blocks: calloc would clear memory taken from it (this
    # test failed with calloc in a pytest worker that had run other tests first).
    for _ in range(4):
        junk = [bytearray(8 << 20) for _ in range(8)]
        del junk
    before = _rss_bytes()
    shape = (4096, 16, 4, 64)                                     # 64 MiB of float32
    pool = zeroed_pool(shape, torch.float32, torch.device("cpu"))
    assert pool.shape == shape and pool.dtype == torch.float32 and pool.is_contiguous()
    assert pool.data_ptr() % 64 == 0
    assert _rss_bytes() - before < 8 << 20                        # nothing written, nothing resident
    pool[:1024] = 1.0                                             # a quarter of the blocks
    grown = _rss_bytes() - before
    assert 14 << 20 < grown < 24 << 20, grown
    assert not pool[1024:].any()                                  # reading maps zero pages only
    assert _rss_bytes() - before < grown + (4 << 20)
    for dtype in (torch.float16, torch.bfloat16):
        half = zeroed_pool((8, 16, 2, 8), dtype, torch.device("cpu"))
        assert half.dtype == dtype and half.data_ptr() % 64 == 0 and not half.any()
