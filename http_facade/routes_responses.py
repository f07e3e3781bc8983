"""``/v1/responses``: create (streaming or not), retrieve and delete; the request's translation
to the chat path is ``responses_protocol``.

Streaming answers are server-sent events with OpenAI's event names (``event: <type>`` and a
``data:`` object carrying ``type`` and ``sequence_number``): ``response.created``,
``response.in_progress``, then per output item ``response.output_item.added``, for a message
``response.content_part.added``, ``response.output_text.delta``... ``response.output_text.done``,
``response.content_part.done``, for a function call ``response.function_call_arguments.delta``
and ``.done``, then ``response.output_item.done``; last ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut the answer). An error after the stream
began is an ``error`` event followed by ``response.failed``. As with chat, the SSE response is
prepared only after the engine's first message, so that an error it reports up front is a plain
HTTP error.

Stored responses (``store``, default true) live in a bounded in-memory LRU (``ResponseStore``):
the response object, and the conversation that ``previous_response_id`` continues from.

``background: true``: the response is stored ``queued`` and returned at once; a task on the
facade's loop (``Background``) runs the generation, storing it ``in_progress`` then finished
(``completed``, ``incomplete`` or ``failed``), which ``GET /v1/responses/{id}`` shows.
``POST /v1/responses/{id}/cancel`` cancels the task, which closes the engine stream (the engine
request is aborted and its KV freed, as for a client that goes away) and stores it ``cancelled``.
The store's bounds hold for them as for any response: an evicted one is not found, though its
task still runs to its end. Deleting a running one cancels it.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from dataclasses import dataclass

from aiohttp import web

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade import api_models
from sluice.http_facade import responses_protocol as rp
from sluice.http_facade import shapes
from sluice.http_facade.errors import ApiError, bad_request, not_found
from sluice.http_facade.generation import RequestTimer, first_of, run_plan, usage_of
from sluice.http_facade.json_body import read_json
from sluice.http_facade.request_context import TIMER, request_id_of
from sluice.http_facade.sse import SSEWriter
from sluice.http_facade.state import FacadeState, state_of
from sluice.http_facade.tools import CallScanner, split_calls

log = logging.getLogger("sluice.facade.responses")

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 << 20


@dataclass
class _Stored:
    response: dict
    conversation: list[dict]      # input messages then output messages: what a continuation sees
    size: int


class ResponseStore:
    """At most ``max_entries`` responses and about ``max_bytes`` of their JSON; the least recently
    used go first."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries, max_bytes: must be >= 1")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: collections.OrderedDict[str, _Stored] = collections.OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict, conversation: list[dict]) -> None:
        size = len(rp.dumps(response)) + len(rp.dumps(conversation))
        self.delete(response["id"])
        self._items[response["id"]] = _Stored(response, conversation, size)
        self.bytes += size
        while len(self._items) > self.max_entries or (self.bytes > self.max_bytes and len(self._items) > 1):
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size

    def get(self, resp_id: str) -> _Stored | None:
        item = self._items.get(resp_id)
        if item is not None:
            self._items.move_to_end(resp_id)
        return item

    def delete(self, resp_id: str) -> bool:
        item = self._items.pop(resp_id, None)
        if item is not None:
            self.bytes -= item.size
        return item is not None


STORE_KEY: web.AppKey[ResponseStore] = web.AppKey("sluice_responses", ResponseStore)


def _store(request: web.Request) -> ResponseStore:
    return request.app[STORE_KEY]


def _previous(store: ResponseStore, body: dict) -> list[dict] | None:
    prev = body.get("previous_response_id")
    if prev is None:
        return None
    if not isinstance(prev, str):
        raise bad_request("previous_response_id: must be a string", "previous_response_id")
    item = store.get(prev)
    if item is None:
        raise bad_request(f"previous_response_id: no stored response with id '{prev}' (it was never stored, "
                          "was deleted, or was evicted)", "previous_response_id", "previous_response_not_found")
    if item.response["status"] in _UNFINISHED:
        raise bad_request(f"previous_response_id: response '{prev}' is still {item.response['status']}",
                          "previous_response_id")
    return item.conversation


_UNFINISHED = ("queued", "in_progress")


class Background:
    """The tasks of background responses, by response id (an app's; cancelled on cleanup)."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task] = {}

    def start(self, resp_id: str, work) -> None:
        task = asyncio.ensure_future(work)
        self.tasks[resp_id] = task
        task.add_done_callback(lambda _: self.tasks.pop(resp_id, None))

    async def cancel(self, resp_id: str) -> bool:
        """Cancel a running one and wait until its engine stream is closed; False if none runs."""
        task = self.tasks.get(resp_id)
        if task is None:
            return False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True

    async def close(self, app: web.Application) -> None:
        for resp_id in list(self.tasks):
            await self.cancel(resp_id)


BACKGROUND_KEY: web.AppKey[Background] = web.AppKey("sluice_background_responses", Background)


# ---------------------------------------------------------------------------------- routes
async def retrieve(request: web.Request) -> web.Response:
    item = _store(request).get(request.match_info["response_id"])
    if item is None:
        raise _missing(request.match_info["response_id"])
    return web.json_response(item.response)


async def delete(request: web.Request) -> web.Response:
    resp_id = request.match_info["response_id"]
    await request.app[BACKGROUND_KEY].cancel(resp_id)
    if not _store(request).delete(resp_id):
        raise _missing(resp_id)
    return web.json_response({"id": resp_id, "object": "response", "deleted": True})


async def cancel(request: web.Request) -> web.Response:
    """Cancel a background response: ``cancelled`` if it was queued or running; one that already
    finished is answered as it is (as OpenAI does); a response made without ``background`` is a 400."""
    resp_id, store = request.match_info["response_id"], _store(request)
    item = store.get(resp_id)
    if item is None:
        raise _missing(resp_id)
    if not item.response.get("background"):
        raise bad_request(f"response_id: only a response created with background true can be cancelled; "
                          f"'{resp_id}' was not", "response_id")
    await request.app[BACKGROUND_KEY].cancel(resp_id)
    item = store.get(resp_id)
    if item is None:                        # evicted meanwhile
        raise _missing(resp_id)
    if item.response["status"] in _UNFINISHED:
        item.response.update(status="cancelled")
    return web.json_response(item.response)


def _missing(resp_id: str) -> ApiError:
    return not_found(f"no stored response with id '{resp_id}'", "response_id", "response_not_found")


async def create(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body = await read_json(request, state.config.body_timeout_s)
    api_models.check(api_models.ResponseCreateRequest, body)
    req = rp.parse_request(body, _previous(_store(request), body))
    plan = rp.parse_chat(req, state.config.default_max_tokens, state.config.limits)
    model = await state.resolve_model(plan.model)
    run = _ResponseRun(state, req, plan, model.name)
    if req.background:
        queued = run.object("queued")
        _store(request).put(queued, req.conversation)
        request.app[BACKGROUND_KEY].start(run.id, _in_background(run, _store(request)))
        return web.json_response(queued)
    request[TIMER] = run.timer
    outcome = "error"
    try:
        async with contextlib.aclosing(run_plan(state.link, plan, request_id_of(request), state.ending)) as stream:
            response = await (_stream(request, run, stream) if req.stream else _collect(run, stream))
        outcome = "ok"
        return response
    except ApiError as err:
        raise rp.renamed(err) from None
    finally:
        run.close(outcome, _store(request))


class _ResponseRun:
    """One response being generated: its id, echo fields, text, calls, usage."""

    def __init__(self, state: FacadeState, req: rp.ResponsesRequest, plan, model: str) -> None:
        self.state, self.req, self.plan = state, req, plan
        self.id = rp.new_id("resp")
        self.created = rp.now()
        self.echo = {**req.echo, "model": model}
        self.timer = RequestTimer(self.id, "/v1/responses", model)
        self.text: list[str] = []
        self.final: pb.ChoiceFinal | None = None
        self.output: list[dict] = []
        self.failed = False           # a streamed answer ended with an error event
        self.logprobs: list[pb.TokenLogprob] = []      # include: message.output_text.logprobs

    def add(self, msg: pb.GenerateResponse) -> list[pb.ChoiceDelta]:
        for delta in msg.choices:
            self.timer.on_tokens(len(delta.token_ids))
            self.text.append(delta.text)
            self.logprobs.extend(delta.logprobs)
            if delta.HasField("final"):
                self.final = delta.final
                err = shapes.finish_error(delta.final)
                if err is not None:
                    raise err
        return list(msg.choices)

    def usage(self) -> dict | None:
        if self.final is None:
            return None
        prompt, completion, cached = usage_of({0: self.final}, 1)
        self.timer.prompt_tokens, self.timer.completion_tokens = prompt, completion
        return rp.usage(prompt, completion, cached)

    def object(self, status: str | None = None, error: dict | None = None) -> dict:
        incomplete = None
        if status is None:
            length = self.final is not None and self.final.finish_reason == pb.FINISH_REASON_LENGTH
            status, incomplete = ("incomplete", "max_output_tokens") if length else ("completed", None)
        return rp.response_object(self.id, self.created, self.echo, status, self.output, self.usage(),
                                  self.req.store, incomplete, error)

    def close(self, outcome: str, store: ResponseStore) -> None:
        self.usage()
        self.state.metrics.observe(self.timer)
        if outcome == "ok" and not self.failed and self.req.store:
            store.put(self.object(), self.req.conversation + rp.output_messages(self.output))


async def _in_background(run: _ResponseRun, store: ResponseStore) -> None:
    """A background response's generation; the engine request id is the response id (the
    client's X-Request-Id is free again once the create call answered)."""
    conversation = run.req.conversation
    outcome = "error"
    try:
        store.put(run.object("in_progress"), conversation)
        async with contextlib.aclosing(run_plan(run.state.link, run.plan, run.id, run.state.ending)) as stream:
            await _gather(run, stream)
        outcome = "ok"
    except ApiError as err:
        err = rp.renamed(err)
        store.put(run.object("failed", {"code": err.code or err.type, "message": err.message}), conversation)
    except Exception:  # noqa: BLE001 - no one awaits this task: the stored status must still end
        log.exception("background response %s failed", run.id)
        store.put(run.object("failed", {"code": "server_error", "message": "internal error"}), conversation)
    finally:
        run.close(outcome, store)


async def _collect(run: _ResponseRun, stream) -> web.Response:
    await _gather(run, stream)
    return web.json_response(run.object())


async def _gather(run: _ResponseRun, stream) -> None:
    """The whole answer into ``run.output``."""
    async for _, msg in stream:
        run.add(msg)
    if run.final is None:
        raise ApiError(502, "the engine ended the stream before the answer finished", "server_error")
    text = "".join(run.text)
    calls: list[dict] = []
    if run.plan.tool_calls:
        content, calls = split_calls(text, run.plan.tool_names)
        text = content or ""
    if text or not calls:
        logprobs = shapes.chat_logprobs(run.logprobs)["content"]
        run.output.append(rp.message_item(rp.new_id("msg"), text, logprobs=logprobs))
    run.output.extend(rp.call_item(rp.new_id("fc"), c) for c in calls)


class _Events:
    """The SSE events of one streamed response, numbered."""

    def __init__(self, sse: SSEWriter) -> None:
        self.sse = sse
        self.seq = 0

    async def send(self, kind: str, **fields) -> None:
        await self.sse.send_event(kind, {"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1


class _StreamItems:
    """Turns chat deltas (content / tool_calls, as ``CallScanner`` or plain text give them) into
    output items and their events."""

    def __init__(self, run: _ResponseRun, events: _Events) -> None:
        self.run, self.events = run, events
        self.message: dict | None = None      # the message item open now
        self.message_text: list[str] = []
        self.message_logprobs: list[dict] = []
        self.call: dict | None = None         # the function call being sent

    async def content(self, text: str, logprobs: list[dict]) -> None:
        if self.message is None:
            self.message = rp.message_item(rp.new_id("msg"), "", "in_progress")
            self.message_text, self.message_logprobs = [], []
            await self.events.send("response.output_item.added", output_index=len(self.run.output),
                                   item=self.message)
            await self.events.send("response.content_part.added", item_id=self.message["id"],
                                   output_index=len(self.run.output), content_index=0, part=rp.text_part(""))
        self.message_text.append(text)
        self.message_logprobs.extend(logprobs)
        await self.events.send("response.output_text.delta", item_id=self.message["id"],
                               output_index=len(self.run.output), content_index=0, delta=text, logprobs=logprobs)

    async def close_message(self) -> None:
        if self.message is None:
            return
        text, index, item_id = "".join(self.message_text), len(self.run.output), self.message["id"]
        logprobs = self.message_logprobs
        await self.events.send("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                               text=text, logprobs=logprobs)
        await self.events.send("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                               part=rp.text_part(text, logprobs))
        item = rp.message_item(item_id, text, logprobs=logprobs)
        await self.events.send("response.output_item.done", output_index=index, item=item)
        self.run.output.append(item)
        self.message = None

    async def tool_call(self, delta: dict) -> None:
        """Two deltas per call (``CallScanner``): id and name, then the whole arguments."""
        call = delta["tool_calls"][0]
        if "id" in call:
            await self.close_message()
            index = len(self.run.output)
            self.call = rp.call_item(rp.new_id("fc"), call, "in_progress")
            await self.events.send("response.output_item.added", output_index=index, item=self.call)
            return
        args, index = call["function"]["arguments"], len(self.run.output)
        assert self.call is not None
        await self.events.send("response.function_call_arguments.delta", item_id=self.call["id"],
                               output_index=index, delta=args)
        await self.events.send("response.function_call_arguments.done", item_id=self.call["id"],
                               output_index=index, name=self.call["name"], arguments=args)
        item = {**self.call, "arguments": args, "status": "completed"}
        await self.events.send("response.output_item.done", output_index=index, item=item)
        self.run.output.append(item)
        self.call = None

    async def feed(self, bodies: list[dict]) -> None:
        for body in bodies:
            if body.get("tool_calls"):
                await self.tool_call(body)
            elif body.get("content") or body.get("logprobs"):   # a token may end inside a character
                await self.content(body["content"], body.get("logprobs", []))


async def _stream(request: web.Request, run: _ResponseRun, stream) -> web.StreamResponse:
    first, iterator = await first_of(stream)
    sse = SSEWriter(request)
    events = _Events(sse)
    items = _StreamItems(run, events)
    scanner = CallScanner(run.plan.tool_names) if run.plan.tool_calls else None
    await events.send("response.created", response=run.object("in_progress"))
    await events.send("response.in_progress", response=run.object("in_progress"))
    try:
        msg = first[1]
        while True:
            for delta in run.add(msg):
                await items.feed(scanner.feed(delta.text) if scanner else
                                 [{"content": delta.text, "logprobs": shapes.chat_logprobs(delta.logprobs)["content"]}])
            try:
                msg = (await iterator.__anext__())[1]
            except StopAsyncIteration:
                break
        if scanner is not None:
            await items.feed(scanner.finish())
        await items.close_message()
        if run.final is None:
            raise ApiError(502, "the engine ended the stream before the answer finished", "server_error")
    except ApiError as err:
        err = rp.renamed(err)
        run.failed = True
        await events.send("error", code=err.code or err.type, message=err.message, param=err.param)
        await events.send("response.failed", response=run.object("failed", {"code": err.code or err.type,
                                                                              "message": err.message}))
        return await sse.finish()
    done = run.object()
    await events.send("response.completed" if done["status"] == "completed" else "response.incomplete",
                      response=done)
    return await sse.finish()
