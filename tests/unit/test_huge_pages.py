"""Weights on transparent huge pages (engine/heap.py's huge_page_allocations, kernels/cpu_pages.cpp):
inside the scope, torch's large CPU allocations are their own 2 MiB-aligned mappings advised
MADV_HUGEPAGE; small ones, and everything after the scope, come from the allocator before it; the
memory stays valid after the scope and is unmapped with its tensor. Which allocations went to the
huge-page allocator is read from its byte count, not from the memory map: heap memory may be
advised for huge pages too (numpy advises its own large buffers, and the heap reuses them)."""
from __future__ import annotations

import torch

from sluice.engine import heap
from sluice.kernels import cpu_ext
from tests.helpers.pages import THP_BUILT, advised_huge, mapping_of

HUGE = 2 << 20


def _mapped() -> int:
    return cpu_ext.module().huge_page_bytes()


def test_large_allocations_inside_the_scope_are_advised_huge_page_mappings():
    before = _mapped()
    with heap.huge_page_allocations() as on:
        assert on is True
        big = torch.empty(3 << 20, dtype=torch.uint8).fill_(7)
        torch.empty(1 << 20, dtype=torch.uint8).fill_(9)     # under 2 MiB: the heap
    assert big.data_ptr() % HUGE == 0
    assert advised_huge(big.data_ptr()) is THP_BUILT
    after = torch.empty(3 << 20, dtype=torch.uint8)       # the scope is over: the heap again
    assert _mapped() - before == 3 << 20                  # neither the small one nor this one
    assert int(big.sum()) == 7 * (3 << 20)                # still valid after the scope
    start = big.data_ptr()
    assert mapping_of(start) is not None
    del big
    assert mapping_of(start) is None or mapping_of(start)[0] != start   # unmapped with the tensor


def test_views_and_clones_of_a_huge_page_tensor():
    with heap.huge_page_allocations():
        w = torch.arange(1 << 20, dtype=torch.float32)   # 4 MiB
    view = w[5:]
    del w
    assert float(view[0]) == 5.0 and advised_huge(view.data_ptr()) is THP_BUILT
    assert torch.equal(view.clone(), torch.arange(5, 1 << 20, dtype=torch.float32))


def test_a_scope_inside_another_keeps_the_outer_one():
    before = _mapped()
    with heap.huge_page_allocations():
        with heap.huge_page_allocations() as inner:
            assert inner is True
        t = torch.empty(2 << 20, dtype=torch.uint8)
    assert _mapped() - before == 2 << 20 and t.data_ptr() % HUGE == 0


def test_off_with_the_environment_variable(monkeypatch):
    monkeypatch.setenv("SLUICE_HUGE_PAGES", "0")
    before = _mapped()
    with heap.huge_page_allocations() as on:
        assert on is False
        t = torch.empty(4 << 20, dtype=torch.uint8)
    assert _mapped() == before and t.numel() == 4 << 20


def test_the_previous_allocator_is_back_after_an_exception():
    before = _mapped()
    try:
        with heap.huge_page_allocations():
            raise RuntimeError("a load that fails")
    except RuntimeError:
        pass
    torch.empty(4 << 20, dtype=torch.uint8)
    assert _mapped() == before
