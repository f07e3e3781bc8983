"""The one interface every proposer implements, and what it returns.

A proposer sees the running requests after a step and proposes up to ``k`` draft tokens for the
next one. It never learns how the scheduler budgets them or how they are verified; the engine
puts them in ``request.spec_token_ids`` and the scheduler trims what does not fit.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from sluice.engine.request import Request
from sluice.engine.sampler import GeneratorCache, SampleRow, SamplingBatch, draw_rows, penalize, processed_probs


@dataclass(frozen=True)
class Draft:
    token_ids: list[int]
    # [len(token_ids), vocab] float32: the distribution each draft token was drawn from, for the
    # rejection sampler. None: a point mass on each token (the n-gram proposer, greedy drafts).
    probs: torch.Tensor | None = None
    # A draft tree's parent per token (spec_decode.tree; greedy drafts only), or None: a chain.
    parents: list[int] | None = None


class Proposer(Protocol):
    name: str

    def propose(self, requests: Sequence[Request], k: int) -> dict[str, Draft]:
        """Drafts for the requests that get some (at most ``k`` tokens each, at least one)."""
        ...

    def observe(self, requests: Sequence[Request], hidden_states: dict) -> None:
        """Called after every step with all running requests, drafting or not, and the target's
        hidden states the runner returned for them (``RunnerOutput.hidden_states``, what the
        factory asked the runner to capture; empty otherwise). EAGLE keeps its own KV cache
        current with them, Medusa drafts from them; the others need nothing."""
        ...

    def drop(self, request_id: str) -> None:
        """Forget per-request state (the request finished or was preempted)."""
        ...


def draft_room(req: Request, k: int) -> int:
    """Drafts worth proposing: the step emits accepted drafts plus one token, so more than the
    tokens still allowed (max_tokens, the context window) would be verified for nothing."""
    return max(0, min(k, req.max_output_tokens - req.num_output_tokens - 1))


def draft_prob(logits: torch.Tensor, token: int, dist: torch.Tensor | None) -> float:
    """The probability the drafter gave its draft ``token``: from the distribution it was drawn
    from, or for a greedy (argmax) draft from the softmax of its logits [V]."""
    if dist is not None:
        return float(dist[token])
    return float(torch.softmax(logits.float(), dim=-1)[token])


def draw(logits: torch.Tensor, rows: list[SampleRow], generators: GeneratorCache, vocab_size: int,
         device) -> tuple[list[int], list[torch.Tensor | None]]:
    """A draft token per logit row [len(rows), V] (``rows``: each row's request and the drafts
    before it), and the [V] distribution it was drawn from. A greedy row's draft is the argmax after
    penalties, bias and the min_tokens mask (None: a point mass); a sampling row's is drawn from
    the request's processed distribution (temperature, top-k/p, min-p) with the proposer's own
    ``generators`` (a seeded request: its own seed), and that distribution goes to the rejection
    sampler, which accepts ``d`` with probability min(1, p(d) / q(d))."""
    sb = SamplingBatch.from_rows(rows, vocab_size, device, generators)
    if sb.all_greedy:
        return penalize(logits, sb).argmax(dim=-1).tolist(), [None] * len(rows)
    q = processed_probs(logits, sb)                                      # [len(rows), V]
    greedy = sb.greedy.tolist()
    # The sampler's own draw: a seeded request from its generator, the others together.
    tokens = torch.where(sb.greedy, q.argmax(dim=-1), draw_rows(q, sb)).tolist()
    return tokens, [None if g else q[i].float().cpu() for i, g in enumerate(greedy)]
