"""The one interface every proposer implements, and what it returns.

A proposer sees the running requests after a step and proposes up to ``k`` draft tokens for the
next one. It never learns how the scheduler budgets them or how they are verified; the engine
puts them in ``request.spec_token_ids`` and the scheduler trims what does not fit.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from typing import TYPE_CHECKING

from sluice.engine.request import Request

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]
    # [len(token_ids), vocab] float32: the distribution each draft token was drawn from, for the
    # rejection sampler. None: a point mass on each token (the n-gram proposer, greedy drafts).
    probs: "torch.Tensor | None" = None


class Proposer(Protocol):
    name: str

    def propose(self, requests: Sequence[Request], k: int) -> dict[str, Draft]:
        """Drafts for the requests that get some (at most ``k`` tokens each, at least one)."""
        ...

    def drop(self, request_id: str) -> None:
        """Forget per-request state (the request finished or was preempted)."""
        ...


def draft_room(req: Request, k: int) -> int:
    """Drafts worth proposing: the step emits accepted drafts plus one token, so more than the
    tokens still allowed (max_tokens, the context window) would be verified for nothing."""
    return max(0, min(k, req.max_output_tokens - req.num_output_tokens - 1))
