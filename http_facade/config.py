"""The facade's configuration: frozen dataclasses, and the constants its command-line flags name.

Standard library only, like ``auth``, ``cors`` and ``limits`` whose policies it holds: ``sluice
serve``'s supervisor checks the facade's flags through ``FacadeConfig`` before it starts any
process, and the ``sluice`` command line builds its parsers from these constants. Neither then
imports aiohttp, gRPC, pydantic or the OpenAPI models (0.3-0.5 s on a 2-core host), which put
that much before the engine process could start (``bench/startup.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sluice.http_facade.auth import AuthPolicy
from sluice.http_facade.cors import CorsPolicy
from sluice.http_facade.limits import RequestLimits

DEFAULT_MAX_BODY_BYTES = 8 << 20
POLICIES = ("prefix", "round_robin")       # engine_pool: how requests spread over several engines
LOG_FORMATS = ("off", "json")              # request_context: --request-log


@dataclass(frozen=True)
class FacadeConfig:
    engine_addr: str = "127.0.0.1:50051"
    # Several engines (``--engine`` repeated): when set, these, and ``engine_addr`` is ignored.
    engine_addrs: tuple[str, ...] = ()
    routing: str = "prefix"           # POLICIES
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
        if self.request_log not in LOG_FORMATS:
            raise ValueError(f"request_log: must be off or json, got {self.request_log!r}")
        if self.routing not in POLICIES:
            raise ValueError(f"routing: must be one of {', '.join(POLICIES)}, got {self.routing!r}")

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(self.engine_addrs) or (self.engine_addr,)


@dataclass(frozen=True)
class AfsConfig:
    """The AFS dialect's options (``routes_afs``)."""
    ping_interval_s: float = 15.0       # SSE ping while no record is due
    query_prefix: str | None = None     # input_type "query": None = the embedding model's own prefix

    def __post_init__(self) -> None:
        if not self.ping_interval_s > 0:
            raise ValueError(f"ping_interval_s: must be > 0, got {self.ping_interval_s!r}")
