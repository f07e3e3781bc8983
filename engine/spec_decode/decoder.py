"""What the engine core holds for speculative decoding: the proposer, the K it asks for, the
batch-size cut-off, and the counters.

After each step, ``propose`` gives drafts to the running requests that decode next (all known
tokens but the last computed); the scheduler budgets them, the runner verifies them through the
decoder's ``hooks`` (``runner_hooks``: the draft distributions go there, the target's hidden
states come back in the runner's output and go to the proposer), and ``record`` counts what was
accepted. The scheduler never learns which proposer runs.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sluice.engine.request import Request, RequestStatus
from sluice.engine.spec_decode.config import SpeculativeConfig
from sluice.engine.spec_decode.proposer import Proposer
from sluice.engine.spec_decode.runner_hooks import SpecRunnerHooks


@dataclass
class SpecStats:
    num_drafts: int = 0                # request-steps that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)   # [K]: drafts accepted at j

    def record(self, k: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per drafted request-step: accepted drafts plus the added token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, hooks: SpecRunnerHooks) -> None:
        self.config = config
        self.proposer = proposer
        self.k = config.spec_draft_length
        self.max_drafts = config.num_speculative_tokens   # a tree's nodes: up to K * width
        self.stats = SpecStats(accepted_per_position=[0] * self.k)
        self.hooks = hooks            # the target runner's (build_spec_decoder): draft distributions go there
        # The hidden states of the last step the runner ran (RunnerOutput.hidden_states).
        self._hidden_states: dict = {}

    def after_step(self, out, res, running: Sequence[Request], finished: Iterable[str]) -> None:
        """The engine's call after a step's update: forget the requests that finished (also those
        that finished after ``out`` was scheduled), then drafts for the next step from the hidden
        states of ``res`` (None: the step failed). A step the runner did not run (nothing
        scheduled, nothing finished) leaves the previous step's hidden states in place."""
        self.drop((*out.finished_ids, *finished))
        if out.scheduled or out.finished_ids:
            self._hidden_states = {} if res is None else res.hidden_states
        self.propose(running, self._hidden_states)

    def propose(self, running: Sequence[Request], hidden_states: dict) -> None:
        """Drafts for the next step. Above ``spec_max_batch_size`` running requests, none: there
        verification costs more compute than the accepted tokens save. The proposer observes
        every step either way (EAGLE's cache follows each request's tokens)."""
        self.proposer.observe(running, hidden_states)
        if len(running) > self.config.spec_max_batch_size:
            return
        ready = [r for r in running if r.status == RequestStatus.RUNNING
                 and r.num_tokens - r.num_computed_tokens == 1]
        if not ready:
            return
        by_id = {r.request_id: r for r in ready}
        for rid, draft in self.proposer.propose(ready, self.k).items():
            req = by_id[rid]
            req.spec_token_ids = list(draft.token_ids[:self.max_drafts])
            req.spec_parents = None if draft.parents is None else list(draft.parents[:self.max_drafts])
            self.hooks.expect(rid, draft.probs)

    def record(self, out, res) -> None:
        """Count what the step verified, per request (its usage) and in total (metrics). Called
        before the scheduler's update, which consumes the drafts this reads off ``out``."""
        rejected = res.num_rejected_tokens
        for s in out.scheduled:
            k = s.num_computed_tokens + s.num_new_tokens - s.request.num_tokens   # drafts it ran
            if not s.sample or k <= 0 or s.request.request_id not in rejected:
                continue   # no drafts, or aborted while the step ran: nothing was verified for it
            accepted = k - rejected[s.request.request_id]
            s.request.num_draft_tokens += k
            s.request.num_accepted_tokens += accepted
            self.stats.record(k, accepted)

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.proposer.drop(rid)
