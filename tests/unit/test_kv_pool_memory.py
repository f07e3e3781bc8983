"""The CPU KV pool's memory (``model_runner.zeroed_pool``): zero, cache-line aligned, and
resident only where written, so making a large pool neither takes time nor memory."""
from __future__ import annotations

import os
import struct

import torch

from sluice.engine.model_runner import zeroed_pool


def _private_resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s memory held by pages private to this process, read from /proc/self/pagemap
    for exactly its address range (bit 63: present; bit 56: mapped by this process only). The
    shared zero page, which a read of never-written anonymous memory maps, is not counted. The
    process's whole RSS would also count what other threads of a pytest worker allocate meanwhile
    (CI saw 12 MiB of that between two reads)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first = t.data_ptr() // page
    last = -(-(t.data_ptr() + t.numel() * t.element_size()) // page)
    with open("/proc/self/pagemap", "rb") as fh:
        fh.seek(first * 8)
        entries = fh.read((last - first) * 8)
    private = sum(1 for (e,) in struct.iter_unpack("<Q", entries) if e >> 63 & 1 and e >> 56 & 1)
    return private * page


def test_a_cpu_pool_is_zero_aligned_and_resident_only_where_written():
    # A heap that has held and freed large blocks: calloc would clear memory taken from it (this
    # test failed with calloc in a pytest worker that had run other tests first).
    for _ in range(4):
        junk = [bytearray(8 << 20) for _ in range(8)]
        del junk
    shape = (4096, 16, 4, 64)                                     # 64 MiB of float32
    pool = zeroed_pool(shape, torch.float32, torch.device("cpu"))
    assert pool.shape == shape and pool.dtype == torch.float32 and pool.is_contiguous()
    assert pool.data_ptr() % 64 == 0
    assert _private_resident_bytes(pool) == 0                     # nothing written, nothing resident
    pool[:1024] = 1.0                                             # a quarter of the blocks
    written = _private_resident_bytes(pool)
    assert 16 << 20 <= written <= 18 << 20, written               # a huge page may round it up
    assert not pool[1024:].any()                                  # reading maps the zero page only
    assert _private_resident_bytes(pool) == written
    for dtype in (torch.float16, torch.bfloat16):
        half = zeroed_pool((8, 16, 2, 8), dtype, torch.device("cpu"))
        assert half.dtype == dtype and half.data_ptr() % 64 == 0 and not half.any()


def test_torch_zeros_would_fail_the_residency_check():
    # The measure itself can fail: a pool written in full at creation is all resident.
    eager = torch.zeros((1024, 16, 4, 64))                        # 16 MiB
    assert _private_resident_bytes(eager) >= 15 << 20
