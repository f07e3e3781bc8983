"""Freed heap goes back to the OS after a load and whenever the engine goes idle (engine/heap.py)."""
from __future__ import annotations

import re

import torch

from sluice.engine import engine_core, heap
from sluice.engine.llm import LLM
from sluice.engine.sampling_params import SamplingParams


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def test_freed_heap_pages_leave_the_resident_set():
    assert heap.release_freed_heap() is True            # glibc here: malloc_trim exists
    # Many small blocks (below the mmap threshold, so on the heap), freed but for the last, which
    # keeps the heap's top in use: free() itself then returns nothing, and they stay resident.
    blocks = [torch.empty(16 << 10, dtype=torch.uint8).fill_(1) for _ in range(4096)]   # 64 MiB
    del blocks[:-1]
    before = _rss_mib()
    heap.release_freed_heap()
    assert before - _rss_mib() > 32, "malloc_trim gave back less than half of the 64 MiB freed"


def test_the_engine_releases_freed_heap_when_it_goes_idle(tiny_smollm2, monkeypatch):
    calls = []
    llm = LLM(str(tiny_smollm2), quantization="none", kv_cache_memory_bytes=4 << 20)
    monkeypatch.setattr(engine_core, "release_freed_heap", lambda: calls.append(llm.engine.has_unfinished_requests()))
    llm.generate(["one two three", "four"], SamplingParams(max_tokens=5, ignore_eos=True))
    assert calls == [False]                             # once, after the last step, not per step
    llm.generate(["again"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert calls == [False, False]
