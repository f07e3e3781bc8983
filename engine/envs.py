"""Every environment variable the engine reads, read here and nowhere else."""
from __future__ import annotations

import os


def num_threads() -> int | None:
    """SLUICE_NUM_THREADS: torch intra-op threads on CPU (default: torch's own choice)."""
    v = os.environ.get("SLUICE_NUM_THREADS")
    return int(v) if v else None


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 runs Triton kernels on the CPU (tests only: slow)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fault_injection() -> bool:
    """SLUICE_DEBUG_FAULT_INJECTION=1 lets a request whose prompt contains the marker
    ``<<sluice-fault>>`` raise inside the engine step, so tests can prove that a fault in one
    request leaves the others running. Off by default; never enable it in production."""
    return os.environ.get("SLUICE_DEBUG_FAULT_INJECTION", "0") == "1"


def cpu_packed_weights() -> bool:
    """SLUICE_CPU_PACKED_WEIGHTS=0 keeps float32 CPU weights in torch's dense layout instead of
    oneDNN's packed one (for comparison; packed is faster)."""
    return os.environ.get("SLUICE_CPU_PACKED_WEIGHTS", "1") != "0"


def cpu_cpp_layers() -> bool:
    """SLUICE_CPU_CPP_LAYERS=0 runs float32 CPU steps through the Python layers instead of the
    C++ layer stack (for comparison; the block formats always use the C++ one)."""
    return os.environ.get("SLUICE_CPU_CPP_LAYERS", "1") != "0"


def debug_invariants() -> bool:
    """SLUICE_DEBUG_INVARIANTS=1 makes every engine step check that each request the core
    tracks is running, waiting or already reported, and that the scheduler holds no request the
    core does not know (``EngineCore.check_invariants``). On in the test suite; costs one pass
    over the live requests per step."""
    return os.environ.get("SLUICE_DEBUG_INVARIANTS", "0") == "1"


def huge_pages() -> bool:
    """SLUICE_HUGE_PAGES=0 loads CPU weights onto torch's usual heap (4 KiB pages) instead of
    transparent huge pages (``heap.huge_page_allocations``; for comparison: huge pages are faster)."""
    return os.environ.get("SLUICE_HUGE_PAGES", "1") != "0"
