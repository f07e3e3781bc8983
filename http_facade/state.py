"""The facade's configuration (frozen) and its per-app state (engine link, metrics, traces)."""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field

from aiohttp import web

from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc.tracing import Tracing
from sluice.http_facade.auth import AuthPolicy
from sluice.http_facade.cors import CorsPolicy
from sluice.http_facade.engine_pool import POLICIES, EnginePool
from sluice.http_facade.errors import ApiError, not_found
from sluice.http_facade.limits import RequestLimits
from sluice.http_facade.metrics import FacadeMetrics

DEFAULT_MAX_BODY_BYTES = 8 << 20
_TRACE_KEEP = 1024


@dataclass(frozen=True)
class FacadeConfig:
    engine_addr: str = "127.0.0.1:50051"
    # Several engines (``--engine`` repeated): when set, these, and ``engine_addr`` is ignored.
    engine_addrs: tuple[str, ...] = ()
    routing: str = "prefix"           # engine_pool.POLICIES
    auth: AuthPolicy = field(default_factory=AuthPolicy)
    cors: CorsPolicy = field(default_factory=CorsPolicy)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    enable_tracing: bool = False
    # chat max_tokens when a client sends none; None: until a stop or the context window (OpenAI)
    default_max_tokens: int | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    # A connection waiting for a request (idle keep-alive, or headers dribbled slowly) is closed
    # after idle_timeout_s; a request body that has not fully arrived after body_timeout_s is a 408.
    idle_timeout_s: float = 15.0
    body_timeout_s: float = 30.0
    # --served-model-name: the names clients use for the main model (served_names.py); () = its own
    served_model_names: tuple[str, ...] = ()
    request_log: str = "off"              # "json": one JSON line per request (request_context.py)
    otlp_traces_endpoint: str | None = None   # OTLP/HTTP traces endpoint (engine/rpc/tracing.py)

    def __post_init__(self) -> None:
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be a positive integer, got {self.max_body_bytes!r}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens: must be >= 1, got {self.default_max_tokens}")
        for name in ("idle_timeout_s", "body_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name}: must be a positive number of seconds, got {v!r}")
        for addr in self.engines:
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"engine_addr: expected HOST:PORT, got {addr!r}")
        if len(set(self.engines)) != len(self.engines):
            raise ValueError(f"engine_addr: an engine is named twice in {', '.join(self.engines)}")
        if any(not isinstance(n, str) or not n.strip() for n in self.served_model_names):
            raise ValueError(f"served_model_names: names must be non-empty, got {list(self.served_model_names)!r}")
        if self.request_log not in ("off", "json"):
            raise ValueError(f"request_log: must be off or json, got {self.request_log!r}")
        if self.routing not in POLICIES:
            raise ValueError(f"routing: must be one of {', '.join(POLICIES)}, got {self.routing!r}")

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(self.engine_addrs) or (self.engine_addr,)


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


__all__ = ["ApiError", "FacadeConfig", "FacadeState", "STATE_KEY", "state_of"]
