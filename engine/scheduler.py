"""Continuous-batching scheduler: each step, how many tokens every request runs. Pure Python.

There is no prefill phase and no decode phase. A request has ``num_tokens`` known tokens (prompt
plus output) and possibly draft tokens; ``num_computed_tokens`` of them have KV in the cache. Each
step it runs ``num_tokens + len(spec_token_ids) - num_computed_tokens`` new tokens, capped by what
is left of the step's token budget. Plain prefill, chunked prefill, prefix-cache hits (which start
``num_computed_tokens`` above zero), decode and speculative verification all follow from that.

CPU-side flow of one engine step
--------------------------------
1. ``schedule()``
   a. Running requests, in order. The KV manager allocates slots for their new tokens. When the
      pool is dry, the latest-arriving running request not yet scheduled this step is preempted
      by recompute (blocks freed, ``num_computed_tokens = 0``, output kept, front of the waiting
      queue) and the allocation is retried.
   b. Waiting requests, FCFS, unless this step preempted: prefix-cache lookup, the same rule,
      while the budget and ``max_num_seqs`` allow. The first that does not fit stops admission.
   c. A ``SchedulerOutput``: per request its new-token count, computed count before the step,
      whole block table and whether its last position is sampled; ids preempted in this step
      and ids finished since the previous one (the runner drops their state).
2. The runner builds the batch tensors (flattened tokens, positions, slot mapping, block tables),
   runs the forward and samples where ``sample`` is set. No tensor is seen here.
3. ``update_from_output()``: ``num_computed_tokens`` advances (minus rejected drafts), sampled
   tokens are appended with a token-stop check after each; finished requests free their blocks.
   Stop strings are found later by the detokenizer, which calls ``finish_requests``.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from sluice.engine.config import SchedulerConfig
from sluice.engine.errors import ContextLengthError, QueueFullError
from sluice.engine.kv_cache.block_manager import KVCacheManager
from sluice.engine.outputs import RunnerOutput
from sluice.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    num_new_tokens: int                # tokens run this step, drafts included
    num_computed_tokens: int           # tokens with KV in the cache before this step
    block_ids: tuple[int, ...]         # the whole block table after this step's allocation
    sample: bool                       # after this step all known tokens are computed
    # Attention sinks (kv_cache.block_manager): text position less cache position of the tokens
    # after the sinks, after this step's allocation; and how many of those this allocation
    # dropped (the runner re-rotates the kept keys after the sinks by minus that before the
    # forward). Both 0 without sinks.
    num_evicted_tokens: int = 0
    num_shifted_tokens: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSeq, ...]
    num_batched_tokens: int
    preempted_ids: tuple[str, ...]
    finished_ids: tuple[str, ...]      # finished or aborted since the previous schedule()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_hit_rate: float
    num_preemptions: int


@dataclass
class _Step:
    """What one schedule() call has decided so far."""
    budget: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    scheduled_ids: set[str] = field(default_factory=set)
    preempted_ids: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, block_size: int,
                 max_model_len: int) -> None:
        if kv.block_size != block_size:
            raise ValueError(f"block_size: {block_size} differs from the KV manager's {kv.block_size}")
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len: must be a positive integer, got {max_model_len!r}")
        self.config = config
        self.kv = kv
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}   # unfinished requests by id
        self._finished_ids: list[str] = []
        self.num_preemptions = 0

    # ---- intake ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._validate_new(request)
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full (max_waiting={self.config.max_waiting})")
        # The scheduler's window bounds the request's, so that check_token_stop ends it in time.
        request.max_model_len = min(request.max_model_len, self.max_model_len)
        self.waiting.append(request)
        self._requests[request.request_id] = request

    def _validate_new(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request_id: {request.request_id!r} is already scheduled")
        if request.status != RequestStatus.WAITING:
            raise ValueError(f"status: a new request must be WAITING, got {request.status.name}")
        n = request.num_tokens
        if n == 0:
            raise ValueError("prompt: must hold at least one token")
        if n >= self.max_model_len:
            raise ContextLengthError(f"prompt: {n} tokens leave no room to generate within "
                                     f"max_model_len {self.max_model_len}")
        # With a sliding window a long prompt holds only its window's blocks and a chunk's.
        chunk = min(n, self.config.max_num_batched_tokens) if self.config.enable_chunked_prefill else n
        need = self.kv.max_blocks_for(n, chunk)
        if need > self.kv.num_total_blocks:
            raise ValueError(f"prompt: {n} tokens need {need} KV blocks of {self.block_size} "
                             f"tokens, the pool has {self.kv.num_total_blocks}")
        step_cap = self.kv.max_step_tokens
        if not self.config.enable_chunked_prefill and step_cap is not None and n > step_cap:
            raise ValueError(f"prompt: {n} tokens exceed the {step_cap} that one step may run with attention "
                             "sinks and chunked prefill is disabled")
        if not self.config.enable_chunked_prefill and n > self.config.max_num_batched_tokens:
            raise ValueError(f"prompt: {n} tokens exceed max_num_batched_tokens "
                             f"{self.config.max_num_batched_tokens} and chunked prefill is disabled")

    @property
    def finished_since_schedule(self) -> tuple[str, ...]:
        """Requests finished since the last ``schedule()`` (its next output reports them)."""
        return tuple(self._finished_ids)

    # ---- schedule --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = _Step(budget=self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted_ids:
            self._schedule_waiting(step)
        finished, self._finished_ids = tuple(self._finished_ids), []
        return SchedulerOutput(
            scheduled=tuple(step.scheduled),
            num_batched_tokens=self.config.max_num_batched_tokens - step.budget,
            preempted_ids=tuple(step.preempted_ids),
            finished_ids=finished,
        )

    def _schedule_running(self, step: _Step) -> None:
        for req in list(self.running):
            if step.budget == 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted or finished earlier in this loop
            num_drafts = min(len(req.spec_token_ids), self.config.num_speculative_tokens)
            num_new = min(req.num_tokens + num_drafts - req.num_computed_tokens,
                          step.budget, self.max_model_len - req.num_computed_tokens)
            if num_new <= 0:
                continue
            num_new = self._step_cap(num_new)
            evicted = self.kv.num_evicted_tokens(req.request_id)
            num_new = self._allocate_running(req, num_new, step)
            if num_new:
                self._record(step, req, num_new, evicted)

    def _allocate_running(self, req: Request, num_new: int, step: _Step) -> int:
        """Allocates, preempting later arrivals as needed. Returns the tokens that ``req`` runs:
        ``num_new``, fewer when its drafts had to go, 0 when it does not run this step."""
        lookahead = self._lookahead(req, num_new)
        num_known = req.num_tokens - req.num_computed_tokens
        while self.kv.allocate_slots(req, num_new, num_lookahead_tokens=lookahead) is None:
            candidates = [r for r in self.running if r.request_id not in step.scheduled_ids]
            # Latest arrival first; on a tie the one later in the running list.
            victim = max(reversed(candidates), key=lambda r: r.arrival_time)
            if victim is not req:
                self._preempt(victim, step)
            elif len(candidates) > 1:
                self._preempt(req, step)      # it is the latest: give way to older ones
                return 0
            elif lookahead or num_new > num_known:
                # Alone: first give up the draft slots, then the drafts themselves.
                lookahead, num_new = 0, (num_new if lookahead else num_known)
            elif not step.scheduled:
                # It holds every block anyone holds and still does not fit: it never will.
                self._finish(req, RequestStatus.FINISHED_LENGTH)
                return 0
            else:
                return 0                      # waits for the requests scheduled before it
        return num_new

    def _schedule_waiting(self, step: _Step) -> None:
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            if not self._admit(self.waiting[0], step):
                break  # FCFS: the head blocks the ones behind it

    def _admit(self, req: Request, step: _Step) -> bool:
        hit_ids, num_hit = self.kv.get_computed_blocks(req)
        num_drafts = min(len(req.spec_token_ids), self.config.num_speculative_tokens)
        num_new = req.num_tokens + num_drafts - num_hit
        # A resumed request may have grown past any step's budget; then it must be chunked.
        may_chunk = self.config.enable_chunked_prefill or num_new > self.config.max_num_batched_tokens
        if num_new > step.budget and not may_chunk:
            return False
        num_new = self._step_cap(min(num_new, step.budget, self.max_model_len - num_hit))
        lookahead = self._lookahead(req, num_new, num_hit)
        if self.kv.allocate_slots(req, num_new, hit_ids, num_hit, lookahead) is None:
            return False
        self.waiting.popleft()
        req.num_computed_tokens = num_hit
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
            req.num_cached_tokens = num_hit
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._record(step, req, num_new)
        return True

    def _step_cap(self, num_new: int) -> int:
        """With attention sinks a request runs at most ``kv.max_step_tokens`` a step (the KV
        manager drops only full blocks after the sinks to make room for them)."""
        cap = self.kv.max_step_tokens
        return num_new if cap is None else min(num_new, cap)

    def _lookahead(self, req: Request, num_new: int, num_computed: int | None = None) -> int:
        """Slots reserved past this step for the drafts proposed after it, when it samples."""
        done = (req.num_computed_tokens if num_computed is None else num_computed) + num_new
        return self.config.num_speculative_tokens if done >= req.num_tokens else 0

    def _record(self, step: _Step, req: Request, num_new: int, evicted_before: int = 0) -> None:
        before = req.num_computed_tokens
        evicted = self.kv.num_evicted_tokens(req.request_id)
        # Drafts cut off by the budget or the config bound are dropped, so the runner reads
        # exactly the drafts that run.
        del req.spec_token_ids[max(0, before + num_new - req.num_tokens):]
        step.scheduled.append(ScheduledSeq(
            request=req, num_new_tokens=num_new, num_computed_tokens=before,
            block_ids=tuple(self.kv.get_block_ids(req.request_id)),
            sample=before + num_new >= req.num_tokens,
            num_evicted_tokens=evicted, num_shifted_tokens=evicted - evicted_before))
        step.scheduled_ids.add(req.request_id)
        step.budget -= num_new

    def _preempt(self, req: Request, step: _Step) -> None:
        self.kv.free(req)
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids.clear()
        req.spec_parents = None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        step.preempted_ids.append(req.request_id)

    # ---- results ---------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, res: RunnerOutput) -> list[Request]:
        """Applies one step's results; returns the requests that got tokens or finished."""
        # Requests finished (aborted) while the step ran already freed their blocks: skip them.
        live = [seq for seq in out.scheduled if seq.request.status == RequestStatus.RUNNING]
        for seq in live:  # check everything first, so a bad result changes nothing
            self._check_result(seq, res)
        changed = []
        for seq in live:
            req = seq.request
            rejected = res.num_rejected_tokens.get(req.request_id, 0)
            req.num_computed_tokens = seq.num_computed_tokens + seq.num_new_tokens - rejected
            # Drafts are consumed by the step that verified them; the proposer sets new ones.
            req.spec_token_ids.clear()
            req.spec_parents = None
            tokens = res.sampled_token_ids.get(req.request_id, ())
            for used, token_id in enumerate(tokens, 1):
                req.append_output_token(token_id)
                status = req.check_token_stop()
                if status is not None:
                    self._finish(req, status)
                    _cut_result(res, req.request_id, used)
                    break
            if tokens:
                changed.append(req)
        return changed

    @staticmethod
    def _check_result(seq: ScheduledSeq, res: RunnerOutput) -> None:
        req = seq.request
        tokens = res.sampled_token_ids.get(req.request_id, ())
        if bool(tokens) != seq.sample:
            raise ValueError(f"sampled_token_ids: request {req.request_id!r} has {len(tokens)} "
                             f"tokens but sample={seq.sample} this step")
        num_drafts = max(0, seq.num_computed_tokens + seq.num_new_tokens - req.num_tokens)
        rejected = res.num_rejected_tokens.get(req.request_id, 0)
        if not 0 <= rejected <= num_drafts:
            raise ValueError(f"num_rejected_tokens: {rejected} for request {req.request_id!r}, "
                             f"which ran {num_drafts} draft tokens")
        if len(tokens) > num_drafts - rejected + 1:
            raise ValueError(f"sampled_token_ids: {len(tokens)} tokens for request "
                             f"{req.request_id!r}, at most {num_drafts - rejected + 1} accepted")

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Stop strings, aborts and errors, for waiting or running requests. Unknown and already
        finished ids are ignored. Returns the requests finished by this call."""
        status = RequestStatus(status)
        if not status.is_finished:
            raise ValueError(f"status: must be a finished status, got {status.name}")
        ids = (request_ids,) if isinstance(request_ids, str) else request_ids
        done = []
        for rid in ids:
            req = self._requests.get(rid)
            if req is not None and not req.is_finished:
                self._finish(req, status)
                done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        req.finished_time = time.monotonic()
        self.kv.free(req)
        del self._requests[req.request_id]
        self._finished_ids.append(req.request_id)

    # ---- queries ---------------------------------------------------------------------------
    def get_request(self, request_id: str) -> Request | None:
        """An unfinished request by id, or None."""
        return self._requests.get(request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_blocks_used=self.kv.num_total_blocks - self.kv.num_free_blocks,
            kv_blocks_total=self.kv.num_total_blocks,
            prefix_cache_hit_rate=self.kv.prefix_cache_hit_rate,
            num_preemptions=self.num_preemptions)


def _cut_result(res: RunnerOutput, request_id: str, used: int) -> None:
    """A stop token or the length limit inside a run of accepted drafts: the result keeps only
    the tokens appended, so that what the engine outputs ends exactly there."""
    for table in (res.sampled_token_ids, res.logprobs):
        if request_id in table and len(table[request_id]) > used:
            table[request_id] = table[request_id][:used]
