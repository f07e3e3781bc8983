"""The ``sluice.v1.EngineService`` servicer: thin. Messages are converted at entry and exit
(``sluice.engine.rpc.convert``, ``sluice.engine.rpc.convert_embed``); exceptions become status codes in
``sluice.engine.rpc.status``. Embed / Rerank run on the engine's embedding worker thread."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import uuid
from typing import AsyncIterator

import grpc

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.errors import UnsupportedError
from sluice.engine.rpc import convert, convert_embed
from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc import engine_pb2_grpc as pb_grpc
from sluice.engine.rpc.tracing import Tracing
from sluice.engine.sampling_params import SamplingParams

_INPUT_ERROR = "ValueError: "
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EngineService"].full_name   # "sluice.v1.EngineService"


def _spanned(joined_only: bool = False):
    """A unary RPC in a SERVER span ``sluice.engine/<RPC>`` when tracing is on, the child of the
    caller's ``traceparent``. ``joined_only``: a span only when the caller sent a traceparent, for
    the RPCs that routers and the facade poll on their own (GetLoad, ListModels): a root span per
    poll would bury the requests' traces."""
    def wrap(method):
        name = f"sluice.engine/{method.__name__}"

        @functools.wraps(method)
        async def call(self: EngineServicer, request, context: grpc.aio.ServicerContext):
            metadata = context.invocation_metadata() if self.tracing is not None else None
            if metadata is None or (joined_only and not any(k == "traceparent" for k, _ in metadata)):
                return await method(self, request, context)
            with self.tracing.server_span(name, metadata):
                return await method(self, request, context)
        return call
    return wrap


class EngineServicer(pb_grpc.EngineServiceServicer):
    def __init__(self, engine: AsyncEngine, tracing: Tracing | None = None) -> None:
        self.engine = engine
        self.tracing = tracing     # a span per call, the child of the caller's traceparent
        self._pieces: convert.TokenPieces | None = None

    # ---- Generate -------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[pb.GenerateResponse]:
        if self.tracing is None:
            async for msg in self._generate(request, context):
                yield msg
            return
        attributes = {"sluice.request_id": request.request_id, "sluice.input": request.WhichOneof("input") or ""}
        with self.tracing.server_span("sluice.engine/Generate", context.invocation_metadata(), attributes) as span:
            async with contextlib.aclosing(self._generate(request, context)) as stream:
                async for msg in stream:
                    for c in msg.choices:
                        if c.HasField("final"):
                            span.set_attribute("sluice.completion_tokens", c.final.usage.completion_tokens)
                            span.set_attribute("sluice.prompt_tokens", c.final.usage.prompt_tokens)
                    yield msg

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pb.GenerateResponse]:
        params = convert.sampling_from_proto(request.sampling, self.engine.core.config.limits)
        if request.WhichOneof("input") == "infill":
            prompt, add_special, params = await self._infill(request.infill, params)
        else:
            prompt, add_special = await self._prompt(request)
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        core = self.engine.core
        token_text = functools.lru_cache(maxsize=4096)(lambda t: core.tokenizer.decode([t], skip_special_tokens=False))
        first = True
        errors: list[str] = []
        stream = self.engine.generate(request_id, prompt, params, add_special)
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield convert.output_to_proto(out, token_text, first)
                first = False
                errors += [d.error or "engine fault" for d in out.deltas if d.finish_reason == "error"]
        if errors:
            # The final records already carry finish_reason ERROR; the call's status says it too.
            # A ValueError met while running is the request's own input proving impossible (a
            # grammar this tokenizer cannot spell): the client's error, not the server's.
            if errors[0].startswith(_INPUT_ERROR):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, errors[0][len(_INPUT_ERROR):])
            await context.abort(grpc.StatusCode.INTERNAL, f"request {request_id} failed: {errors[0]}")

    async def _prompt(self, request: pb.GenerateRequest) -> tuple[str | list[int], bool]:
        kind = request.WhichOneof("input")
        explicit = request.add_special_tokens if request.HasField("add_special_tokens") else None
        if kind == "text":
            if not request.text:
                raise ValueError("text: must not be empty")
            return request.text, True if explicit is None else explicit
        if kind == "token_ids":
            if not request.token_ids.ids:
                raise ValueError("token_ids: must hold at least one token id")
            return list(request.token_ids.ids), False
        if kind == "chat":
            text = await self._render(request.chat)
            return text, False if explicit is None else explicit
        raise ValueError("input: one of text, token_ids, chat or infill is required")

    async def _infill(self, infill: pb.InfillInput, params: SamplingParams
                      ) -> tuple[list[int], bool, SamplingParams]:
        """The FIM prompt's ids, and the params with the model's end-of-infill token as a stop."""
        built = await asyncio.to_thread(self.engine.core.render_infill, infill.prefix, infill.suffix)
        extra = [t for t in built.stop_token_ids if t not in params.stop_token_ids]
        return built.token_ids, False, dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *extra])

    async def _render(self, chat: pb.ChatInput) -> str:
        messages, tools, add_gen = convert.chat_from_proto(chat)
        core = self.engine.core
        if "chat" not in core.model_info.capabilities:
            raise UnsupportedError(f"chat: model {core.model_info.name} has no chat template")
        return await asyncio.to_thread(core.render_chat, messages, tools, add_gen)

    # ---- unary RPCs ---------------------------------------------------------------------------
    @_spanned()
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_ids or not all(request.request_ids):
            raise ValueError("request_ids: must hold at least one non-empty request id")
        return pb.AbortResponse(aborted=self.engine.abort(request.request_ids))

    @_spanned()
    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        core = self.engine.core
        explicit = request.add_special_tokens if request.HasField("add_special_tokens") else None
        kind = request.WhichOneof("input")
        if kind == "chat":
            text = await self._render(request.chat)
            ids = await asyncio.to_thread(core.encode_prompt, text, bool(explicit))
            resp = pb.TokenizeResponse(token_ids=ids, prompt=text, max_model_len=core.model_info.max_model_len)
        elif kind != "text" or not request.text:
            raise ValueError("input: a non-empty text or chat is required")
        else:
            add = True if explicit is None else explicit
            ids = await asyncio.to_thread(core.encode_prompt, request.text, add)
            resp = pb.TokenizeResponse(token_ids=ids, max_model_len=core.model_info.max_model_len)
        if request.with_pieces:
            if self._pieces is None:
                self._pieces = convert.TokenPieces(core.tokenizer)
            resp.pieces.extend(await asyncio.to_thread(self._pieces.pieces, ids))
            resp.spellings.extend(self._pieces.spellings(ids))
        return resp

    @_spanned()
    async def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
                         ) -> pb.DetokenizeResponse:
        core = self.engine.core
        vocab = core.model_info.vocab_size
        bad = next((t for t in request.token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token_ids: token id {bad} is outside the vocabulary (size {vocab})")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        text = await asyncio.to_thread(core.tokenizer.decode, list(request.token_ids), skip_special_tokens=skip)
        return pb.DetokenizeResponse(text=text)

    @_spanned(joined_only=True)
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> pb.GetModelInfoResponse:
        info = convert.model_info_to_proto(self.engine.model_info, self.engine.embedding)
        return pb.GetModelInfoResponse(model=info)

    @_spanned(joined_only=True)
    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ListModelsResponse:
        info = convert.model_info_to_proto(self.engine.model_info, self.engine.embedding)
        return pb.ListModelsResponse(models=[info])

    @_spanned(joined_only=True)
    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.GetLoadResponse:
        load = await self.engine.get_load()
        return convert.load_to_proto(load, self.engine.num_in_flight)

    # ---- embeddings and rerank -------------------------------------------------------------------
    @_spanned()
    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        emb = self.engine.embedding
        if emb is None or emb.model is None:
            raise UnsupportedError("Embed: this engine serves no embedding model; start it with --embedding-model")
        model = emb.model
        args = convert_embed.embed_from_proto(request, model)
        result = await self.engine.embed(
            lambda e: e.embed(args.inputs, normalize=args.normalize, dimensions=args.dimensions, prefix=args.prefix))
        convert_embed.check_truncation(args, result, model.max_length)
        return convert_embed.embed_to_proto(result, model.name)

    @_spanned()
    async def Rerank(self, request: pb.RerankRequest, context: grpc.aio.ServicerContext) -> pb.RerankResponse:
        if self.engine.embedding is None:
            raise UnsupportedError("Rerank: this engine serves no embedding or rerank model; start it with "
                                   "--embedding-model (cosine) or --rerank-model (cross-encoder)")
        args = convert_embed.rerank_from_proto(request)
        return await self.engine.embed(lambda e: convert_embed.run_rerank(e, args))
