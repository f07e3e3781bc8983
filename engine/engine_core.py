"""The engine core: requests in, per-step deltas out. Not thread-safe; one thread drives it.

One step reads like the table of contents of the engine::

    out = scheduler.schedule()               # which requests run how many tokens, with which blocks
    res = runner.execute(out)                # forward + sample (or verify drafts)
    scheduler.update_from_output(out, res)   # advance counters, append tokens, token-level stops
    outputs.collect()                        # detokenize, stop strings, n-regrouping, deltas

The parts live elsewhere: construction in ``core_builder``, requests in (render, tokenize,
validate) in ``input_processor``, tokens out in ``output_processor``, drafting behind
``spec_decode.SpecDecoder``'s two calls. What stays here is the order in which they run and what
happens when a step fails.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

from sluice.engine import envs
from sluice.engine.config import EngineConfig
from sluice.engine.core_builder import ModelInfo, build_core
from sluice.engine.errors import QueueFullError
from sluice.engine.heap import release_freed_heap
from sluice.engine.input_processor import InfillPrompt, InputProcessor
from sluice.engine.loaders import LoadedModel
from sluice.engine.output_processor import OutputProcessor
from sluice.engine.outputs import RequestOutput, RunnerOutput
from sluice.engine.request import Request, RequestStatus
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import SchedulerOutput

__all__ = ["EngineCore", "LoadStats", "ModelInfo", "FAULT_MARKER"]

log = logging.getLogger("sluice.engine")

FAULT_MARKER = "<<sluice-fault>>"


@dataclass(frozen=True)
class LoadStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_hit_rate: float
    # Speculative decoding since start-up (all 0 when it is off).
    spec_num_drafts: int = 0                        # request-steps that carried drafts
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()   # [K]: drafts accepted at position j


class EngineCore:
    def __init__(self, config: EngineConfig, progress: bool = False, loaded: LoadedModel | None = None,
                 draft_loaded: LoadedModel | None = None, heads=None) -> None:
        self.config = config
        parts = build_core(config, progress, loaded, draft_loaded, heads)
        self.loaded, self.draft, self.heads, self.tp = parts.loaded, parts.draft, parts.heads, parts.tp
        self.kv, self.scheduler, self.runner, self.spec = parts.kv, parts.scheduler, parts.runner, parts.spec
        self.structured, self.model_info = parts.structured, parts.model_info
        self.max_model_len, self.kv_dtype = parts.max_model_len, parts.kv_dtype
        self.tokenizer = self.loaded.tokenizer
        self.inputs = InputProcessor(self.tokenizer, config.limits, self.structured, model_name=self.model_info.name,
                                     vocab_size=self.model_info.vocab_size, max_model_len=self.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer, self.structured, self.scheduler.finish_requests)
        self._check_each_step = envs.debug_invariants()

    def close(self) -> None:
        """Release what outlives the step loop: the grammar compile pool, tensor-parallel ranks."""
        self.structured.close()
        if self.tp is not None:
            self.tp.close()

    # ---- requests in (input_processor; thread-safe) ---------------------------------------
    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> str:
        return self.inputs.render_chat(messages, tools, add_generation_prompt)

    def render_infill(self, prefix: str, suffix: str) -> InfillPrompt:
        return self.inputs.render_infill(prefix, suffix)

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        return self.inputs.encode_prompt(prompt, add_special_tokens)

    def check_length(self, n_prompt: int, params: SamplingParams) -> None:
        self.inputs.check_length(n_prompt, params)

    def prepare_prompt(self, prompt: str | list[int], params: SamplingParams,
                       add_special_tokens: bool = True) -> list[int]:
        """Everything about a new request that needs no engine state (``InputProcessor.prepare``);
        ``AsyncEngine`` runs it off the step thread."""
        return self.inputs.prepare(prompt, params, add_special_tokens)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    add_special_tokens: bool = True, token_ids: list[int] | None = None) -> list[int]:
        """Validate and queue a request; returns its prompt token ids. Allocates nothing on error.
        ``token_ids``: what ``prepare_prompt`` returned for these arguments, to skip repeating it."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if self.outputs.is_active(request_id):
            raise ValueError(f"request_id: {request_id!r} is already in use")
        ids = self.inputs.prepare(prompt, params, add_special_tokens) if token_ids is None else token_ids
        sched = self.scheduler
        if sched.num_waiting + params.n > self.config.scheduler.max_waiting:
            raise QueueFullError(f"waiting queue is full (max_waiting={self.config.scheduler.max_waiting})")
        eos = frozenset(self.tokenizer.eos_token_ids)
        queued: list[Request] = []
        for i in range(params.n):   # a client request with n > 1 is n scheduler requests ("choices")
            req = Request(
                request_id=f"{request_id}#{i}", prompt_token_ids=ids, sampling_params=params,
                eos_token_ids=eos, max_model_len=self.max_model_len, parent_id=request_id, index=i,
                seed=None if params.seed is None else params.seed + i,
            )
            try:
                if params.structured is not None:
                    self.structured.add(req.request_id, params.structured)
                sched.add_request(req)
            except Exception:
                sched.finish_requests([r.request_id for r in queued], RequestStatus.FINISHED_ABORTED)
                for rid in [r.request_id for r in queued] + [req.request_id]:
                    self.structured.drop(rid)
                raise
            queued.append(req)
        fault = envs.fault_injection() and isinstance(prompt, str) and FAULT_MARKER in prompt
        self.outputs.track(request_id, ids, queued, fault)
        return ids

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Abort client requests (all their choices); unknown or finished ids are ignored."""
        for rid in request_ids:
            if not self.outputs.is_active(rid):
                continue
            self.scheduler.finish_requests(self.outputs.live_choices(rid), RequestStatus.FINISHED_ABORTED)
            self.outputs.mark_client_dirty(rid)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        # Whatever finished a request since the last step (including schedule() itself, which
        # ends a request that alone outgrows the KV pool) is reported by this step's collect.
        self.outputs.mark_dirty(out.finished_ids)
        res = self._execute(out)
        if res is not None and out.scheduled:
            self._update(out, res)
        if self.spec is not None:
            # Also those finished in this step (schedule() reports them next): an idle engine keeps no EAGLE cache.
            self.spec.after_step(out, res, self.scheduler.running, self.scheduler.finished_since_schedule)
        outputs = self.outputs.collect()
        if self._check_each_step:
            self.check_invariants()
        if out.scheduled and not self.has_unfinished_requests():
            # Going idle: the workspace of the steps just served goes back to the OS (~1 ms).
            release_freed_heap()
        return outputs

    def _execute(self, out: SchedulerOutput) -> RunnerOutput | None:
        """The forward pass and sampling; None when nothing ran or the batch failed. A batch-level
        fault fails this batch's requests and the engine keeps serving."""
        if not out.scheduled:
            # Nothing to run, but the runner drops the per-request state of those that finished.
            return self.runner.execute(out) if out.finished_ids else None
        try:
            return self.runner.execute(out)
        except Exception as exc:
            log.exception("engine step failed")
            self.outputs.fail([s.request for s in out.scheduled], f"engine fault: {type(exc).__name__}: {exc}")
            return None

    def _update(self, out: SchedulerOutput, res: RunnerOutput) -> None:
        if self.spec is not None:
            self.spec.record(out, res)   # what was verified, read before the update consumes the drafts
        for req in self.scheduler.update_from_output(out, res):
            self.outputs.process(req, res)

    def check_invariants(self) -> None:
        """After a step: the output processor and the scheduler agree on every request; the KV
        pool is consistent when idle. Raises AssertionError naming the request."""
        self.outputs.check_invariants(self.scheduler)
        if not self.has_unfinished_requests():   # the pool walk is too slow for every step
            self.kv.check_invariants()

    # ---- state ------------------------------------------------------------------------------
    def is_active(self, request_id: str) -> bool:
        """The client request is known and has not yet reported all its choices."""
        return self.outputs.is_active(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.groups) or self.scheduler.has_unfinished()

    def get_load(self) -> LoadStats:
        st = self.scheduler.stats()
        return LoadStats(
            num_running=st.num_running,
            num_waiting=st.num_waiting,
            kv_blocks_used=st.kv_blocks_used,
            kv_blocks_total=st.kv_blocks_total,
            prefix_cache_hit_rate=st.prefix_cache_hit_rate,
            **self._spec_load(),
        )

    def _spec_load(self) -> dict:
        if self.spec is None:
            return {}
        s = self.spec.stats
        return dict(spec_num_drafts=s.num_drafts, spec_draft_tokens=s.num_draft_tokens,
                    spec_accepted_tokens=s.num_accepted_tokens,
                    spec_accepted_per_position=tuple(s.accepted_per_position))
