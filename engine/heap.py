"""Handing freed heap memory back to the OS.

glibc keeps freed chunks in its arenas, where they stay resident: the float32 staging of a
quantized load (~80 MiB for the default model in w4a8), or the activations of the largest step
served so far (~20 MiB after a 256-token prefill). ``malloc_trim`` returns the free pages; it
takes about a millisecond. On a C library without it (musl, macOS) this does nothing."""
from __future__ import annotations

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
