"""The one request state that the scheduler, the runner and the output processor share.

A ``Request`` is one sequence. ``n > 1`` fans out into ``n`` requests that share a
``parent_id``; their prompts share KV blocks through the prefix cache.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from sluice.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 10   # EOS, a stop token or a stop string
    FINISHED_LENGTH = 11    # max_tokens or the context window
    FINISHED_ABORTED = 12   # the client cancelled
    FINISHED_ERROR = 13     # a fault inside this request

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    arrival_time: float = field(default_factory=time.monotonic)
    parent_id: str | None = None
    index: int = 0                         # choice index within the parent (n > 1)
    seed: int | None = None                # per-choice seed derived from sampling_params.seed

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache. Prefill, chunked prefill, prefix hits and speculative
    # tokens are all this counter catching up with ``num_tokens``.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0             # prompt tokens served by the prefix cache
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens proposed for this step
    # A draft tree's parent of each spec token (an earlier index, -1: the last known token), or
    # None: the drafts are a chain. Every prefix of the list is a tree, so trimming keeps one.
    spec_parents: list[int] | None = None
    num_draft_tokens: int = 0              # drafts verified for this request, over its life
    num_accepted_tokens: int = 0           # ... and accepted
    num_preemptions: int = 0
    stop_reason: str | int | None = None   # the matched stop string or stop token id
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def max_output_tokens(self) -> int:
        """Output tokens allowed by max_tokens and by the context window, whichever is less."""
        room = self.max_model_len - self.num_prompt_tokens
        mt = self.sampling_params.max_tokens
        return room if mt is None else min(mt, room)

    def append_output_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)

    def check_token_stop(self) -> RequestStatus | None:
        """Token-level stop rules after the last appended token; stop strings are checked by the
        detokenizer, which sees text."""
        sp = self.sampling_params
        n_out = self.num_output_tokens
        if n_out == 0:
            return None
        last = self.output_token_ids[-1]
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in sp.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
