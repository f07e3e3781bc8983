"""Build and run the engine's gRPC server.

Life cycle: bind the port and start serving at once with health NOT_SERVING (EngineService RPCs answer
UNAVAILABLE while the model loads) → SERVING once the model is loaded → on SIGTERM/SIGINT:
NOT_SERVING, new requests UNAVAILABLE, in-flight requests get ``grace_s`` to finish and are then
aborted, the server stops and ``serve()`` returns 0. A model that fails to load returns 1.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.rpc import engine_pb2_grpc as pb_grpc
from sluice.engine.rpc.servicer import SERVICE_NAME, EngineServicer
from sluice.engine.rpc.status import ErrorInterceptor
from sluice.engine.rpc.tracing import Tracing

log = logging.getLogger("sluice.server")

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    grace_s: float = 30.0          # how long in-flight requests may run on after SIGTERM
    # A file descriptor to write b"ready\n" to (then close) once SERVING, closed unwritten if the
    # model fails to load: how ``sluice serve`` learns the engine is up without a gRPC client.
    ready_fd: int | None = None
    # OTLP/HTTP traces endpoint (``--otlp-traces-endpoint``); None: no tracing (engine/rpc/tracing.py)
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s: must be >= 0, got {self.grace_s}")


class EngineServer:
    """The gRPC server around one ``AsyncEngine``."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig, tracing: Tracing | None = None) -> None:
        """``tracing``: spans of the RPCs (default: to ``config.otlp_traces_endpoint``, if set)."""
        self.engine = engine
        self.config = config
        if tracing is None and config.otlp_traces_endpoint:
            tracing = Tracing.to_otlp(config.otlp_traces_endpoint, "sluice-engine", "sluice.engine")
        self.tracing = tracing
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server(
            interceptors=[ErrorInterceptor()],
            options=[("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                     ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)],
        )
        pb_grpc.add_EngineServiceServicer_to_server(EngineServicer(engine, tracing), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self.port = 0
        self.config_ready_fd = config.ready_fd

    async def start(self) -> int:
        """Bind and start serving (NOT_SERVING until the model is ready). Returns the bound port."""
        address = f"{self.config.host}:{self.config.port}"
        self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"port: cannot bind {address}")
        await self._set_health(_NOT_SERVING)
        await self.server.start()
        log.info("gRPC server listening on %s:%d (loading the model)", self.config.host, self.port)
        return self.port

    def _signal_ready(self, ready: bool) -> None:
        fd, self.config_ready_fd = self.config_ready_fd, None
        if fd is None:
            return
        try:
            if ready:
                os.write(fd, b"ready\n")
        except OSError:            # the reader is gone (its supervisor died): nothing to tell
            pass
        finally:
            os.close(fd)

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def run_until(self, stop: asyncio.Event) -> int:
        """Load the model, serve until ``stop`` is set, drain, stop. Returns the exit code."""
        self.engine.start()
        loaded = asyncio.ensure_future(self.engine.wait_ready())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loaded, stopping}, return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if loaded.done():
            if loaded.exception() is not None:
                log.error("model failed to load: %s", loaded.exception())
                code = 1
                self._signal_ready(False)
            else:
                await self._set_health(_SERVING)
                self._signal_ready(True)
                emb = self.engine.embedding
                log.info("engine ready: %s%s", self.engine.model_info.name,
                         f" (embeddings: {emb.model.name if emb.model else 'none'}, rerank: {emb.rerank_method})"
                         if emb is not None else "")
                await stopping
        else:
            loaded.cancel()
            self._signal_ready(False)
        stopping.cancel()
        await self.shutdown()
        return code

    async def shutdown(self) -> None:
        await self.health.enter_graceful_shutdown()   # every service NOT_SERVING, for good
        aborted = await self.engine.drain(self.config.grace_s)
        if aborted:
            log.warning("aborted %d request(s) still running after %.1fs", aborted, self.config.grace_s)
        await self.server.stop(grace=1.0)
        await self.engine.shutdown()
        if self.tracing is not None:
            self.tracing.shutdown()     # flushes the spans still batched
        log.info("engine server stopped")


async def serve(core_factory: Callable, config: ServerConfig,
                on_started: Callable[[int], None] | None = None,
                embedding_factory: Callable | None = None) -> int:
    """Run a server until SIGTERM or SIGINT; returns the process exit code. ``embedding_factory``
    loads the optional embedding / rerank engine (after the chat model, on the engine thread)."""
    # Everything alive now (the modules and objects of torch, gRPC, numpy: ~200k) lives as long as
    # the process. Frozen, the collector stops walking it at each full collection: the load's
    # explicit gc.collect() calls (drop_vocabulary, release_freed_heap) and the automatic ones the
    # tokenizer's ~100k small objects trigger took ~0.3 s of a ~1.5 s load, and each later full
    # collection is that much shorter too. Objects made from here on are collected as before.
    gc.freeze()
    server = EngineServer(AsyncEngine(core_factory, embedding_factory), config)
    port = await server.start()
    if on_started is not None:
        on_started(port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        return await server.run_until(stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
