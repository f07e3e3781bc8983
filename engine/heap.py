"""Handing freed heap memory back to the OS, and putting weights on huge pages.

glibc keeps freed chunks in its arenas, where they stay resident: the float32 staging of a
quantized load (~80 MiB for the default model in w4a8), or the activations of the largest step
served so far (~20 MiB after a 256-token prefill). ``malloc_trim`` returns the free pages; it
takes about a millisecond. On a C library without it (musl, macOS) this does nothing."""
from __future__ import annotations

import contextlib
import ctypes
import gc


def _load_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _load_trim()


def release_freed_heap(collect: bool = False) -> bool:
    """Return freed heap pages to the OS (after a garbage collection if ``collect``); False
    where the C library cannot."""
    if collect:
        gc.collect()
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


# Allocations under this size stay on the heap: a huge page is 2 MiB.
_HUGE_PAGE_MIN_BYTES = 2 << 20
_huge = {"depth": 0, "on": False}   # the open scopes, and whether the outermost took effect


@contextlib.contextmanager
def huge_page_allocations(min_bytes: int | None = None):
    """While inside, torch's CPU allocations of ``min_bytes`` (default 2 MiB) or more are anonymous
    mappings advised for transparent huge pages (``kernels/cpu_pages.cpp`` says why: one-row
    products read their weights from memory faster), so a model built inside has its weights on
    huge pages. Yields whether that is in effect: not where the C++ kernels are missing or with
    ``SLUICE_HUGE_PAGES=0``. A scope inside another changes nothing. Not for steps: a mapping per
    activation would fault its pages in again on every step."""
    from sluice.engine import envs
    from sluice.kernels import cpu_ext

    if not envs.huge_pages() or not cpu_ext.available():
        yield False
        return
    ops = cpu_ext.module()
    if _huge["depth"] == 0:
        _huge["on"] = ops.set_huge_page_allocations(_HUGE_PAGE_MIN_BYTES if min_bytes is None else min_bytes)
    _huge["depth"] += 1
    try:
        yield _huge["on"]
    finally:
        _huge["depth"] -= 1
        if _huge["depth"] == 0:
            ops.set_huge_page_allocations(0)
