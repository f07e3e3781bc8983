"""The facade's per-app state (engine link, metrics, traces); its configuration is ``config.FacadeConfig``."""
from __future__ import annotations

import asyncio
import collections
import time

from aiohttp import web

from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc.tracing import Tracing
# FacadeConfig and DEFAULT_MAX_BODY_BYTES live in config.py (no aiohttp there); the app's modules
# and the tests read them here too.
from sluice.http_facade.config import DEFAULT_MAX_BODY_BYTES, FacadeConfig
from sluice.http_facade.engine_pool import EnginePool
from sluice.http_facade.errors import ApiError, not_found
from sluice.http_facade.metrics import FacadeMetrics

_TRACE_KEEP = 1024


class FacadeState:
    def __init__(self, config: FacadeConfig, link: EnginePool, tracing: Tracing | None = None) -> None:
        self.config = config
        self.link = link          # the engines: one per --engine (wrapped by ServedNames when aliased)
        self.tracing = tracing    # --otlp-traces-endpoint: a span per request (request_context.py)
        self.metrics = FacadeMetrics()
        self.started = int(time.time())
        self.traces: collections.deque[dict] = collections.deque(maxlen=_TRACE_KEEP)
        # Shutdown: ``draining`` refuses new generation requests (503); ``ending`` is set when the
        # grace period is over and ends every stream still open with an error event.
        self.draining = False
        self.ending = asyncio.Event()

    async def resolve_model(self, name: str) -> pb.ModelInfo:
        """The served model a request names (by name or path); 404 if none."""
        models = await self.link.list_models()
        for m in models:
            if name in (m.name, m.path):
                return m
        served = ", ".join(m.name for m in models) or "none"
        raise not_found(f"The model '{name}' does not exist (served: {served})", "model", "model_not_found")

    def record_trace(self, event: dict) -> None:
        if self.config.enable_tracing:
            self.traces.append(event)


STATE_KEY: web.AppKey[FacadeState] = web.AppKey("sluice_state", FacadeState)


def state_of(request: web.Request) -> FacadeState:
    return request.app[STATE_KEY]


__all__ = ["ApiError", "DEFAULT_MAX_BODY_BYTES", "FacadeConfig", "FacadeState", "STATE_KEY", "state_of"]
