"""Running a ``GenerationPlan`` against the engine: one Generate stream per prompt, merged.

``run_plan`` yields ``(prompt_index, GenerateResponse)`` with every choice index already turned
into the response's global index (``prompt_index * n + j``). Leaving the iterator early (the
client went away, an error) closes every stream, which cancels and aborts its engine request.
``RequestTimer`` measures what the client sees (TTFT, inter-token gaps, end-to-end) for the
metrics and the optional tracing log.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade.engine_pool import EnginePool
from sluice.http_facade.errors import ApiError, from_rpc_error
from sluice.http_facade.protocol import GenerationPlan

log = logging.getLogger("sluice.facade.trace")

_END = object()


async def run_plan(link: EnginePool, plan: GenerationPlan, base_id: str, stop: asyncio.Event | None = None
                   ) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """``link``: the engines (each prompt's stream goes to the one the pool routes it to, by the
    plan's model and the prompt). ``stop``: when it is set (the shutdown grace is over) the
    streams are closed and a 503 ``ApiError`` is raised, which a streaming handler sends as its
    error event."""
    if stop is not None:
        async with contextlib.aclosing(run_plan(link, plan, base_id)) as source:
            async for item in until_set(source, stop):
                yield item
        return
    requests = []
    for i, template in enumerate(plan.requests):
        req = pb.GenerateRequest()
        req.CopyFrom(template)
        req.request_id = f"{base_id}-{i}"
        requests.append(req)
    try:
        if len(requests) == 1:
            async for msg in link.stream(requests[0], plan.model):
                yield 0, msg
        else:
            async for item in _merged(link, requests, plan.n, plan.model):
                yield item
    except grpc.aio.AioRpcError as err:
        raise from_rpc_error(err) from None


async def _merged(link: EnginePool, requests: list[pb.GenerateRequest], n: int, model: str
                  ) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, req: pb.GenerateRequest) -> None:
        try:
            async for msg in link.stream(req, model):
                for c in msg.choices:
                    c.index += i * n
                await queue.put((i, msg))
            await queue.put((i, _END))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
            await queue.put((i, exc))
            raise

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)


async def first_of(stream) -> tuple[object, AsyncIterator]:
    """``(first item, iterator over the rest)`` of a plan's stream; a stream that ends before any
    output is a 502. Streaming handlers wait for it before sending headers, so that an error
    before any output stays a plain HTTP error."""
    iterator = stream.__aiter__()
    try:
        return await iterator.__anext__(), iterator
    except StopAsyncIteration:
        raise ApiError(502, "the engine ended the stream without output", "server_error") from None


async def until_set(source: AsyncIterator, stop: asyncio.Event) -> AsyncIterator:
    """``source``'s items until it ends or ``stop`` is set; then 503 (the source is closed by
    the caller, which cancels its engine streams)."""
    stopper = asyncio.ensure_future(stop.wait())
    iterator = source.__aiter__()
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(iterator.__anext__())
            await asyncio.wait({step, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise ApiError(503, "the server is shutting down: the request was ended before it finished",
                               "service_unavailable", None, "shutting_down")
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        stopper.cancel()
        # Shutdown, or this handler cancelled (the client left): the pending step must end
        # before the caller closes ``source``, which cannot close while a step runs in it.
        if step is not None and not step.done():
            step.cancel()
            with contextlib.suppress(BaseException):
                await step


@dataclass
class RequestTimer:
    """What one HTTP request's client saw, for metrics and tracing."""
    request_id: str
    route: str
    model: str = ""           # the served name the request used (metrics label, request log)
    start: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def on_tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        if self.first_token is None:
            self.first_token = now
        elif self.last_token is not None:
            # a delta carrying k tokens spreads its gap over them
            self.gaps.extend([(now - self.last_token) / count] * count)
        self.last_token = now

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def usage_of(finals: dict[int, pb.ChoiceFinal], n: int) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens: each prompt counted once, every choice's completion."""
    prompt = cached = completion = 0
    per_prompt: dict[int, tuple[int, int]] = {}
    for index, final in finals.items():
        completion += final.usage.completion_tokens
        p, c = per_prompt.get(index // n, (0, 0))
        per_prompt[index // n] = (max(p, final.usage.prompt_tokens), max(c, final.usage.cached_prompt_tokens))
    for p, c in per_prompt.values():
        prompt += p
        cached += c
    return prompt, completion, cached


def usage_body(prompt: int, completion: int, cached: int, finals: dict[int, pb.ChoiceFinal] | None = None) -> dict:
    body = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
    drafts = sum(f.usage.draft_tokens for f in (finals or {}).values())
    if drafts:
        # Speculative decoding, in the fields OpenAI's predicted outputs report: draft tokens the
        # target accepted and rejected (summed over choices).
        accepted = sum(f.usage.accepted_tokens for f in finals.values())
        body["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                             "rejected_prediction_tokens": drafts - accepted}
    return body


def trace(timer: RequestTimer, finals: dict[int, pb.ChoiceFinal], outcome: str) -> dict:
    """One request's events with timings (the engine's queue/schedule times and what the client saw)."""
    engine = {}
    for index, f in sorted(finals.items()):
        t = f.timings
        engine[index] = {name: getattr(t, name) for name in ("queued_s", "ttft_s", "total_s") if t.HasField(name)}
    event = {"request_id": timer.request_id, "route": timer.route, "outcome": outcome,
             "first_token_s": timer.ttft, "finished_s": timer.elapsed(),
             "prompt_tokens": timer.prompt_tokens, "completion_tokens": timer.completion_tokens,
             "engine": engine}
    log.info("trace %s", event)
    return event
