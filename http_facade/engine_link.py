"""The facade's one connection to the engine: a grpc.aio channel and the generated stubs.

Unary calls carry a short deadline so that a dead engine turns into a 503 quickly instead of a
hung request. Every EngineService call carries the current span's ``traceparent`` (when tracing
is on), so that the engine's span of any RPC joins the HTTP request's trace.

``open_stream`` yields a Generate call and, on leaving (client gone, error,
handler cancelled), cancels it and sends ``Abort`` for its request id, so that the engine frees
the request's KV blocks within one step even if the cancellation races the stream's end.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc import engine_pb2_grpc as pb_grpc
from sluice.engine.rpc.tracing import outgoing_metadata

log = logging.getLogger("sluice.facade.engine")

_MAX_MESSAGE_BYTES = 64 << 20
_UNARY_TIMEOUT_S = 10.0
_MODELS_TTL_S = 5.0
# Embed / Rerank run a whole batch through the encoder in one call: give them longer.
_ENCODER_TIMEOUT_FACTOR = 6


# Reconnect within a second of an engine (re)starting: gRPC's default backoff grows to 120 s, so
# an engine that loads for 10 s, or comes back after a crash, would be reached only much later.
_RECONNECT = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
              ("grpc.max_reconnect_backoff_ms", 1000))


class EngineLink:
    def __init__(self, address: str, unary_timeout_s: float = _UNARY_TIMEOUT_S) -> None:
        self.address = address
        self.unary_timeout_s = unary_timeout_s
        self._channel: grpc.aio.Channel | None = None   # opened on first use, inside the event loop
        self._models: tuple[float, tuple[pb.ModelInfo, ...]] | None = None

    def _open(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(
                self.address, options=[("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                                       ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                                       *_RECONNECT])
        return self._channel

    @property
    def _stub(self) -> pb_grpc.EngineServiceStub:
        return pb_grpc.EngineServiceStub(self._open())

    @property
    def _health(self) -> health_pb2_grpc.HealthStub:
        return health_pb2_grpc.HealthStub(self._open())

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    # ---- generation -------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def open_stream(self, request: pb.GenerateRequest) -> AsyncIterator[grpc.aio.UnaryStreamCall]:
        call = self._stub.Generate(request, metadata=outgoing_metadata())
        try:
            yield call
        finally:
            if not call.done():
                call.cancel()
            if call.cancelled():   # by us just now, or by the task's cancellation while it awaited
                # shield: the abort must go out even when the handler itself is being cancelled
                await asyncio.shield(self._abort_quietly(request.request_id))

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await self._stub.Abort(pb.AbortRequest(request_ids=[request_id]), timeout=2.0, metadata=outgoing_metadata())
        except grpc.aio.AioRpcError as err:
            log.debug("abort of %s failed: %s", request_id, err.code().name)

    # ---- unary ------------------------------------------------------------------------------
    async def serving(self) -> bool:
        """True when the engine's health service reports SERVING."""
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    async def list_models(self) -> tuple[pb.ModelInfo, ...]:
        now = time.monotonic()
        if self._models is not None and now - self._models[0] < _MODELS_TTL_S:
            return self._models[1]
        resp = await self._stub.ListModels(pb.ListModelsRequest(), timeout=self.unary_timeout_s,
                                           metadata=outgoing_metadata())
        models = tuple(resp.models)
        self._models = (now, models)
        return models

    async def get_load(self) -> pb.GetLoadResponse:
        return await self._stub.GetLoad(pb.GetLoadRequest(), timeout=self.unary_timeout_s, metadata=outgoing_metadata())

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        resp = await self._stub.Detokenize(pb.DetokenizeRequest(token_ids=token_ids,
                                                                skip_special_tokens=skip_special_tokens),
                                           timeout=self.unary_timeout_s, metadata=outgoing_metadata())
        return resp.text

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        return await self._stub.Tokenize(request, timeout=self.unary_timeout_s, metadata=outgoing_metadata())

    async def embed(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        return await self._stub.Embed(request, timeout=self.unary_timeout_s * _ENCODER_TIMEOUT_FACTOR,
                                      metadata=outgoing_metadata())

    async def rerank(self, request: pb.RerankRequest) -> pb.RerankResponse:
        return await self._stub.Rerank(request, timeout=self.unary_timeout_s * _ENCODER_TIMEOUT_FACTOR,
                                       metadata=outgoing_metadata())
