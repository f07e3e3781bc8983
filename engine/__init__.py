"""sluice's engine: everything behind the gRPC port.

``from sluice.engine import LLM, SamplingParams`` is the offline API; importing it loads torch lazily
so that light users (the gRPC client, the HTTP facade) pay nothing for it.
"""
from __future__ import annotations

from sluice.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from sluice.engine.llm import LLM
        return LLM
    raise AttributeError(name)
