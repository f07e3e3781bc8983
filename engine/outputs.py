"""Plain dataclasses that leave the engine core: what the runner returns to the scheduler, and
the per-request deltas that the offline API and the gRPC servicer stream to callers."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # (token id, logprob) of the top-k alternatives, best first


def shown_logprobs(lps: list[TokenLogprob], hidden) -> list[TokenLogprob]:
    """The logprobs a caller sees: those of the tokens whose text is in the output (``hidden(id)``:
    a special token that ``skip_special_tokens`` leaves out, such as the EOS that ended it, has
    none, so the tokens join to the text), and, among each token's alternatives, only those the
    constraints allowed (a masked token's logprob is -inf: it was never a choice)."""
    out = []
    for lp in lps:
        if hidden(lp.token_id):
            continue
        if any(v == float("-inf") for _, v in lp.top):
            lp = TokenLogprob(lp.token_id, lp.logprob, tuple((t, v) for t, v in lp.top if v != float("-inf")))
        out.append(lp)
    return out


@dataclass
class RunnerOutput:
    # request id -> tokens appended this step: one normally, several with speculative decoding.
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # request id -> draft tokens whose KV was written this step but which were rejected; the
    # scheduler rolls num_computed_tokens back by this much.
    num_rejected_tokens: dict[str, int] = field(default_factory=dict)
    # request id -> the target's hidden states a proposer's heads read (a position and its
    # tensor, spec_decode.runner_hooks.CAPTURE_MODES); empty unless speculation asks for them.
    hidden_states: dict[str, tuple] = field(default_factory=dict)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    draft_tokens: int = 0                  # speculative decoding: drafts verified ...
    accepted_tokens: int = 0               # ... and accepted (both 0 without it)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    queued_s: float | None = None          # arrival -> first scheduled
    ttft_s: float | None = None            # arrival -> first token
    total_s: float | None = None           # arrival -> finished


@dataclass
class CompletionDelta:
    """What one choice gained in one step. Concatenated ``text`` equals the final text."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None       # stop | length | abort | error, on the last delta only
    stop_reason: str | int | None = None   # the matched stop string or stop token id
    usage: Usage | None = None             # this choice's usage, on the last delta only
    metrics: RequestMetrics | None = None  # on the last delta only
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The deltas of one client request (all its choices) produced by one engine step."""
    request_id: str
    deltas: list[CompletionDelta]
    finished: bool                         # every choice has finished
    prompt_token_ids: list[int] | None = None


@dataclass
class CompletionOutput:
    """A finished choice, as the offline API returns it."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None               # why, when finish_reason is "error"


@dataclass
class GenerationResult:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    usage: Usage
    metrics: RequestMetrics | None = None
