"""``--served-model-name``: the names clients use for the main model, in place of its own.

``ServedNames`` wraps the engine pool. ``list_models`` shows the main model (the first engine's)
once per alias, each copy named by it (``/v1/models`` lists every alias; a response names the
alias it was asked for); the model's own name is no longer accepted, as vLLM does. Every call
that routes by model (streams, tokenize, encoders) turns an alias back into the engine's name.
Other models (engines serving something else) keep their own names. Everything else is the
pool's.
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade.engine_pool import EnginePool


class ServedNames:
    def __init__(self, pool: EnginePool, aliases: tuple[str, ...]) -> None:
        if not aliases or any(not a or not isinstance(a, str) for a in aliases):
            raise ValueError("served_model_names: at least one non-empty name")
        self.pool = pool
        self.aliases = tuple(dict.fromkeys(aliases))
        self._main: str | None = None       # the engine's own name of the main model, once known

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def _real(self, model: str | None) -> str | None:
        return self._main if model in self.aliases and self._main is not None else model

    async def list_models(self) -> tuple[pb.ModelInfo, ...]:
        models = await self.pool.list_models()
        if not models:
            return models
        first = self.pool.engines[0].models
        main = first[0] if first else models[0]
        self._main = main.name
        out = []
        for m in models:
            if m.name != main.name:
                out.append(m)
                continue
            for alias in self.aliases:
                copy = pb.ModelInfo()
                copy.CopyFrom(m)
                copy.name = alias
                out.append(copy)
        return tuple(out)

    def stream(self, request: pb.GenerateRequest, model: str | None = None) -> AsyncIterator[pb.GenerateResponse]:
        return self.pool.stream(request, self._real(model))

    async def detokenize(self, token_ids: list[int], model: str | None = None, skip_special_tokens: bool = False
                         ) -> str:
        return await self.pool.detokenize(token_ids, self._real(model), skip_special_tokens)

    async def tokenize(self, request: pb.TokenizeRequest, model: str | None = None) -> pb.TokenizeResponse:
        return await self.pool.tokenize(request, self._real(model))

    async def embed(self, request: pb.EmbedRequest, model: str | None = None) -> pb.EmbedResponse:
        return await self.pool.embed(request, self._real(model))

    async def rerank(self, request: pb.RerankRequest, model: str | None = None) -> pb.RerankResponse:
        return await self.pool.rerank(request, self._real(model))
