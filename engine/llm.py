"""The offline API: ``LLM(model=...).generate(...)`` / ``.chat(...)`` in-process, no server.

It drives ``EngineCore`` step by step; ``generate_stream`` yields the same per-step deltas that
the gRPC servicer streams.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import fields

from sluice.engine.config import CacheConfig, DeviceConfig, EngineConfig, LimitsConfig, SchedulerConfig
from sluice.engine.engine_core import EngineCore
from sluice.engine.errors import QueueFullError
from sluice.engine.loaders import LoadedModel
from sluice.engine.outputs import CompletionOutput, GenerationResult, RequestOutput, Usage
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.spec_decode.config import SpeculativeConfig
from sluice.engine.structured.spec import StructuredOutputConfig

Prompt = str | list[int]
Messages = list[dict]


def build_config(model: str, **kwargs) -> EngineConfig:
    """Split flat keyword options into the per-subsystem configs; unknown keys are an error."""
    parts = {}
    for cls in (CacheConfig, SchedulerConfig, DeviceConfig, LimitsConfig, SpeculativeConfig, StructuredOutputConfig):
        names = {f.name for f in fields(cls)}
        parts[cls] = cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
    top = {f.name for f in fields(EngineConfig)} - {"cache", "scheduler", "device", "limits", "speculative", "structured", "model"}
    unknown = set(kwargs) - top
    if unknown:
        raise ValueError(f"{sorted(unknown)[0]}: unknown engine option")
    return EngineConfig(model=model, cache=parts[CacheConfig], scheduler=parts[SchedulerConfig],
                        device=parts[DeviceConfig], limits=parts[LimitsConfig],
                        speculative=parts[SpeculativeConfig], structured=parts[StructuredOutputConfig], **kwargs)


class LLM:
    def __init__(self, model: str = "smollm2", *, config: EngineConfig | None = None, progress: bool = False,
                 loaded: LoadedModel | None = None, draft_loaded: LoadedModel | None = None, heads=None,
                 **options) -> None:
        """``options`` are the fields of the per-subsystem configs (block_size, max_num_seqs,
        max_num_batched_tokens, kv_cache_memory_bytes, device, dtype, attention_backend,
        quantization = none | bf16 | int8 | int4 | w8a8 | w4a8 | auto (the default), ...).
        ``loaded`` reuses weights already in memory (tests build several engines on one model);
        ``draft_loaded`` does the same for small_draft's draft model (``additional_models``), and
        ``heads`` for eagle's or medusa's heads module (``spec_decode.heads``)."""
        self.engine = EngineCore(config or build_config(model, **options), progress=progress, loaded=loaded,
                                 draft_loaded=draft_loaded, heads=heads)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop what the engine started besides this thread (tensor-parallel ranks, grammar pool)."""
        self.engine.close()

    # ---- batch API ----------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerationResult]:
        """Complete each prompt (text or token ids); results come back in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), params, add_special_tokens=True)

    def chat(self, messages: Messages | Sequence[Messages],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             tools: list[dict] | None = None, add_generation_prompt: bool = True) -> list[GenerationResult]:
        """Render each conversation with the model's chat template, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.engine.render_chat(m, tools=tools, add_generation_prompt=add_generation_prompt) for m in convs]
        # The template already wrote the special tokens it wants.
        return self._run(texts, params, add_special_tokens=False)

    def generate_stream(self, prompt: Prompt, params: SamplingParams | None = None,
                        add_special_tokens: bool = True) -> Iterator[RequestOutput]:
        """Yield one ``RequestOutput`` per step for a single request until it finishes."""
        rid = f"stream-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params or SamplingParams(), add_special_tokens)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request([rid])
            while self.engine.is_active(rid):
                self.engine.step()

    # ---- internals --------------------------------------------------------------------------
    def _run(self, prompts: list[Prompt], params, add_special_tokens: bool) -> list[GenerationResult]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: got {len(params)} sampling params for {len(prompts)} prompts")
        # Validate and tokenize every prompt before queueing any, so a bad one allocates nothing.
        encoded = []
        for p, sp in zip(prompts, params):
            sp.validate()
            toks = self.engine.encode_prompt(p, add_special_tokens)
            self.engine.check_length(len(toks), sp)
            encoded.append(toks)
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        acc: dict[str, _Accumulator] = {}
        pending = list(zip(ids, prompts, encoded, params))
        try:
            while pending or self.engine.has_unfinished_requests():
                while pending:
                    rid, p, toks, sp = pending[0]
                    try:
                        self.engine.add_request(rid, toks, sp)
                    except QueueFullError:
                        break   # step until the queue has room
                    acc[rid] = _Accumulator(p if isinstance(p, str) else None, toks, sp.n)
                    pending.pop(0)
                for out in self.engine.step():
                    acc[out.request_id].add(out)
        except BaseException:
            self.engine.abort_request(list(acc))
            while self.engine.has_unfinished_requests():
                self.engine.step()
            raise
        return [acc[rid].result(rid) for rid in ids]


class _Accumulator:
    def __init__(self, prompt: str | None, prompt_ids: list[int], n: int) -> None:
        self.prompt, self.prompt_ids = prompt, prompt_ids
        self.outs = [CompletionOutput(i, "", [], None) for i in range(n)]
        self.usage = [None] * n
        self.metrics = None

    def add(self, out: RequestOutput) -> None:
        for d in out.deltas:
            o = self.outs[d.index]
            o.text += d.text
            o.token_ids.extend(d.token_ids)
            if d.logprobs:
                o.logprobs = (o.logprobs or []) + d.logprobs
            if d.finished:
                o.finish_reason, o.stop_reason, o.error = d.finish_reason, d.stop_reason, d.error
                self.usage[d.index] = d.usage
                self.metrics = self.metrics or d.metrics

    def result(self, rid: str) -> GenerationResult:
        completion = sum(u.completion_tokens for u in self.usage if u)
        cached = max((u.cached_tokens for u in self.usage if u), default=0)
        drafts = sum(u.draft_tokens for u in self.usage if u)
        accepted = sum(u.accepted_tokens for u in self.usage if u)
        usage = Usage(len(self.prompt_ids), completion, cached, drafts, accepted)
        return GenerationResult(rid, self.prompt, self.prompt_ids, self.outs, usage, self.metrics)
