"""Several engines behind one facade: health, routing by model and prefix, failover.

The facade holds an ``EnginePool`` of ``EngineLink``s (one per ``--engine``; a single engine is a
pool of one). A background task checks each engine every ``health_interval_s`` (gRPC health,
then ``GetLoad``); an engine that does not answer, or whose stream fails with
UNAVAILABLE, is out at once and taken back when its health says SERVING again.

Routing a generation request (``route``):
  1. the candidates are the engines that are up and serve the request's model (by name or
     path; engines may serve different models);
  2. ``policy="prefix"`` (the default): the prompt's leading text is hashed at growing lengths
     (``PREFIX_CHUNK`` characters, doubling up to ``PREFIX_LEVELS`` levels); the longest of those
     hashes already routed names the engine that most likely holds that prefix in its KV cache,
     and the request goes there unless the engine is overloaded: its open streams exceed the
     least loaded candidate's by ``balance_abs`` and by a factor ``balance_rel``. Otherwise, and
     for an unseen prefix, the least loaded candidate (``EngineState.busy``: this facade's open
     streams plus what the engine's last load report shows beyond them; ties taken in turn)
     takes it, and every level of its prefix is remembered for that engine (a bounded LRU map);
  3. ``policy="round_robin"``: the candidates in turn (the baseline bench/replicas.py compares).
A stream that fails with UNAVAILABLE before its first response is retried once per other
candidate (nothing reached the client yet); one that fails later ends with that error.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade.config import POLICIES
from sluice.http_facade.engine_link import EngineLink
from sluice.http_facade.errors import ApiError

log = logging.getLogger("sluice.facade.pool")

PREFIX_CHUNK = 128          # characters of prompt text hashed at the first level
PREFIX_LEVELS = 6           # 128, 256, ..., 4096 characters
PREFIX_ENTRIES = 1 << 16    # remembered prefix hashes (LRU)


@dataclass
class EngineState:
    link: EngineLink
    up: bool = False
    models: tuple[pb.ModelInfo, ...] = ()
    load: pb.GetLoadResponse | None = None
    open_streams: int = 0          # this facade's streams on it now
    changed_at: float = 0.0        # when one of them last started or ended (monotonic)
    load_at: float = 0.0           # when ``load`` was read
    routed: int = 0                # requests sent to it since start
    reason: str = "not checked yet"

    @property
    def address(self) -> str:
        return self.link.address

    def serves(self, model: str | None) -> bool:
        """Unknown models (not listed yet) count as served: the engine answers for itself."""
        return model is None or not self.models or any(model in (m.name, m.path) for m in self.models)

    def busy(self) -> int:
        """This facade's open streams on it, plus the sequences others keep it busy with: its last
        load report beyond our own streams, when that report is newer than our last stream's
        start or end (an older one would count a stream of ours that has ended)."""
        others = 0
        if self.load is not None and self.load_at > self.changed_at:
            others = max(0, self.load.num_waiting + self.load.num_running - self.open_streams)
        return self.open_streams + others

    def stream_opened(self, delta: int) -> None:
        self.open_streams += delta
        self.changed_at = time.monotonic()


@dataclass
class EnginePool:
    links: list[EngineLink]
    policy: str = "prefix"
    health_interval_s: float = 1.0
    balance_abs: int = 4
    balance_rel: float = 1.5
    engines: list[EngineState] = field(init=False)

    def __post_init__(self) -> None:
        if not self.links:
            raise ValueError("engines: at least one engine address is needed")
        if self.policy not in POLICIES:
            raise ValueError(f"routing: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        self.engines = [EngineState(link) for link in self.links]
        self._prefixes: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._turn = itertools.count()
        self._task: asyncio.Task | None = None

    # ---- health ---------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.ensure_future(self._watch())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for e in self.engines:
            await e.link.close()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - the watcher must outlive any one bad answer
                log.exception("engine health check failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(e) for e in self.engines))

    async def _check(self, e: EngineState) -> None:
        """Up when its health says SERVING; its load is read on the way (best effort). Its models
        are learnt from ``list_models``, which every request's model lookup calls first."""
        was = e.up
        if not await e.link.serving():
            self._mark_down(e, "its health check does not say SERVING")
            return
        e.up, e.reason = True, "serving"
        if not was:
            log.info("engine %s is serving", e.address)
        try:
            e.load = await e.link.get_load()
            e.load_at = time.monotonic()
        except grpc.aio.AioRpcError as err:
            log.debug("engine %s: %s on GetLoad", e.address, err.code().name)

    def _mark_down(self, e: EngineState, reason: str) -> None:
        if e.up:
            log.warning("engine %s is out: %s", e.address, reason)
        e.up, e.reason, e.load = False, reason, None

    # ---- what the facade asks ---------------------------------------------------------------
    async def serving(self) -> bool:
        """Whether some engine is serving, checked now (``/ready``)."""
        await self.check_all()
        return any(e.up for e in self.engines)

    def _asked(self) -> list[EngineState]:
        """The engines to ask: those up, or every one when none is (the answer, or the error the
        client gets, is then the engines' own)."""
        return [e for e in self.engines if e.up] or list(self.engines)

    async def list_models(self) -> tuple[pb.ModelInfo, ...]:
        """The models of the engines asked, each name once (an engine that fails to answer is
        left out; if all fail, the first one's error)."""
        asked = self._asked()
        answers = await asyncio.gather(*(e.link.list_models() for e in asked), return_exceptions=True)
        if all(isinstance(a, BaseException) for a in answers):
            raise answers[0]
        seen: dict[str, pb.ModelInfo] = {}
        for e, models in zip(asked, answers):
            if not isinstance(models, BaseException):
                e.models = models
                for m in models:
                    seen.setdefault(m.name, m)
        return tuple(seen.values())

    async def loads(self) -> list[tuple[str, pb.GetLoadResponse | None]]:
        """Each engine's address and load now (None: it did not answer)."""
        answers = await asyncio.gather(*(e.link.get_load() for e in self.engines), return_exceptions=True)
        return [(e.address, None if isinstance(a, BaseException) else a) for e, a in zip(self.engines, answers)]

    def routing_counts(self) -> list[tuple[str, int, int, bool]]:
        """(address, requests routed to it, streams open on it, up) per engine."""
        return [(e.address, e.routed, e.open_streams, e.up) for e in self.engines]

    async def detokenize(self, token_ids: list[int], model: str | None = None,
                         skip_special_tokens: bool = False) -> str:
        return await self.route(model, b"").link.detokenize(token_ids, skip_special_tokens)

    async def tokenize(self, request: pb.TokenizeRequest, model: str | None = None) -> pb.TokenizeResponse:
        return await self.route(model, b"").link.tokenize(request)

    async def embed(self, request: pb.EmbedRequest, model: str | None = None) -> pb.EmbedResponse:
        return await self.route(model, b"").link.embed(request)

    async def rerank(self, request: pb.RerankRequest, model: str | None = None) -> pb.RerankResponse:
        return await self.route(model, b"").link.rerank(request)

    async def stream(self, request: pb.GenerateRequest, model: str | None = None
                     ) -> AsyncIterator[pb.GenerateResponse]:
        """The request's responses from the engine ``route`` picks; retried on another engine
        while the chosen one fails with UNAVAILABLE before answering."""
        key = prompt_key(request)
        tried: set[str] = set()
        while True:
            e = self.route(model, key, exclude=tried)
            tried.add(e.address)
            started = False
            e.stream_opened(1)
            try:
                async with e.link.open_stream(request) as call:
                    async for msg in call:
                        started = True
                        yield msg
                return
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self._mark_down(e, f"a stream failed: {err.details()}")
                if started or not [c for c in self._candidates(model, tried) if c.up]:
                    raise
                log.warning("request %s: engine %s is unavailable; trying another", request.request_id, e.address)
            finally:
                e.stream_opened(-1)

    # ---- routing ------------------------------------------------------------------------------
    def _candidates(self, model: str | None, exclude: set[str] = frozenset()) -> list[EngineState]:
        return [e for e in self._asked() if e.serves(model) and e.address not in exclude]

    def route(self, model: str | None, key: bytes, exclude: set[str] = frozenset()) -> EngineState:
        candidates = self._candidates(model, exclude)
        if not candidates:
            served = ", ".join(sorted({m.name for e in self._asked() for m in e.models})) or "none"
            raise ApiError(404, f"The model '{model}' does not exist (served: {served})", "invalid_request_error",
                           "model", "model_not_found")
        if self.policy == "round_robin":
            chosen = candidates[next(self._turn) % len(candidates)]
        else:
            chosen = self._by_prefix(candidates, key)
        chosen.routed += 1
        return chosen

    def _by_prefix(self, candidates: list[EngineState], key: bytes) -> EngineState:
        levels = prefix_hashes(key)
        turn = next(self._turn) % len(candidates)      # ties go round: distinct prompts spread evenly
        least = min(candidates[turn:] + candidates[:turn], key=EngineState.busy)
        by_address = {e.address: e for e in candidates}
        chosen = least
        for h in reversed(levels):
            owner = by_address.get(self._prefixes.get(h, ""))
            if owner is not None:
                if not self._overloaded(owner, least):
                    chosen = owner
                break
        for h in levels:
            self._prefixes[h] = chosen.address
            self._prefixes.move_to_end(h)
        while len(self._prefixes) > PREFIX_ENTRIES:
            self._prefixes.popitem(last=False)
        return chosen

    def _overloaded(self, owner: EngineState, least: EngineState) -> bool:
        a, b = owner.open_streams, least.open_streams
        return a - b > self.balance_abs and a > self.balance_rel * b


def prompt_key(request: pb.GenerateRequest) -> bytes:
    """The request's prompt as bytes, in the order the engine will read it (what its prefix cache
    keys on): text, token ids, chat messages (role and content) or an infill's prefix."""
    kind = request.WhichOneof("input")
    if kind == "text":
        return request.text.encode()
    if kind == "token_ids":
        return b"".join(i.to_bytes(4, "little") for i in request.token_ids.ids[:4096])
    if kind == "chat":
        parts = []
        for m in request.chat.messages:
            parts.append(f"{m.role}\x00{m.content}\x00".encode())
            if sum(map(len, parts)) >= PREFIX_CHUNK << PREFIX_LEVELS:
                break
        return b"".join(parts)
    if kind == "infill":
        return request.infill.prefix.encode()
    return b""


def prefix_hashes(key: bytes) -> list[bytes]:
    """Hashes of the key's first PREFIX_CHUNK, 2x, 4x ... bytes that it holds whole (a key
    shorter than one chunk hashes once, whole)."""
    out, n = [], PREFIX_CHUNK
    for _ in range(PREFIX_LEVELS):
        if len(key) < n:
            break
        out.append(hashlib.blake2b(key[:n], digest_size=16).digest())
        n *= 2
    if not out and key:
        out.append(hashlib.blake2b(key, digest_size=16).digest())
    return out
