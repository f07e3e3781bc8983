"""Running an AFS generation request: the JSON answer, or the SSE stream of records.

A record (the answer, and every stream event) has the fields::

    {"generated_text", "function_call", "details", "total_time_taken", "prompt_tokens",
     "generated_tokens", "total_tokens", "finish_reason"}

Streaming: one ``data: {record}`` per generated token, with null / 0 in every field but
``generated_text`` (and ``details`` with show_probabilities: that token's log-probability)
until the last record, which carries the last token's text and the totals. A token whose bytes
do not yet form whole UTF-8 characters has ``generated_text: ""``; its text arrives with a
later record (the engine's incremental detokenizer holds it back), so the records' texts join
to exactly the non-streamed ``generated_text``. With ``functions``, the text streams as the
model writes it and the last record carries ``function_call`` / ``finish_reason``.

While no record is due for ``ping_interval_s`` (default 15 s) the stream sends
``event: ping`` / ``data: <UTC time>`` (not JSON), as the AFS service (sse-starlette) does;
a ping before the first token starts the 200 response early. An error before the response has
started is an ordinary HTTP error; after, it is one record ``{"status_code", "error", ...}`` and
the stream ends.

finish_reason: ``eos_token`` (an end-of-sequence token), ``stop_sequence`` (one of
stop_sequences matched), ``length`` (max_new_tokens), ``function_call`` (a call was parsed).
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
from dataclasses import dataclass, field

from aiohttp import web

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade.afs_errors import afs_error_body
from sluice.http_facade.afs_functions import find_call
from sluice.http_facade.afs_protocol import AfsGeneration
from sluice.http_facade.errors import ApiError, engine_failure, unavailable
from sluice.http_facade.generation import RequestTimer, run_plan
from sluice.http_facade.request_context import TIMER
from sluice.http_facade.protocol import GenerationPlan
from sluice.http_facade.sse import SSEWriter
from sluice.http_facade.state import FacadeState

_MIN_LOGPROB = -9999.0   # JSON has no -Infinity
# Engine field names → the AFS parameter a client sent.
_PARAM_NAMES = {"max_tokens": "max_new_tokens", "repetition_penalty": "frequence_penalty",
                "stop": "stop_sequences", "prompt": "inputs", "text": "inputs", "infill": "inputs"}


def afs_error(err: ApiError) -> ApiError:
    """An engine error (OpenAI parameter names) in AFS terms."""
    name = _PARAM_NAMES.get(err.param or "")
    if name is None:
        return err
    message = err.message
    if message.startswith(f"{err.param}:"):
        message = name + message[len(err.param):]
    message = message.replace("max_tokens", "max_new_tokens")
    return ApiError(err.status, message, err.type, name, err.code, err.headers)


def finish_reason(final: pb.ChoiceFinal) -> str:
    if final.finish_reason == pb.FINISH_REASON_LENGTH:
        return "length"
    if final.finish_reason == pb.FINISH_REASON_STOP:
        return "stop_sequence" if final.WhichOneof("matched_stop") == "stop_string" else "eos_token"
    if final.finish_reason == pb.FINISH_REASON_ABORT:
        raise unavailable("the request was aborted by the engine (it is shutting down or draining)")
    raise engine_failure(final.error)


def _token_details(items: list[pb.TokenLogprob]) -> list[dict]:
    return [{"id": lp.token_id, "text": lp.token,
             "logprob": lp.logprob if math.isfinite(lp.logprob) else _MIN_LOGPROB} for lp in items]


def record(text: str, details: dict | None = None) -> dict:
    return {"generated_text": text, "function_call": None, "details": details, "total_time_taken": None,
            "prompt_tokens": 0, "generated_tokens": 0, "total_tokens": 0, "finish_reason": None}


@dataclass
class _Answer:
    """One request's output, accumulated over the engine stream."""
    gen: AfsGeneration
    timer: RequestTimer
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    final: pb.ChoiceFinal | None = None

    def add(self, delta: pb.ChoiceDelta) -> None:
        self.timer.on_tokens(len(delta.token_ids))
        self.text.append(delta.text)
        self.logprobs.extend(delta.logprobs)
        if delta.HasField("final"):
            self.final = delta.final

    def details(self, items: list[pb.TokenLogprob]) -> dict | None:
        return {"tokens": _token_details(items)} if self.gen.params.show_probabilities else None

    def finish(self, rec: dict) -> dict:
        """Fill ``rec`` with the totals (and a parsed function call)."""
        if self.final is None:
            raise ApiError(502, "the engine ended the stream before the answer finished", "server_error")
        reason = finish_reason(self.final)
        prompt, generated = self.final.usage.prompt_tokens, self.final.usage.completion_tokens
        self.timer.prompt_tokens, self.timer.completion_tokens = prompt, generated
        call = find_call("".join(self.text), self.gen.functions) if self.gen.functions else None
        if call is not None:
            rec["function_call"], reason = call.body(), "function_call"
        rec.update(total_time_taken=f"{self.timer.elapsed():.2f} sec", prompt_tokens=prompt,
                   generated_tokens=generated, total_tokens=prompt + generated, finish_reason=reason)
        return rec

    def answer(self) -> dict:
        text = "".join(self.text)
        rec = self.finish(record(text, self.details(self.logprobs)))
        if rec["function_call"] is not None:
            rec["generated_text"] = find_call(text, self.gen.functions).text
        return rec

    def records(self, delta: pb.ChoiceDelta) -> list[dict]:
        """One record per token of ``delta`` (its text on the last); the final one with totals."""
        n = max(1, len(delta.token_ids))
        lps = list(delta.logprobs)
        out = [record("", self.details(lps[i:i + 1])) for i in range(n - 1)]
        out.append(record(delta.text, self.details(lps[n - 1:])))
        if delta.HasField("final"):
            self.finish(out[-1])
        return out


class _AfsSSE(SSEWriter):
    async def ping(self) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)
        await self._write(f"event: ping\ndata: {now}\n\n")

    async def send_error(self, err: ApiError) -> None:
        await self.send(afs_error_body(err))


async def run_afs(request: web.Request, state: FacadeState, gen: AfsGeneration, model: pb.ModelInfo,
                  request_id: str, ping_interval_s: float) -> web.StreamResponse:
    plan = GenerationPlan("completion", model.name, (gen.request,), 1, gen.stream, False,
                          gen.params.show_probabilities, 0, False, None)
    answer = _Answer(gen, RequestTimer(request_id, request.path, model.name))
    request[TIMER] = answer.timer
    try:
        async with contextlib.aclosing(run_plan(state.link, plan, request_id, state.ending)) as stream:
            if gen.stream:
                return await _stream(request, answer, stream, ping_interval_s)
            async for _, msg in stream:
                for delta in msg.choices:
                    answer.add(delta)
            return web.json_response(answer.answer())
    except ApiError as err:
        raise afs_error(err) from None
    finally:
        state.metrics.observe(answer.timer)


_END = object()


async def _next(iterator, sse: _AfsSSE, ping_interval_s: float):
    """The stream's next item, or ``_END``; pings while waiting."""
    task = asyncio.ensure_future(iterator.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=ping_interval_s)
            if done:
                try:
                    return task.result()
                except StopAsyncIteration:
                    return _END
            await sse.ping()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _stream(request: web.Request, answer: _Answer, stream, ping_interval_s: float) -> web.StreamResponse:
    sse = _AfsSSE(request)
    iterator = stream.__aiter__()
    try:
        while (item := await _next(iterator, sse, ping_interval_s)) is not _END:
            for delta in item[1].choices:
                answer.add(delta)
                for rec in answer.records(delta):
                    await sse.send(rec)
        if answer.final is None:
            raise ApiError(502, "the engine ended the stream before the answer finished", "server_error")
    except ApiError as err:
        if not sse.prepared:
            raise
        await sse.send_error(afs_error(err))
    return await sse.finish()
