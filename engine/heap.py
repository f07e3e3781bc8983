"""Handing freed heap memory back to the OS, and putting weights on huge pages (faulted in ahead
of the load where the command knows the file early: ``prefault_weights``).

glibc keeps freed chunks in its arenas, where they stay resident: the float32 staging of a
quantized load (~80 MiB for the default model in w4a8), or the activations of the largest step
served so far (~20 MiB after a 256-token prefill). ``malloc_trim`` returns the free pages; it
takes about a millisecond. On a C library without it (musl, macOS) this does nothing."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import mmap
import os
import sys
import threading


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
_HUGE_PAGE = 2 << 20                 # the size the arena is aligned and faulted in by
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


# The weight arena (kernels/cpu_pages.cpp says why). Linux only.
_arena: dict = {"pending": None}     # the _Arena mapped ahead of the next load, until a load takes it or drops it


class _Arena:
    """An anonymous mapping, 2 MiB-aligned and advised for huge pages, that a thread faults in front
    to back by writing a zero byte at each 2 MiB (a huge page's zeroing, or a 4 KiB page's where the
    kernel has no huge page to give). ``ctypes.memset`` releases the GIL, so the thread runs beside
    the imports, under ``SCHED_IDLE``: on a core nothing else wants. (At the usual priority it took
    CPU from the engine's and the facade's imports, and a start whose file had to be read from disk,
    where the load's faults overlap the reads anyway, was 0.4 s slower. ``madvise(MADV_POPULATE_WRITE)``
    would fault in the same pages, but it holds the process's memory-map lock for its whole range:
    every ``mmap`` of the imports waited on it, and they took up to twice as long.)"""

    def __init__(self, libc, address: int, length: int) -> None:
        self.libc, self.address, self.length = libc, address, length
        self.touched = 0                 # bytes faulted in so far, from the start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fault_in, name="sluice-prefault", daemon=True)
        self._thread.start()

    def _fault_in(self) -> None:
        try:   # only on a core nothing else wants: the imports (and the facade's, beside them) go first
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            pass
        for start in range(0, self.length, _HUGE_PAGE):
            if self._stop.is_set():
                return
            ctypes.memset(self.address + start, 0, 1)
            self.touched = start + _HUGE_PAGE

    def stop(self) -> None:
        """Stop faulting in (after the page under way): before the arena's memory is handed out,
        since the thread's writes would land in the weights."""
        self._stop.set()
        self._thread.join()


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mmap_fn, munmap_fn, madvise_fn = libc.mmap, libc.munmap, libc.madvise
    except (OSError, AttributeError):
        return None
    mmap_fn.restype = ctypes.c_void_p
    mmap_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    munmap_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    madvise_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def prefault_weights(nbytes: int) -> bool:
    """Map ``nbytes`` (rounded up to 2 MiB) for the next load's weights and start faulting them in,
    in a thread, so the zeroing of their pages happens now, beside the process's imports, and not
    while the load writes them. Call it early, before ``import torch``; the next load on huge pages
    takes its packed weights from this memory (``weight_arena``), and any load's end unmaps what it
    did not take (``drop_weight_arena``). False (and nothing mapped) off Linux, with
    ``SLUICE_HUGE_PAGES=0``, when an arena is already pending, or when ``nbytes`` is over half the
    memory available."""
    from sluice.engine import envs

    if nbytes <= 0 or not envs.huge_pages() or _arena["pending"] is not None:
        return False
    available = _available_bytes()
    if available is None or nbytes > available // 2:
        return False
    libc = _libc()
    if libc is None:
        return False
    length = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
    reserve = length + _HUGE_PAGE
    raw = libc.mmap(None, reserve, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if raw is None or raw == ctypes.c_void_p(-1).value:
        return False
    start = -(-raw // _HUGE_PAGE) * _HUGE_PAGE    # trim to a 2 MiB boundary
    if start > raw:
        libc.munmap(raw, start - raw)
    if raw + reserve > start + length:
        libc.munmap(start + length, raw + reserve - start - length)
    libc.madvise(start, length, getattr(mmap, "MADV_HUGEPAGE", 14))      # advice: refused or ignored, the pages are ordinary ones
    _arena["pending"] = _Arena(libc, start, length)
    return True


def drop_weight_arena() -> None:
    """Unmap a prefaulted arena no load took (a load on another device, or that failed early)."""
    pending, _arena["pending"] = _arena["pending"], None
    if pending is not None:
        pending.stop()
        pending.libc.munmap(pending.address, pending.length)


@contextlib.contextmanager
def weight_arena():
    """Inside a ``huge_page_allocations`` scope that took effect: large allocations come from the
    arena ``prefault_weights`` mapped, in order, until it runs out (then mappings of their own, as
    without it). For the packed weights only (a model's uninitialised float parameters would take
    the arena without touching it). The faulting in stops when the scope opens (the load's own
    writes fault in the rest), and the arena's untaken rest is unmapped when it closes. Without a
    pending arena, or outside such a scope, this does nothing."""
    pending = _arena["pending"]
    if pending is None or not _huge["on"] or _huge["depth"] == 0:
        yield
        return
    from sluice.kernels import cpu_ext

    ops = cpu_ext.module()
    _arena["pending"] = None
    pending.stop()   # what it has not faulted in yet, the load's writes fault in
    ops.set_huge_page_arena(pending.address, pending.length)    # the library owns the mapping from here
    try:
        yield
    finally:
        taken = ops.close_huge_page_arena()
        logging.getLogger("sluice.heap").info(
            "weights: %d MiB taken from a %d MiB arena, %d MiB of it faulted in ahead of the load",
            taken >> 20, pending.length >> 20, pending.touched >> 20)
