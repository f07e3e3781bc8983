"""OpenAI routes: /v1/models, /v1/chat/completions, /v1/completions (/v1/embeddings: routes_embeddings).

A generation request is validated (``protocol``), its model resolved, then run as one engine
stream per prompt (``generation.run_plan``). Streaming responses prepare the SSE response only
after the engine's first message, so that an error the engine reports up front (bad parameter,
context too long, queue full) is still an ordinary HTTP error; an error later becomes an SSE
``data: {"error": ...}`` event and the stream ends. Leaving the handler by any path — done,
error, client gone (aiohttp cancels the handler, or a write fails) — closes the engine streams,
which cancels and aborts the engine requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from aiohttp import web

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade import api_models, protocol, shapes
from sluice.http_facade.errors import ApiError, bad_request
from sluice.http_facade.generation import RequestTimer, first_of, run_plan, trace, usage_body, usage_of
from sluice.http_facade.json_body import read_json
from sluice.http_facade.request_context import TIMER, request_id_of
from sluice.http_facade.sse import SSEWriter
from sluice.http_facade.tools import CallScanner
from sluice.http_facade.state import FacadeState, state_of

log = logging.getLogger("sluice.facade")


def _model_card(m: pb.ModelInfo, created: int) -> dict:
    return {"id": m.name, "object": "model", "created": created, "owned_by": "sluice",
            "root": m.path, "max_model_len": m.max_model_len, "capabilities": list(m.capabilities)}


async def list_models(request: web.Request) -> web.Response:
    state = state_of(request)
    models = await state.link.list_models()
    return web.json_response({"object": "list", "data": [_model_card(m, state.started) for m in models]})


async def get_model(request: web.Request) -> web.Response:
    state = state_of(request)
    model = await state.resolve_model(request.match_info["model"])
    return web.json_response(_model_card(model, state.started))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request, state_of(request).config.body_timeout_s)
    api_models.check(api_models.ChatCompletionRequest, body)
    config = state_of(request).config
    return await _generate(request, protocol.parse_chat(body, config.default_max_tokens, config.limits), "chatcmpl")


async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request, state_of(request).config.body_timeout_s)
    api_models.check(api_models.CompletionRequest, body)
    return await _generate(request, protocol.parse_completion(body, state_of(request).config.limits), "cmpl")


class _Run:
    """One HTTP generation request in flight."""

    def __init__(self, state: FacadeState, plan: protocol.GenerationPlan, env: shapes.Envelope,
                 route: str) -> None:
        self.state = state
        self.plan = plan
        self.env = env
        self.timer = RequestTimer(env.id, route, env.model)
        total = len(plan.requests) * plan.n
        self.choices = [shapes.ChoiceState(i) for i in range(total)]
        self.echo: dict[int, str] = {}

    def finals(self) -> dict[int, pb.ChoiceFinal]:
        return {c.index: c.final for c in self.choices if c.final is not None}

    def usage(self) -> dict:
        finals = self.finals()
        prompt, completion, cached = usage_of(finals, self.plan.n)
        self.timer.prompt_tokens, self.timer.completion_tokens, self.timer.cached_tokens = prompt, completion, cached
        return usage_body(prompt, completion, cached, finals)

    async def prepare_echo(self, prompt_index: int, msg: pb.GenerateResponse) -> None:
        if not self.plan.echo:
            return
        req = self.plan.requests[prompt_index]
        if req.WhichOneof("input") == "text":
            text = req.text
        else:
            text = await self.state.link.detokenize(list(msg.prompt_token_ids or req.token_ids.ids), self.plan.model)
        for j in range(self.plan.n):
            self.echo[prompt_index * self.plan.n + j] = text

    def close(self, outcome: str) -> None:
        self.usage()
        self.state.metrics.observe(self.timer)
        if self.state.config.enable_tracing:
            self.state.record_trace(trace(self.timer, self.finals(), outcome))


async def _generate(request: web.Request, plan: protocol.GenerationPlan, prefix: str) -> web.StreamResponse:
    state = state_of(request)
    model = await state.resolve_model(plan.model)
    if plan.requests[0].WhichOneof("input") == "infill" and "infilling" not in model.capabilities:
        raise bad_request(f"suffix: model {model.name} cannot fill in the middle (its tokenizer has no FIM "
                          "tokens); send the prompt without a suffix", "suffix", "model_not_supported")
    env = shapes.Envelope(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model.name, shapes.fingerprint(model))
    run = _Run(state, plan, env, request.path)
    request[TIMER] = run.timer
    outcome = "error"
    try:
        async with contextlib.aclosing(run_plan(state.link, plan, request_id_of(request), state.ending)) as stream:
            if plan.stream:
                response = await _stream(request, run, stream)
            else:
                response = await _collect(run, stream)
        outcome = "ok"
        return response
    except BaseException as exc:
        outcome = "cancelled" if isinstance(exc, (ConnectionError, asyncio.CancelledError)) else "error"
        raise
    finally:
        run.close(outcome)


async def _collect(run: _Run, stream) -> web.Response:
    async for prompt_index, msg in stream:
        if msg.prompt_token_ids:
            await run.prepare_echo(prompt_index, msg)
        for delta in msg.choices:
            run.timer.on_tokens(len(delta.token_ids))
            run.choices[delta.index].add(delta)
    if any(c.final is None for c in run.choices):
        raise ApiError(502, "the engine ended the stream before every choice finished", "server_error")
    usage = run.usage()
    if run.plan.kind == "chat":
        body = shapes.chat_response(run.env, run.choices, usage, run.plan.logprobs,
                                   run.plan.tool_names if run.plan.tool_calls else None)
    else:
        body = shapes.completion_response(run.env, run.choices, usage, run.plan.logprobs, run.echo)
    return web.json_response(body)


async def _stream(request: web.Request, run: _Run, stream) -> web.StreamResponse:
    first, iterator = await first_of(stream)
    sse = SSEWriter(request)
    await sse.prepare()
    try:
        await _emit(run, sse, *first)
        async for prompt_index, msg in iterator:
            await _emit(run, sse, prompt_index, msg)
    except ApiError as err:
        await sse.send_error(err)
        return await sse.finish()
    if run.plan.include_usage:
        await sse.send(shapes.usage_chunk(run.env, run.plan.kind, run.usage()))
    return await sse.done()


async def _emit(run: _Run, sse: SSEWriter, prompt_index: int, msg: pb.GenerateResponse) -> None:
    if msg.prompt_token_ids:
        await run.prepare_echo(prompt_index, msg)
    for delta in msg.choices:
        run.timer.on_tokens(len(delta.token_ids))
        choice = run.choices[delta.index]
        choice.add(delta)
        if delta.HasField("final"):
            err = shapes.finish_error(delta.final)
            if err is not None:
                raise err
        for chunk in _chunks(run, choice, delta):
            await sse.send(chunk)


def _chunks(run: _Run, choice: shapes.ChoiceState, delta: pb.ChoiceDelta) -> list[dict]:
    plan, env = run.plan, run.env
    with_usage = plan.include_usage
    first = not choice.started
    choice.started = True
    out = []
    if plan.kind == "chat" and plan.tool_calls:
        return _tool_chunks(run, choice, delta, first)
    if plan.kind == "chat":
        lp = shapes.chat_logprobs(list(delta.logprobs)) if plan.logprobs else None
        if first or delta.text or delta.logprobs:
            body = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
            out.append(shapes.chat_chunk(env, choice.index, body, None, lp, with_usage))
        if delta.HasField("final"):
            out.append(shapes.chat_chunk(env, choice.index, {}, shapes.finish_reason(delta.final), None, with_usage))
        return out
    text = (run.echo.get(choice.index, "") if first else "") + delta.text
    if first:
        choice.offset = len(text) - len(delta.text)
    if text or delta.logprobs:
        lp = shapes.completion_logprobs(list(delta.logprobs), choice.offset) if plan.logprobs else None
        out.append(shapes.completion_chunk(env, choice.index, text, None, lp, with_usage))
    choice.offset += len(delta.text)
    if delta.HasField("final"):
        out.append(shapes.completion_chunk(env, choice.index, "", shapes.finish_reason(delta.final), None, with_usage))
    return out


def _tool_chunks(run: _Run, choice: shapes.ChoiceState, delta: pb.ChoiceDelta, first: bool) -> list[dict]:
    """Tools offered: the text goes through the choice's ``CallScanner``, which sends content as
    it comes and each call, as tool_calls deltas, once it is complete."""
    env, with_usage, plan = run.env, run.plan.include_usage, run.plan
    if first:
        choice.scanner = CallScanner(plan.tool_names)
    out = [shapes.chat_chunk(env, choice.index, {"role": "assistant",
                                                 "content": None if plan.tool_calls == "forced" else ""},
                             None, None, with_usage)] if first else []
    bodies = choice.scanner.feed(delta.text)
    if delta.HasField("final"):
        bodies += choice.scanner.finish()
    out.extend(shapes.chat_chunk(env, choice.index, body, None, None, with_usage) for body in bodies)
    if delta.HasField("final"):
        reason = shapes.finish_reason(delta.final)
        if reason == "stop" and choice.scanner.calls:
            reason = "tool_calls"
        out.append(shapes.chat_chunk(env, choice.index, {}, reason, None, with_usage))
    return out
