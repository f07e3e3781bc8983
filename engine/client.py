"""Typed client SDK for the sluice engine's gRPC API: ``EngineClient`` (blocking) and
``AsyncEngineClient`` (asyncio). Internal services and the HTTP facade import this module and the
generated stubs only; it does not import torch or any engine internals.

    with EngineClient("127.0.0.1:50051", timeout=30) as client:
        for delta in client.generate("Once upon a time", max_tokens=32, seed=1):
            print(delta.text, end="")

    with EngineClient("127.0.0.1:50051") as client:
        vectors = client.embed(["a text", "another"], dimensions=128).vectors
        best = client.rerank("a query", documents=["doc a", "doc b"], top_n=1).results[0]
        middle = client.generate("def add(a, b):\n    ", suffix="\n    return c\n", max_tokens=16)

Every RPC failure surfaces as ``EngineRpcError`` with ``.code`` (a ``grpc.StatusCode``) and the
server's message. Leaving a stream early (``break``, ``.cancel()``, a timeout) cancels the call,
which aborts the request in the engine.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc import engine_pb2_grpc as pb_grpc
from sluice.engine.rpc.client_embed import (Embeddings, RerankHit, Reranked, embed_request,  # noqa: F401 - re-exported
                                     embeddings_from_proto, rerank_request, reranked_from_proto)
from sluice.engine.rpc.client_tools import tool_calls, tool_definitions

Prompt = str | Sequence[int]
Message = Mapping[str, Any]    # {"role": ..., "content": ..., "name"?, "tool_call_id"?, "tool_calls"?}

_ROLES = {"system": pb.ROLE_SYSTEM, "user": pb.ROLE_USER, "assistant": pb.ROLE_ASSISTANT, "tool": pb.ROLE_TOOL}
_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
           pb.FINISH_REASON_ABORT: "abort", pb.FINISH_REASON_ERROR: "error"}


class EngineRpcError(Exception):
    """An RPC to the engine failed. ``code`` is the gRPC status, ``message`` the server's text."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> EngineRpcError:
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")

    @property
    def retryable(self) -> bool:
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


# ---------------------------------------------------------------------------------- types
@dataclass(frozen=True)
class SamplingOptions:
    """Sampling parameters; ``None`` leaves the engine's default."""
    n: int | None = None
    max_tokens: int | None = None
    max_tokens_unlimited: bool = False      # until a stop or the context window is full
    min_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # e.g. pb.StructuredOutput(regex="[0-9]+") or (json_schema=pb.JsonSchemaConstraint(...))
    structured_output: pb.StructuredOutput | None = None

    def to_proto(self) -> pb.SamplingParams:
        msg = pb.SamplingParams(max_tokens_unlimited=self.max_tokens_unlimited, logprobs=self.logprobs,
                                stop=list(self.stop), stop_token_ids=list(self.stop_token_ids))
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in ("max_tokens_unlimited", "logprobs", "stop", "stop_token_ids"):
                continue
            if f.name == "logit_bias":
                msg.logit_bias.update({int(k): float(v) for k, v in value.items()})
            elif f.name == "structured_output":
                msg.structured_output.CopyFrom(value)
            else:
                setattr(msg, f.name, value)
        return msg


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float
    token: str


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    token: str
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    draft_tokens: int = 0                  # speculative decoding: drafts verified ...
    accepted_tokens: int = 0               # ... and accepted (both 0 without it)


@dataclass(frozen=True)
class Timings:
    queued_s: float | None
    ttft_s: float | None
    total_s: float | None


@dataclass(frozen=True)
class Delta:
    """What one choice gained; the choice's last delta has ``finish_reason`` and the rest."""
    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None        # stop | length | abort | error
    stop_reason: str | int | None = None    # the matched stop string or stop token id
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Choice:
    """A whole choice, accumulated from its deltas by ``collect()``."""
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    timings: Timings | None = None

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids.extend(d.token_ids)
        self.logprobs.extend(d.logprobs)
        if d.finished:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
            self.usage, self.timings = d.usage, d.timings


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
    capabilities: frozenset[str]
    embedding_model: str = ""              # empty: the engine serves no embedding model
    embedding_dimension: int = 0
    embedding_max_length: int = 0
    embedding_normalize: bool = False
    embedding_query_prefix: str = ""
    embedding_document_prefix: str = ""
    rerank_method: str = ""                # "cross-encoder" | "embedding-cosine"; empty: no rerank
    rerank_model: str = ""
    speculative_mode: str = "disable"
    spec_draft_length: int = 0             # K; 0 when speculation is off


@dataclass(frozen=True)
class LoadStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_hit_rate: float
    num_in_flight: int
    spec_num_drafts: int = 0               # speculative decoding since start-up
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()


@dataclass(frozen=True)
class Tokenized:
    token_ids: list[int]
    prompt: str | None          # the rendered chat prompt, for chat input
    max_model_len: int


# ----------------------------------------------------------------- requests and responses
def _options(options: SamplingOptions | None, overrides: dict[str, Any]) -> SamplingOptions:
    base = options or SamplingOptions()
    if not overrides:
        return base
    return SamplingOptions(**{**{f.name: getattr(base, f.name) for f in fields(base)}, **overrides})


def chat_input(messages: Sequence[Message], tools: Sequence[Mapping] | None = None,
               add_generation_prompt: bool = True) -> pb.ChatInput:
    """``tools`` and each message's ``tool_calls`` are OpenAI-shaped dicts (see
    ``sluice.engine.rpc.client_tools``); they travel as typed messages."""
    msg = pb.ChatInput(add_generation_prompt=add_generation_prompt)
    if tools:
        msg.tools.extend(tool_definitions(tools))
    for i, m in enumerate(messages):
        role = _ROLES.get(m.get("role", ""))
        if role is None:
            raise ValueError(f"messages[{i}].role: must be system, user, assistant or tool, got {m.get('role')!r}")
        content = m.get("content") or ""
        if not isinstance(content, str):   # OpenAI-style list of text parts
            content = "".join(part.get("text", "") for part in content)
        calls = tool_calls(m["tool_calls"], f"messages[{i}].tool_calls") if m.get("tool_calls") else ()
        msg.messages.add(role=role, content=content, name=m.get("name") or "",
                         tool_call_id=m.get("tool_call_id") or "", tool_calls=calls)
    return msg


def generate_request(prompt: Prompt | None, options: SamplingOptions, request_id: str, *,
                     messages: Sequence[Message] | None = None, tools: Sequence[Mapping] | None = None,
                     add_generation_prompt: bool = True, add_special_tokens: bool | None = None,
                     suffix: str | None = None) -> pb.GenerateRequest:
    """``suffix`` makes a fill-in-the-middle request: ``prompt`` (a text) is the prefix."""
    req = pb.GenerateRequest(request_id=request_id, sampling=options.to_proto())
    if suffix is not None:
        if not isinstance(prompt, str):
            raise ValueError("prompt: infilling (suffix=...) needs a text prompt as the prefix")
        req.infill.prefix, req.infill.suffix = prompt, suffix
    elif messages is not None:
        req.chat.CopyFrom(chat_input(messages, tools, add_generation_prompt))
    elif isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.ids.extend(prompt)
    else:
        raise ValueError("prompt: a text, token ids or chat messages are required")
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    return req


def deltas_from_proto(msg: pb.GenerateResponse) -> list[Delta]:
    return [_delta(msg.request_id, c) for c in msg.choices]


def _delta(request_id: str, c: pb.ChoiceDelta) -> Delta:
    logprobs = tuple(
        TokenLogprob(lp.token_id, lp.logprob, lp.token,
                     tuple(TopLogprob(t.token_id, t.logprob, t.token) for t in lp.top))
        for lp in c.logprobs)
    base = dict(request_id=request_id, index=c.index, text=c.text, token_ids=tuple(c.token_ids), logprobs=logprobs)
    if not c.HasField("final"):
        return Delta(**base)
    f = c.final
    kind = f.WhichOneof("matched_stop")
    t = f.timings
    return Delta(
        **base,
        finish_reason=_FINISH.get(f.finish_reason, "unknown"),
        stop_reason=getattr(f, kind) if kind else None,
        usage=Usage(f.usage.prompt_tokens, f.usage.completion_tokens, f.usage.cached_prompt_tokens,
                    f.usage.draft_tokens, f.usage.accepted_tokens),
        timings=Timings(*(getattr(t, n) if t.HasField(n) else None for n in ("queued_s", "ttft_s", "total_s"))),
        error=f.error or None,
    )


def _model_info(m: pb.ModelInfo) -> ModelInfo:   # GetModelInfoResponse.model, ListModelsResponse.models[i]
    return ModelInfo(m.name, m.path, m.architecture, m.max_model_len, m.vocab_size, m.dtype, m.device,
                     m.attention_backend, frozenset(m.capabilities), m.embedding_model, m.embedding_dimension,
                     m.embedding_max_length, m.embedding_normalize, m.embedding_query_prefix,
                     m.embedding_document_prefix, m.rerank_method, m.rerank_model, m.speculative_mode,
                     m.spec_draft_length)


def _load(m: pb.GetLoadResponse) -> LoadStats:
    return LoadStats(m.num_running, m.num_waiting, m.kv_blocks_used, m.kv_blocks_total,
                     m.prefix_cache_hit_rate, m.num_in_flight, m.spec_num_drafts, m.spec_draft_tokens,
                     m.spec_accepted_tokens, tuple(m.spec_accepted_per_position))


def _tokenize_request(text: str | None, messages, tools, add_special_tokens) -> pb.TokenizeRequest:
    req = pb.TokenizeRequest()
    if messages is not None:
        req.chat.CopyFrom(chat_input(messages, tools))
    elif text is not None:
        req.text = text
    else:
        raise ValueError("text: a text or chat messages are required")
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    return req


def _detokenize_request(token_ids: Sequence[int], skip_special_tokens: bool | None) -> pb.DetokenizeRequest:
    req = pb.DetokenizeRequest(token_ids=list(token_ids))
    if skip_special_tokens is not None:
        req.skip_special_tokens = skip_special_tokens
    return req


def _new_request_id() -> str:
    return f"cli-{uuid.uuid4().hex}"


_HEALTH_NAMES = {v: k for k, v in health_pb2.HealthCheckResponse.ServingStatus.items()}


# ------------------------------------------------------------------------------- streams
class GenerationStream:
    """An iterator of ``Delta`` for one request. ``cancel()`` (or leaving the loop early and
    dropping the stream) cancels the call, which aborts the request in the engine."""

    def __init__(self, call: Any, request_id: str) -> None:
        self._call = call
        self.request_id = request_id
        self.prompt_token_ids: list[int] | None = None
        self._cancelled = False
        self._iter = self._deltas()

    def __iter__(self) -> Iterator[Delta]:
        return self

    def __next__(self) -> Delta:
        return next(self._iter)

    def _deltas(self) -> Iterator[Delta]:
        try:
            for msg in self._call:
                if self.prompt_token_ids is None and msg.prompt_token_ids:
                    self.prompt_token_ids = list(msg.prompt_token_ids)
                yield from deltas_from_proto(msg)
        except grpc.RpcError as err:
            if not (self._cancelled and err.code() == grpc.StatusCode.CANCELLED):
                raise EngineRpcError.from_rpc_error(err) from None
        finally:
            self._call.cancel()   # a no-op once the call has completed

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    def collect(self) -> list[Choice]:
        """Drain the stream into whole choices, in index order."""
        choices: dict[int, Choice] = {}
        for d in self:
            choices.setdefault(d.index, Choice(d.index)).add(d)
        return [choices[i] for i in sorted(choices)]

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class AsyncGenerationStream:
    """The asyncio counterpart of ``GenerationStream``."""

    def __init__(self, call: Any, request_id: str) -> None:
        self._call = call
        self.request_id = request_id
        self.prompt_token_ids: list[int] | None = None
        self._cancelled = False
        self._iter = self._deltas()

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    async def __anext__(self) -> Delta:
        return await self._iter.__anext__()

    async def _deltas(self) -> AsyncIterator[Delta]:
        try:
            async for msg in self._call:
                if self.prompt_token_ids is None and msg.prompt_token_ids:
                    self.prompt_token_ids = list(msg.prompt_token_ids)
                for d in deltas_from_proto(msg):
                    yield d
        except grpc.RpcError as err:
            if not (self._cancelled and err.code() == grpc.StatusCode.CANCELLED):
                raise EngineRpcError.from_rpc_error(err) from None
        finally:
            self._call.cancel()

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    async def collect(self) -> list[Choice]:
        choices: dict[int, Choice] = {}
        async for d in self:
            choices.setdefault(d.index, Choice(d.index)).add(d)
        return [choices[i] for i in sorted(choices)]

    async def __aenter__(self) -> AsyncGenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()
        await self._iter.aclose()


# ------------------------------------------------------------------------------- clients
class _ClientBase:
    def __init__(self, timeout: float | None, wait_for_ready: bool) -> None:
        self.timeout = timeout
        self.wait_for_ready = wait_for_ready

    def _kw(self, timeout: float | None) -> dict[str, Any]:
        return {"timeout": self.timeout if timeout is None else timeout, "wait_for_ready": self.wait_for_ready}


class EngineClient(_ClientBase):
    """Blocking client. ``timeout`` (seconds) is the default deadline of every call, a stream's
    whole duration included; ``options`` are gRPC channel arguments; ``credentials`` makes a TLS
    channel; ``wait_for_ready`` queues calls while the channel connects instead of failing."""

    def __init__(self, target: str, *, timeout: float | None = None, options: Sequence[tuple[str, Any]] = (),
                 credentials: grpc.ChannelCredentials | None = None, wait_for_ready: bool = False) -> None:
        super().__init__(timeout, wait_for_ready)
        self.target = target
        opts = list(options)
        self._channel = (grpc.secure_channel(target, credentials, opts) if credentials
                         else grpc.insecure_channel(target, opts))
        self._stub = pb_grpc.EngineServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(request, **self._kw(timeout))
        except grpc.RpcError as err:
            raise EngineRpcError.from_rpc_error(err) from None

    def generate(self, prompt: Prompt, options: SamplingOptions | None = None, *, request_id: str | None = None,
                 timeout: float | None = None, add_special_tokens: bool | None = None, suffix: str | None = None,
                 **sampling: Any) -> GenerationStream:
        """Stream a completion of a text or token-id prompt. Keyword sampling options
        (``max_tokens=``, ``seed=``, ...) override those in ``options``. With ``suffix``, fill in
        the middle between ``prompt`` and ``suffix`` (models with the "infilling" capability)."""
        rid = request_id or _new_request_id()
        req = generate_request(prompt, _options(options, sampling), rid, add_special_tokens=add_special_tokens,
                               suffix=suffix)
        return GenerationStream(self._stub.Generate(req, **self._kw(timeout)), rid)

    def chat(self, messages: Sequence[Message], options: SamplingOptions | None = None, *,
             tools: Sequence[Mapping] | None = None, add_generation_prompt: bool = True,
             request_id: str | None = None, timeout: float | None = None, **sampling: Any) -> GenerationStream:
        """Stream a reply to chat messages, rendered with the model's chat template by the engine."""
        rid = request_id or _new_request_id()
        req = generate_request(None, _options(options, sampling), rid, messages=messages, tools=tools,
                               add_generation_prompt=add_generation_prompt)
        return GenerationStream(self._stub.Generate(req, **self._kw(timeout)), rid)

    def tokenize(self, text: str | None = None, *, messages: Sequence[Message] | None = None,
                 tools: Sequence[Mapping] | None = None, add_special_tokens: bool | None = None,
                 timeout: float | None = None) -> Tokenized:
        r = self._unary(self._stub.Tokenize, _tokenize_request(text, messages, tools, add_special_tokens), timeout)
        return Tokenized(list(r.token_ids), r.prompt or None, r.max_model_len)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None,
                   timeout: float | None = None) -> str:
        return self._unary(self._stub.Detokenize, _detokenize_request(token_ids, skip_special_tokens), timeout).text

    def abort(self, *request_ids: str, timeout: float | None = None) -> list[str]:
        """Abort requests by id; returns those that were in flight."""
        r = self._unary(self._stub.Abort, pb.AbortRequest(request_ids=list(request_ids)), timeout)
        return list(r.aborted)

    def embed(self, inputs: str | Sequence[str] | Sequence[Sequence[int]], *, normalize: bool | None = None,
              dimensions: int | None = None, input_type: str | None = None, prefix: str | None = None,
              truncate: bool | None = None, timeout: float | None = None) -> Embeddings:
        """Embed texts (or token-id lists of the embedding model). ``input_type`` "query" /
        "document" adds the model's prefix; ``dimensions`` keeps the first N values."""
        req = embed_request(inputs, normalize=normalize, dimensions=dimensions, input_type=input_type,
                            prefix=prefix, truncate=truncate)
        return embeddings_from_proto(self._unary(self._stub.Embed, req, timeout))

    def rerank(self, query: str | None = None, documents: Sequence[str] | None = None, *,
               pairs: Sequence[tuple[str, str]] | None = None, top_n: int | None = None,
               return_documents: bool = False, timeout: float | None = None) -> Reranked:
        """Score documents against a query (results best first), or (query, document) pairs
        (results in input order)."""
        req = rerank_request(query, documents, pairs, top_n, return_documents)
        return reranked_from_proto(self._unary(self._stub.Rerank, req, timeout))

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        return _model_info(self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout).model)

    def list_models(self, timeout: float | None = None) -> list[ModelInfo]:
        r = self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return [_model_info(m) for m in r.models]

    def load(self, timeout: float | None = None) -> LoadStats:
        return _load(self._unary(self._stub.GetLoad, pb.GetLoadRequest(), timeout))

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """``SERVING``, ``NOT_SERVING``, ``SERVICE_UNKNOWN`` or ``UNKNOWN``."""
        r = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return _HEALTH_NAMES[r.status]

    def wait_until_serving(self, timeout: float = 120.0, interval: float = 0.2) -> None:
        """Block until health says SERVING; ``EngineRpcError`` (DEADLINE_EXCEEDED) on timeout."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                last = self.health(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                if last == "SERVING":
                    return
            except EngineRpcError as err:
                last = err.code.name
            time.sleep(interval)
        raise EngineRpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"engine at {self.target} not serving after {timeout}s ({last})")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEngineClient(_ClientBase):
    """The asyncio client; the same methods as ``EngineClient``, awaitable. Create it inside the
    running loop it will be used from."""

    def __init__(self, target: str, *, timeout: float | None = None, options: Sequence[tuple[str, Any]] = (),
                 credentials: grpc.ChannelCredentials | None = None, wait_for_ready: bool = False) -> None:
        super().__init__(timeout, wait_for_ready)
        self.target = target
        opts = list(options)
        self._channel = (grpc.aio.secure_channel(target, credentials, opts) if credentials
                         else grpc.aio.insecure_channel(target, opts))
        self._stub = pb_grpc.EngineServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(request, **self._kw(timeout))
        except grpc.RpcError as err:
            raise EngineRpcError.from_rpc_error(err) from None

    def generate(self, prompt: Prompt, options: SamplingOptions | None = None, *, request_id: str | None = None,
                 timeout: float | None = None, add_special_tokens: bool | None = None, suffix: str | None = None,
                 **sampling: Any) -> AsyncGenerationStream:
        rid = request_id or _new_request_id()
        req = generate_request(prompt, _options(options, sampling), rid, add_special_tokens=add_special_tokens,
                               suffix=suffix)
        return AsyncGenerationStream(self._stub.Generate(req, **self._kw(timeout)), rid)

    def chat(self, messages: Sequence[Message], options: SamplingOptions | None = None, *,
             tools: Sequence[Mapping] | None = None, add_generation_prompt: bool = True,
             request_id: str | None = None, timeout: float | None = None, **sampling: Any) -> AsyncGenerationStream:
        rid = request_id or _new_request_id()
        req = generate_request(None, _options(options, sampling), rid, messages=messages, tools=tools,
                               add_generation_prompt=add_generation_prompt)
        return AsyncGenerationStream(self._stub.Generate(req, **self._kw(timeout)), rid)

    async def tokenize(self, text: str | None = None, *, messages: Sequence[Message] | None = None,
                       tools: Sequence[Mapping] | None = None, add_special_tokens: bool | None = None,
                       timeout: float | None = None) -> Tokenized:
        req = _tokenize_request(text, messages, tools, add_special_tokens)
        r = await self._unary(self._stub.Tokenize, req, timeout)
        return Tokenized(list(r.token_ids), r.prompt or None, r.max_model_len)

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None,
                         timeout: float | None = None) -> str:
        r = await self._unary(self._stub.Detokenize, _detokenize_request(token_ids, skip_special_tokens), timeout)
        return r.text

    async def abort(self, *request_ids: str, timeout: float | None = None) -> list[str]:
        r = await self._unary(self._stub.Abort, pb.AbortRequest(request_ids=list(request_ids)), timeout)
        return list(r.aborted)

    async def embed(self, inputs: str | Sequence[str] | Sequence[Sequence[int]], *, normalize: bool | None = None,
                    dimensions: int | None = None, input_type: str | None = None, prefix: str | None = None,
                    truncate: bool | None = None, timeout: float | None = None) -> Embeddings:
        req = embed_request(inputs, normalize=normalize, dimensions=dimensions, input_type=input_type,
                            prefix=prefix, truncate=truncate)
        return embeddings_from_proto(await self._unary(self._stub.Embed, req, timeout))

    async def rerank(self, query: str | None = None, documents: Sequence[str] | None = None, *,
                     pairs: Sequence[tuple[str, str]] | None = None, top_n: int | None = None,
                     return_documents: bool = False, timeout: float | None = None) -> Reranked:
        req = rerank_request(query, documents, pairs, top_n, return_documents)
        return reranked_from_proto(await self._unary(self._stub.Rerank, req, timeout))

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        return _model_info((await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)).model)

    async def list_models(self, timeout: float | None = None) -> list[ModelInfo]:
        r = await self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout)
        return [_model_info(m) for m in r.models]

    async def load(self, timeout: float | None = None) -> LoadStats:
        return _load(await self._unary(self._stub.GetLoad, pb.GetLoadRequest(), timeout))

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        r = await self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return _HEALTH_NAMES[r.status]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
