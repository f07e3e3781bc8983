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


MIB = 1 << 20


def _pending() -> heap._Arena:
    arena = heap._arena["pending"]
    assert arena is not None
    return arena


def test_a_prefaulted_arena_hands_out_its_pieces_in_order_and_unmaps_what_is_left():
    """heap.prefault_weights maps a 2 MiB-aligned arena advised for huge pages; inside a load's
    weight_arena scope large allocations are its next pieces (4 KiB-rounded), one that does not fit
    is a mapping of its own, the untaken rest is unmapped when the scope closes, and each piece is
    unmapped with its tensor. The faulting thread has stopped before anything is handed out, so
    nothing it writes lands in a tensor."""
    assert heap.prefault_weights(8 * MIB) is True
    arena = _pending()
    start = arena.address
    assert start % HUGE == 0 and arena.length == 8 * MIB and advised_huge(start) is THP_BUILT
    before = _mapped()
    with heap.huge_page_allocations():
        with heap.weight_arena():
            assert heap._arena["pending"] is None and not arena._thread.is_alive()
            a = torch.empty(3 * MIB - 100, dtype=torch.uint8).fill_(1)
            b = torch.empty(3 * MIB, dtype=torch.uint8).fill_(2)
            c = torch.empty(4 * MIB, dtype=torch.uint8).fill_(3)    # 2 MiB left: its own mapping
            small = torch.empty(MIB, dtype=torch.uint8)              # under 2 MiB: the heap
        assert a.data_ptr() == start and b.data_ptr() == start + 3 * MIB
        assert not start <= c.data_ptr() < start + 8 * MIB and c.data_ptr() % HUGE == 0
        assert not start <= small.data_ptr() < start + 8 * MIB
    assert _mapped() - before == 10 * MIB
    assert 0 <= arena.touched <= arena.length
    rest = mapping_of(start + 7 * MIB)
    assert rest is None or rest[0] >= start + 6 * MIB          # the untaken 2 MiB are gone
    assert [int(t.sum()) for t in (a, b, c)] == [3 * MIB - 100, 2 * 3 * MIB, 3 * 4 * MIB]
    del a
    head = mapping_of(start)
    assert head is None or head[1] <= start + 3 * MIB          # a's piece unmapped, b's still there
    assert int(b[-1]) == 2 and mapping_of(start + 3 * MIB) is not None


def test_an_arena_no_load_takes_is_unmapped():
    assert heap.prefault_weights(4 * MIB) is True
    start = _pending().address
    assert mapping_of(start) is not None
    with heap.weight_arena():          # outside a huge_page_allocations scope: not taken
        pass
    assert heap._arena["pending"] is not None
    heap.drop_weight_arena()
    assert heap._arena["pending"] is None
    found = mapping_of(start)
    assert found is None or found[0] > start or found[1] <= start
    heap.drop_weight_arena()           # nothing pending: nothing to do


def test_prefault_is_refused_where_it_cannot_help(monkeypatch):
    assert heap.prefault_weights(0) is False
    assert heap.prefault_weights(1 << 60) is False                 # over half the memory available
    monkeypatch.setenv("SLUICE_HUGE_PAGES", "0")
    assert heap.prefault_weights(4 * MIB) is False
    monkeypatch.delenv("SLUICE_HUGE_PAGES")
    assert heap.prefault_weights(4 * MIB) is True
    try:
        assert heap.prefault_weights(4 * MIB) is False             # one pending at a time
    finally:
        heap.drop_weight_arena()
    assert heap._arena["pending"] is None
