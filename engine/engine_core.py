"""The engine core: requests in, per-step deltas out. Not thread-safe; one thread drives it.

One step reads like the table of contents of the engine::

    out = scheduler.schedule()        # which requests run how many tokens, with which blocks
    res = runner.execute(out)         # forward + sample
    scheduler.update_from_output()    # advance counters, append tokens, token-level stops
    self._process(...)                # detokenize, stop strings, build deltas

A client request with ``n > 1`` becomes ``n`` scheduler requests ("choices") that share their
prompt blocks through the prefix cache; deltas are regrouped per client request on the way out.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Iterable

import torch

from sluice.engine import envs, limits
from sluice.engine.attention.selector import get_attention_backend
from sluice.engine.config import EngineConfig
from sluice.engine.devices import resolve_device
from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.errors import ContextLengthError, QueueFullError, UnsupportedError
from sluice.engine.heap import release_freed_heap
from sluice.engine.kv_cache import KVCacheManager, num_blocks_for_budget
from sluice.engine.loaders import LoadedModel, load_model, resolve_dtype, resolve_kv_dtype
from sluice.engine.model_runner import ModelRunner
from sluice.engine.parallel.tensor import start_tensor_parallel
from sluice.engine.outputs import (CompletionDelta, RequestMetrics, RequestOutput, RunnerOutput, Usage,
                                  shown_logprobs)
from sluice.engine.request import Request, RequestStatus
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import Scheduler
from sluice.engine.structured.manager import StructuredOutputManager
from sluice.engine.tool_prompt import fallback_messages, template_renders_tools
from sluice.engine.spec_decode.factory import (build_spec_decoder, load_draft, load_heads, resolve_tree_width,
                                               shared_num_blocks)
from sluice.engine.spec_decode.stops import add_tokens_until_stop

log = logging.getLogger("sluice.engine")

FAULT_MARKER = "<<sluice-fault>>"
# CodeLlama ends an infilled middle with <EOT> (SentencePiece spelling "▁<EOT>"), not with eos.
_END_OF_INFILL = ("\u2581<EOT>", "<EOT>")


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    architecture: str
    max_model_len: int
    vocab_size: int
    dtype: str
    device: str
    attention_backend: str
    block_size: int
    num_kv_blocks: int
    capabilities: frozenset[str]
    speculative_mode: str = "disable"
    spec_draft_length: int = 0             # K; 0 when speculation is off


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


@dataclass
class _Choice:
    request: Request
    detok: IncrementalDetokenizer
    delta: CompletionDelta | None = None   # what accumulated since the last step's output
    reported: bool = False                 # its final delta went out


@dataclass
class _Group:
    request_id: str
    prompt_token_ids: list[int]
    fault: bool
    choices: list[_Choice] = field(default_factory=list)


@dataclass(frozen=True)
class InfillPrompt:
    token_ids: list[int]               # the fill-in-the-middle prompt, special tokens included
    stop_token_ids: tuple[int, ...]    # end-of-infill tokens that are not already eos


def build_infill_prompt(tokenizer, prefix: str, suffix: str) -> InfillPrompt:
    """Prefix-suffix-middle prompt from the tokenizer's own FIM tokens, as token ids:
    ``[bos?] PRE enc(prefix) SUF enc'(suffix) MID``. StarCoder-style (``<fim_prefix>{prefix}
    <fim_suffix>{suffix}<fim_middle>``, no BOS) and CodeLlama alike: CodeLlama's documented text
    form is ``<s> <PRE> {prefix} <SUF>{suffix} <MID>`` (transformers' CodeLlamaTokenizer,
    ``set_infilling_processor``; Meta's ``infilling_prompt_tokens``), i.e. the prefix keeps
    SentencePiece's leading-space marker and the suffix is encoded without it (``enc'``)."""
    fim = tokenizer.fim_tokens
    if fim is None:
        raise UnsupportedError("infill: the model's tokenizer has no fill-in-the-middle tokens")
    for name, value in (("infill.prefix", prefix), ("infill.suffix", suffix)):
        if not isinstance(value, str):
            raise ValueError(f"{name}: must be a string, got {type(value).__name__}")
    if not prefix and not suffix:
        raise ValueError("infill: prefix and suffix must not both be empty")
    probe = tokenizer.encode("a", add_special_tokens=True)
    bos = [probe[0]] if tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id] else []
    pre = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
    suf = _encode_continuation(tokenizer, suffix) if suffix else []
    stops = (tokenizer.token_to_id(t) for t in _END_OF_INFILL)
    extra = tuple(dict.fromkeys(t for t in stops if t is not None and t not in tokenizer.eos_token_ids))
    return InfillPrompt([*bos, fim.prefix, *pre, fim.suffix, *suf, fim.middle], extra)


def _never(_token_id: int) -> bool:
    return False


def _encode_continuation(tokenizer, text: str) -> list[int]:
    """``text``'s ids as the continuation of earlier text: without the space marker a
    SentencePiece-style tokenizer prepends to the start of a text (Meta's ``encode_infilling``
    trick: encode behind an anchor, drop the anchor's ids). Byte-level BPE adds no marker."""
    plain = tokenizer.encode(text, add_special_tokens=False)
    first = tokenizer.id_to_token(tokenizer.encode("a", add_special_tokens=False)[0]) or ""
    if not first.startswith("\u2581"):
        return plain
    anchor = tokenizer.encode("\n", add_special_tokens=False)
    joined = tokenizer.encode("\n" + text, add_special_tokens=False)
    return joined[len(anchor):] if joined[:len(anchor)] == anchor else plain


class EngineCore:
    def __init__(self, config: EngineConfig, progress: bool = False, loaded: LoadedModel | None = None,
                 draft_loaded: LoadedModel | None = None, heads=None) -> None:
        self.config = config
        if config.scheduler.num_speculative_tokens and not config.speculative.enabled:
            raise ValueError("num_speculative_tokens: drafts need a proposer; set speculative_mode "
                             "(and spec_draft_length) instead")
        device = resolve_device(config.device.device)
        dtype = resolve_dtype(config.device.dtype, device)
        threads = config.device.num_threads or envs.num_threads()
        if device.type == "cpu" and threads:
            torch.set_num_threads(threads)
        attn = get_attention_backend(config.device.attention_backend, device)
        quantization = config.device.quantization
        if loaded is not None and quantization not in ("auto", loaded.quantization):
            raise ValueError(f"quantization: the model given was loaded as {loaded.quantization}, "
                             f"the config asks for {quantization}")
        self.tp = None
        if config.device.tensor_parallel_shards > 1:
            if loaded is not None:
                raise ValueError("tensor_parallel_shards: the engine loads its own shards; give a model name")
            self.tp, loaded = start_tensor_parallel(config, dtype, device, quantization, progress)
        self.loaded = loaded or self._load(config.model, dtype, device, progress, quantization)
        self.draft = load_draft(config.speculative, self.loaded,
                                lambda name: self._load(name, dtype, device, progress, quantization), draft_loaded)
        self.heads = load_heads(config.speculative, self.loaded, dtype, device, heads)   # eagle / medusa
        arch = self.loaded.arch
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = self._max_model_len(arch)
        block_size = config.cache.block_size
        kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype, device)
        self.kv_dtype = kv_dtype
        # A byte budget is split between the two models' KV; a capacity in tokens holds for both.
        shared = self.draft if config.cache.max_total_tokens is None else None
        num_blocks = shared_num_blocks(self._num_blocks(arch, kv_dtype, device), arch, shared,
                                       torch.tensor([], dtype=kv_dtype).element_size(), block_size)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=config.cache.enable_prefix_caching)
        speculative = resolve_tree_width(config.speculative, self.loaded.model, attn)   # draft trees or chains
        sched_config = replace(config.scheduler, num_speculative_tokens=speculative.num_speculative_tokens)
        self.scheduler = Scheduler(sched_config, self.kv, block_size, self.max_model_len)
        self.structured = StructuredOutputManager(self.tokenizer, arch.vocab_size, config.structured)
        self.runner = ModelRunner(
            self.loaded.model, num_layers=arch.num_hidden_layers, num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim, num_blocks=num_blocks, block_size=block_size, vocab_size=arch.vocab_size,
            device=device, dtype=kv_dtype, attn=attn, sampler_backend=config.device.sampler_backend,
            seed=config.seed, grammar=self.structured,
        )
        draft_runner = None if self.draft is None else ModelRunner(
            self.draft.model, num_layers=self.draft.arch.num_hidden_layers,
            num_kv_heads=self.draft.arch.num_key_value_heads, head_dim=self.draft.arch.head_dim,
            num_blocks=num_blocks, block_size=block_size, vocab_size=arch.vocab_size, device=device,
            dtype=kv_dtype, attn=attn, sampler_backend="torch", seed=config.seed)
        self.spec = build_spec_decoder(speculative, self.runner, self.kv, draft_runner,
                                       self.heads, config.seed)   # None: off
        # Every step size's projection primitives compiled now (a few hundred ms on CPU float32),
        # not one by one under load, where each new one costs a stall and resident memory.
        sched = config.scheduler
        logit_rows = min(sched.max_num_batched_tokens, sched.max_num_seqs * (1 + sched_config.num_speculative_tokens))
        for model in (self.loaded.model, None if self.draft is None else self.draft.model):
            if hasattr(model, "warm_up"):
                model.warm_up(sched.max_num_batched_tokens, logit_rows)
        if self.tp is not None:
            self.tp.init_kv(num_blocks, block_size, kv_dtype, (sched.max_num_batched_tokens, logit_rows))
        _release_free_heap()
        caps = {"generate", "chat"} if getattr(self.tokenizer, "chat_template", None) else {"generate"}
        caps.add("structured_output")
        if getattr(self.tokenizer, "fim_tokens", None):
            caps.add("infilling")
        self.model_info = ModelInfo(
            name=self.loaded.name, path=str(self.loaded.path), architecture=arch.architecture,
            max_model_len=self.max_model_len, vocab_size=arch.vocab_size, dtype=str(dtype).removeprefix("torch."),
            device=str(device), attention_backend=attn.name, block_size=block_size, num_kv_blocks=num_blocks,
            capabilities=frozenset(caps), speculative_mode=config.speculative.speculative_mode,
            spec_draft_length=config.speculative.spec_draft_length if self.spec is not None else 0,
        )
        self._groups: dict[str, _Group] = {}
        self._choice_of: dict[str, tuple[_Group, _Choice]] = {}   # scheduler request id -> its choice
        self._dirty: dict[str, None] = {}                          # client ids with news, in order
        self._check_each_step = envs.debug_invariants()

    def close(self) -> None:
        """Release what outlives the step loop: the grammar compile pool, tensor-parallel ranks."""
        self.structured.close()
        if self.tp is not None:
            self.tp.close()

    # ---- set-up -------------------------------------------------------------------------
    @staticmethod
    def _load(model: str, dtype: torch.dtype, device: torch.device, progress: bool,
              quantization: str = "none") -> LoadedModel:
        if not progress:
            return load_model(model, dtype=dtype, device=device, quantization=quantization)
        from tqdm import tqdm

        with tqdm(desc=f"loading {model}", unit="tensor", leave=False) as bar:
            return load_model(model, dtype=dtype, device=device, progress=bar, quantization=quantization)

    def _max_model_len(self, arch) -> int:
        own = min(arch.max_position_embeddings, arch.sliding_window or arch.max_position_embeddings)
        why = "" if own == arch.max_position_embeddings else \
            ": its sliding window; sluice attends over whole contexts, so sequences stop at the window"
        asked = self.config.max_model_len
        if asked is not None and asked > own:
            raise ValueError(f"max_model_len: {asked} exceeds the model's context window ({own}{why})")
        if why:
            log.warning("model %s: context window capped at its sliding window of %d tokens", self.config.model, own)
        return asked or own

    def _num_blocks(self, arch, dtype: torch.dtype, device: torch.device) -> int:
        cache = self.config.cache
        if cache.max_total_tokens is not None:
            return math.ceil(cache.max_total_tokens / cache.block_size)
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            used = torch.cuda.memory_allocated(device)
            budget = int((free + used) * cache.gpu_memory_utilization) - used
        else:
            budget = cache.kv_cache_memory_bytes
        return num_blocks_for_budget(
            budget, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
            torch.tensor([], dtype=dtype).element_size(), cache.block_size,
        )

    # ---- requests in ----------------------------------------------------------------------
    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
        if not messages:
            raise ValueError("messages: must hold at least one message")
        limits.check_chat(messages, tools, self.config.limits)
        has_tool_turns = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if (tools or has_tool_turns) and not template_renders_tools(self.tokenizer.chat_template):
            messages, tools = fallback_messages(messages, tools), None   # engine.tool_prompt's format
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    def render_infill(self, prefix: str, suffix: str) -> InfillPrompt:
        if "infilling" not in self.model_info.capabilities:
            raise UnsupportedError(f"infill: model {self.model_info.name} does not support infilling "
                                   "(its tokenizer has no fill-in-the-middle tokens)")
        return build_infill_prompt(self.tokenizer, prefix, suffix)

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, or a token prompt checked against the vocabulary. The
        size caps come first: nothing is tokenized or walked beyond them."""
        limits.check_prompt(prompt, self.config.limits, self.max_model_len)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_info.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt: token id {t!r} is outside the vocabulary (size {vocab})")
        return ids

    def prepare_prompt(self, prompt: str | list[int], params: SamplingParams,
                       add_special_tokens: bool = True) -> list[int]:
        """Checks the caps and the parameters, then tokenizes and checks the length: everything
        about a new request that needs no engine state. Thread-safe (the tokenizer is), so
        ``AsyncEngine`` runs it off the step thread: a long prompt stalls no one's decode."""
        limits.check_params(params, self.config.limits)
        params.validate()
        params.check_vocab(self.model_info.vocab_size)
        ids = self.encode_prompt(prompt, add_special_tokens)
        self.check_length(len(ids), params)
        if params.structured is not None:   # waits up to compile_timeout_s; cached for add_request
            self.structured.compile(params.structured)
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    add_special_tokens: bool = True, token_ids: list[int] | None = None) -> list[int]:
        """Validate and queue a request; returns its prompt token ids. Allocates nothing on error.
        ``token_ids``: what ``prepare_prompt`` returned for these arguments, to skip repeating it."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self._groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        ids = self.prepare_prompt(prompt, params, add_special_tokens) if token_ids is None else token_ids
        sched = self.scheduler
        if sched.num_waiting + params.n > self.config.scheduler.max_waiting:
            raise QueueFullError(f"waiting queue is full (max_waiting={self.config.scheduler.max_waiting})")
        group = _Group(request_id, ids, fault=envs.fault_injection() and isinstance(prompt, str) and FAULT_MARKER in prompt)
        eos = frozenset(self.tokenizer.eos_token_ids)
        for i in range(params.n):
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
                sched.finish_requests([c.request.request_id for c in group.choices], RequestStatus.FINISHED_ABORTED)
                for rid in [c.request.request_id for c in group.choices] + [req.request_id]:
                    self.structured.drop(rid)
                raise
            detok = IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop,
                                           include_stop_str_in_output=params.include_stop_str_in_output,
                                           skip_special_tokens=params.skip_special_tokens)
            group.choices.append(_Choice(req, detok))
        self._groups[request_id] = group
        for c in group.choices:
            self._choice_of[c.request.request_id] = (group, c)
        return ids

    def check_length(self, n_prompt: int, params: SamplingParams) -> None:
        limit = self.max_model_len
        if n_prompt >= limit:
            raise ContextLengthError(
                f"prompt: {n_prompt} tokens leave no room to generate within the context window of {limit} tokens")
        if params.max_tokens is not None and n_prompt + params.max_tokens > limit:
            raise ContextLengthError(
                f"max_tokens: {n_prompt} prompt tokens + max_tokens {params.max_tokens} exceed the context "
                f"window of {limit} tokens")

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Abort client requests (all their choices); unknown or finished ids are ignored."""
        for rid in request_ids:
            group = self._groups.get(rid)
            if group is None:
                continue
            live = [c.request.request_id for c in group.choices if not c.request.is_finished]
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
            self._dirty[rid] = None

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        # Whatever finished a request since the last step (including schedule() itself, which
        # ends a request that alone outgrows the KV pool) sends it out through _collect.
        self._mark_dirty(out.finished_ids)
        res = None
        if out.scheduled:
            try:
                res = self.runner.execute(out)
            except Exception as exc:  # a batch-level fault: fail this batch, keep serving
                log.exception("engine step failed")
                self._fail([s.request for s in out.scheduled], f"engine fault: {type(exc).__name__}: {exc}")
                res = None
            if res is not None:
                drafted = self.spec.drafted(out) if self.spec else ()
                updated = self.scheduler.update_from_output(out, res)
                if drafted:
                    self.spec.record(drafted, res.num_rejected_tokens)
                for req in updated:
                    self._process(req, res)
        elif out.finished_ids:
            res = self.runner.execute(out)   # lets the runner drop per-request state
        if self.spec is not None:
            # Also those finished in this step (schedule() reports them next): an idle engine keeps no EAGLE cache.
            self.spec.after_step(out, res, self.scheduler.running, self.scheduler.finished_since_schedule)
        outputs = self._collect()
        if self._check_each_step:
            self.check_invariants()
        if out.scheduled and not self.has_unfinished_requests():
            # Going idle: the workspace of the steps just served goes back to the OS (~1 ms).
            release_freed_heap()
        return outputs

    def _mark_dirty(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            entry = self._choice_of.get(rid)
            if entry is not None:
                self._dirty[entry[0].request_id] = None

    def _process(self, req: Request, res: RunnerOutput) -> None:
        entry = self._choice_of.get(req.request_id)
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
                    self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        except Exception as exc:
            log.exception("request %s failed", req.request_id)
            self._fail([req], f"{type(exc).__name__}: {exc}")
        self._dirty[group.request_id] = None

    def _fail(self, requests: list[Request], message: str) -> None:
        self.scheduler.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_ERROR)
        for r in requests:
            r.error = message
            entry = self._choice_of.get(r.request_id)
            if entry:
                self._dirty[entry[0].request_id] = None

    def _collect(self) -> list[RequestOutput]:
        outputs = []
        for rid in self._dirty:
            group = self._groups.get(rid)
            if group is None:
                continue
            deltas = []
            for c in group.choices:
                if c.reported:
                    continue
                d = c.delta
                if c.request.is_finished:
                    d = d or CompletionDelta(index=c.request.index)
                    self._flush(c, d)
                    self._finalize(c, d)
                    c.reported = True
                if d is not None:
                    deltas.append(d)
                c.delta = None
            done = all(c.reported for c in group.choices)
            if deltas or done:
                outputs.append(RequestOutput(rid, deltas, finished=done, prompt_token_ids=group.prompt_token_ids))
            if done:
                del self._groups[rid]
                for c in group.choices:
                    self._choice_of.pop(c.request.request_id, None)
                    self.structured.drop(c.request.request_id)
        self._dirty.clear()
        return outputs

    @staticmethod
    def _flush(c: _Choice, d: CompletionDelta) -> None:
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

    def check_invariants(self) -> None:
        """After a step: every choice the core tracks is waiting or running in the scheduler, or
        has reported its final delta; the scheduler tracks no request the core does not know; the
        KV pool is consistent when idle. Raises AssertionError naming the request. A choice that is
        finished but unreported would hang its stream for ever (nothing would report it)."""
        sched = self.scheduler
        running = {r.request_id for r in sched.running}
        waiting = {r.request_id for r in sched.waiting}
        for rid, (group, c) in self._choice_of.items():
            if c.reported:
                continue
            where = running if c.request.status == RequestStatus.RUNNING else waiting
            if c.request.is_finished or rid not in where or sched.get_request(rid) is not c.request:
                raise AssertionError(
                    f"request {group.request_id!r} choice {c.request.index}: {c.request.status.name}, "
                    "tracked by the core but neither scheduled, waiting nor reported")
        stray = self.structured.request_ids() - self._choice_of.keys()
        if stray:
            raise AssertionError(f"grammar matchers of requests unknown to the core: {sorted(stray)[:8]}")
        orphans = (running | waiting) - self._choice_of.keys()
        if orphans:
            raise AssertionError(f"scheduler requests unknown to the core: {sorted(orphans)[:8]}")
        if len(running) != len(sched.running) or len(waiting) != len(sched.waiting):
            raise AssertionError("a request is queued twice in the scheduler")
        if not self.has_unfinished_requests():   # the pool walk is too slow for every step
            self.kv.check_invariants()

    @staticmethod
    def _finalize(c: _Choice, d: CompletionDelta) -> None:
        req = c.request
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

    # ---- state ------------------------------------------------------------------------------
    def is_active(self, request_id: str) -> bool:
        """The client request is known and has not yet reported all its choices."""
        return request_id in self._groups

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups) or self.scheduler.has_unfinished()

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


def _release_free_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``): the warm-up's large
    temporaries (~150 MB of activations for SmolLM2) are freed but would stay resident."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: nothing to do
        pass
