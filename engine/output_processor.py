"""Tokens out: detokenize, stop strings, grammar acceptance, ``n > 1`` regrouping, per-step deltas.

A client request with ``n > 1`` is ``n`` scheduler requests ("choices"); the processor keeps
them as one group and sends one ``RequestOutput`` per client request and step, holding the deltas
of the choices that moved. It runs on the step thread, after the scheduler's update: a stop string
must end its request before the next schedule, or the step after it would compute tokens that no
one receives (and a grammar matcher would be asked to accept them). Whatever it ends, it ends
through ``finish`` (the scheduler's ``finish_requests``), so the KV blocks go back at once.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.outputs import CompletionDelta, RequestMetrics, RequestOutput, RunnerOutput, Usage, shown_logprobs
from sluice.engine.request import Request, RequestStatus
from sluice.engine.spec_decode.stops import add_tokens_until_stop

log = logging.getLogger("sluice.engine")

Finish = Callable[[list[str], RequestStatus], None]


@dataclass
class Choice:
    request: Request
    detok: IncrementalDetokenizer
    delta: CompletionDelta | None = None   # what accumulated since the last step's output
    reported: bool = False                 # its final delta went out


@dataclass
class Group:
    request_id: str
    prompt_token_ids: list[int]
    fault: bool                            # SLUICE_DEBUG_FAULT_INJECTION: fail it at its first token
    choices: list[Choice] = field(default_factory=list)


def _never(_token_id: int) -> bool:
    return False


class OutputProcessor:
    def __init__(self, tokenizer, structured, finish: Finish) -> None:
        self.tokenizer = tokenizer
        self.structured = structured
        self._finish = finish
        self.groups: dict[str, Group] = {}
        self.choice_of: dict[str, tuple[Group, Choice]] = {}   # scheduler request id -> its choice
        self.dirty: dict[str, None] = {}                       # client ids with news, in order

    # ---- tracking -----------------------------------------------------------------------
    def track(self, request_id: str, prompt_token_ids: list[int], requests: Sequence[Request],
              fault: bool = False) -> None:
        """Start following a client request's choices (already queued in the scheduler)."""
        group = Group(request_id, prompt_token_ids, fault)
        for req in requests:
            params = req.sampling_params
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, stop=params.stop,
                                           include_stop_str_in_output=params.include_stop_str_in_output,
                                           skip_special_tokens=params.skip_special_tokens)
            group.choices.append(Choice(req, detok))
        self.groups[request_id] = group
        for c in group.choices:
            self.choice_of[c.request.request_id] = (group, c)

    def is_active(self, request_id: str) -> bool:
        return request_id in self.groups

    def live_choices(self, request_id: str) -> list[str]:
        """The scheduler ids of a client request's unfinished choices ([] when unknown)."""
        group = self.groups.get(request_id)
        return [] if group is None else [c.request.request_id for c in group.choices if not c.request.is_finished]

    def mark_dirty(self, scheduler_ids: Iterable[str]) -> None:
        for rid in scheduler_ids:
            entry = self.choice_of.get(rid)
            if entry is not None:
                self.dirty[entry[0].request_id] = None

    def mark_client_dirty(self, request_id: str) -> None:
        self.dirty[request_id] = None

    # ---- one step's tokens ----------------------------------------------------------------
    def process(self, req: Request, res: RunnerOutput) -> None:
        """The tokens the update appended to ``req`` this step: through the detokenizer (a stop
        string may cut a run of accepted drafts), the grammar, the logprobs shown, into its delta."""
        entry = self.choice_of.get(req.request_id)
        if entry is None:
            return
        group, choice = entry
        try:
            if group.fault:
                raise RuntimeError("injected fault (SLUICE_DEBUG_FAULT_INJECTION)")
            new = res.sampled_token_ids.get(req.request_id, [])
            r, used = add_tokens_until_stop(choice.detok, new)
            if used < len(new):   # a stop string ended inside a run of accepted drafts: cut there
                del req.output_token_ids[used - len(new):]
                new = new[:used]
            if not self.structured.accept(req.request_id, new):
                raise RuntimeError(f"grammar: the sampled tokens {new} do not follow the request's grammar")
            d = choice.delta or CompletionDelta(index=choice.request.index)
            d.token_ids.extend(new)
            lps = res.logprobs.get(req.request_id)
            if lps:
                hidden = self.tokenizer.is_special if req.sampling_params.skip_special_tokens else _never
                d.logprobs = (d.logprobs or []) + shown_logprobs(lps[:len(new)], hidden)
            d.text += r.delta_text
            choice.delta = d
            if r.stop_string is not None:
                req.stop_reason = r.stop_string
                if req.is_finished:   # max_tokens hit on the same token: the stop string wins
                    req.status = RequestStatus.FINISHED_STOPPED
                else:
                    self._finish([req.request_id], RequestStatus.FINISHED_STOPPED)
        except Exception as exc:
            log.exception("request %s failed", req.request_id)
            self.fail([req], f"{type(exc).__name__}: {exc}")
        self.dirty[group.request_id] = None

    def fail(self, requests: list[Request], message: str) -> None:
        self._finish([r.request_id for r in requests], RequestStatus.FINISHED_ERROR)
        for r in requests:
            r.error = message
        self.mark_dirty(r.request_id for r in requests)

    # ---- emit -------------------------------------------------------------------------------
    def collect(self) -> list[RequestOutput]:
        """One output per client request with news since the last call; a request whose choices
        have all reported leaves the processor (and its grammar matchers go)."""
        outputs = []
        for rid in self.dirty:
            group = self.groups.get(rid)
            if group is None:
                continue
            deltas = []
            for c in group.choices:
                if c.reported:
                    continue
                d = c.delta
                if c.request.is_finished:
                    d = d or CompletionDelta(index=c.request.index)
                    _flush(c, d)
                    _finalize(c.request, d)
                    c.reported = True
                if d is not None:
                    deltas.append(d)
                c.delta = None
            done = all(c.reported for c in group.choices)
            if deltas or done:
                outputs.append(RequestOutput(rid, deltas, finished=done, prompt_token_ids=group.prompt_token_ids))
            if done:
                del self.groups[rid]
                for c in group.choices:
                    self.choice_of.pop(c.request.request_id, None)
                    self.structured.drop(c.request.request_id)
        self.dirty.clear()
        return outputs

    def check_invariants(self, scheduler) -> None:
        """Every choice followed here is waiting or running in the scheduler, or has reported its
        final delta; the scheduler and the grammar manager hold no request unknown here. Raises
        AssertionError naming the request: a choice finished but unreported would hang its
        stream for ever (nothing would report it)."""
        running = {r.request_id for r in scheduler.running}
        waiting = {r.request_id for r in scheduler.waiting}
        for rid, (group, c) in self.choice_of.items():
            if c.reported:
                continue
            where = running if c.request.status == RequestStatus.RUNNING else waiting
            if c.request.is_finished or rid not in where or scheduler.get_request(rid) is not c.request:
                raise AssertionError(
                    f"request {group.request_id!r} choice {c.request.index}: {c.request.status.name}, "
                    "tracked by the core but neither scheduled, waiting nor reported")
        stray = self.structured.request_ids() - self.choice_of.keys()
        if stray:
            raise AssertionError(f"grammar matchers of requests unknown to the core: {sorted(stray)[:8]}")
        orphans = (running | waiting) - self.choice_of.keys()
        if orphans:
            raise AssertionError(f"scheduler requests unknown to the core: {sorted(orphans)[:8]}")
        if len(running) != len(scheduler.running) or len(waiting) != len(scheduler.waiting):
            raise AssertionError("a request is queued twice in the scheduler")


def _flush(c: Choice, d: CompletionDelta) -> None:
    """The text the detokenizer held back, for a choice that ended normally (by a token,
    max_tokens, the context window or the end of the KV pool). Idempotent."""
    req = c.request
    if req.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
        return
    try:
        d.text += c.detok.finish()
    except Exception as exc:  # noqa: BLE001 - this choice fails, the step goes on
        log.exception("request %s failed", req.request_id)
        req.status, req.error = RequestStatus.FINISHED_ERROR, f"{type(exc).__name__}: {exc}"
        return
    if c.detok.stop_string is not None:   # completed by the flushed bytes
        req.stop_reason = c.detok.stop_string
        req.status = RequestStatus.FINISHED_STOPPED


def _finalize(req: Request, d: CompletionDelta) -> None:
    """The final delta's finish reason, usage and timings."""
    now = time.monotonic()
    if req.finished_time is None:
        req.finished_time = now
    d.finish_reason = req.status.finish_reason
    d.stop_reason = req.stop_reason
    d.error = req.error
    d.usage = Usage(req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens,
                    req.num_draft_tokens, req.num_accepted_tokens)
    t0 = req.arrival_time
    d.metrics = RequestMetrics(
        arrival_time=t0,
        queued_s=None if req.first_scheduled_time is None else req.first_scheduled_time - t0,
        ttft_s=None if req.first_token_time is None else req.first_token_time - t0,
        total_s=req.finished_time - t0,
    )
