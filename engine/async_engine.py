"""``AsyncEngine``: the engine core driven by its own thread, exposed to asyncio.

``EngineCore`` is not thread-safe and its ``step()`` blocks for a whole forward pass, so one
dedicated thread owns it. Everything else talks to that thread through a command queue:

    asyncio side                         engine thread
    generate() ── _Add ──▶ SimpleQueue ──▶ drain commands (add / abort / call), then step()
    abort()    ── _Abort ─▶                  │
    per-request asyncio.Queue ◀── loop.call_soon_threadsafe(_dispatch, outputs)

Commands are drained before every step, so an abort frees its request's blocks within one step.
The thread sleeps on the queue when no request is unfinished. A fault in ``step()`` ends the
requests in flight with an error and the loop keeps serving; the core itself isolates faults
inside one request (that request finishes with finish_reason "error", the others continue).

The optional embedding engine (``embedding_factory``) is loaded on the engine thread after the
chat model, and its calls run on one dedicated worker thread (``embed()``): neither the asyncio
loop nor the generation step loop waits for an encoder forward; each call is batched inside
``EmbeddingEngine`` by length.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, TypeVar

from sluice.engine.errors import EngineError, EngineUnavailableError, UnsupportedError
from sluice.engine.outputs import RequestOutput
from sluice.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sluice.engine.embedding import EmbeddingEngine
    from sluice.engine.engine_core import EngineCore, LoadStats, ModelInfo

log = logging.getLogger("sluice.async_engine")
T = TypeVar("T")


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class EngineStepError(RuntimeError):
    """A whole engine step failed; every request in flight at that moment ends with it."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    add_special_tokens: bool
    token_ids: list[int]                   # from core.prepare_prompt, run off the engine thread
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class _Stop:
    pass


class AsyncEngine:
    """Owns the engine thread. Create it, ``start()`` it inside a running loop, ``await
    wait_ready()``; ``drain()`` then ``shutdown()`` to stop."""

    def __init__(self, core_factory: Callable[[], EngineCore],
                 embedding_factory: Callable[[], EmbeddingEngine | None] | None = None) -> None:
        self._core_factory = core_factory
        self._embedding_factory = embedding_factory
        self._embedding: EmbeddingEngine | None = None
        self._embed_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sluice-embed")
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._live: set[str] = set()           # engine-thread side: ids added and not finished
        self._state = EngineState.LOADING
        self._load_error: BaseException | None = None
        self._core: EngineCore | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None   # set while no stream is open

    # ---- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> None:
        """Wait for the model to load; raises the load error if it failed."""
        assert self._ready is not None, "start() first"
        await self._ready.wait()
        if self._load_error is not None:
            raise self._load_error

    @property
    def state(self) -> EngineState:
        return self._state

    @property
    def core(self) -> EngineCore:
        """The core, for read-only use off the engine thread (tokenizer, model info)."""
        self._check_accepting(allow_draining=True)
        if self._core is None:   # draining or stopping before the model finished loading
            raise EngineUnavailableError("engine unavailable: the model is not loaded")
        return self._core

    @property
    def model_info(self) -> ModelInfo:
        return self.core.model_info

    @property
    def embedding(self) -> EmbeddingEngine | None:
        """The embedding / rerank engine (read-only use), or None when this engine serves none.
        Like ``core``, raises ``EngineUnavailableError`` while loading or stopped."""
        self.core   # noqa: B018 - the same availability check
        return self._embedding

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests, wait up to ``timeout_s`` for those in flight, abort the rest.
        Returns how many were aborted."""
        if self._state in (EngineState.READY, EngineState.LOADING):
            self._state = EngineState.DRAINING
        assert self._idle is not None
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return 0
        except asyncio.TimeoutError:
            remaining = list(self._streams)
            log.warning("drain timeout (%.1fs): aborting %d request(s)", timeout_s, len(remaining))
            self.abort(remaining)
            try:  # their final "abort" deltas go out within a step or two
                await asyncio.wait_for(self._idle.wait(), 10.0)
            except asyncio.TimeoutError:
                log.error("requests still open after abort: %s", list(self._streams))
            return len(remaining)

    async def shutdown(self) -> None:
        """Stop the engine thread (after ``drain()``). Streams still open end with
        ``EngineUnavailableError``: a caller waiting on one must not wait for ever."""
        if self._state is not EngineState.FAILED:
            self._state = EngineState.STOPPED
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_Stop())
            await asyncio.to_thread(self._thread.join, 30.0)
        self._embed_pool.shutdown(wait=False, cancel_futures=True)
        if self._core is not None and not (self._thread is not None and self._thread.is_alive()):
            self._core.close()
        for stream in self._streams.values():
            stream.put_nowait(EngineUnavailableError("engine unavailable: the engine has stopped"))

    # ---- requests -----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       add_special_tokens: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request. Errors from validation (ValueError,
        ContextLengthError, QueueFullError) are raised from the first iteration. Closing the
        iterator before the request finished (cancel, disconnect, deadline) aborts it; use
        ``contextlib.aclosing`` so that happens at once rather than at garbage collection."""
        self._check_accepting()
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        assert self._idle is not None
        self._idle.clear()
        finished = False
        try:
            # Caps, tokenizing and the length check need no engine state: done here, in a worker
            # thread, they cost the step loop nothing (a 7 MB prompt stalled every stream).
            core = self.core
            ids = await asyncio.to_thread(core.prepare_prompt, prompt, params, add_special_tokens)
            add = _Add(request_id, prompt, params, add_special_tokens, ids)
            self._commands.put(add)
            await asyncio.wrap_future(add.future)
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not self._streams:
                self._idle.set()
            if not finished:   # also harmless when the add itself failed: unknown ids are ignored
                self._commands.put(_Abort([request_id]))

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """Abort requests by id; returns the ids that had an open stream."""
        ids = list(request_ids)
        open_ids = [r for r in ids if r in self._streams]
        if ids:
            self._commands.put(_Abort(ids))
        return open_ids

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run ``fn(core)`` on the engine thread between two steps."""
        self._check_accepting(allow_draining=True)
        if self._core is None:
            raise EngineUnavailableError("engine unavailable: the model is not loaded")
        cmd = _Call(fn)
        self._commands.put(cmd)
        return await asyncio.wrap_future(cmd.future)

    async def embed(self, fn: Callable[[EmbeddingEngine], T]) -> T:
        """Run ``fn(embedding_engine)`` on the embedding worker thread."""
        self._check_accepting()
        if self._embedding is None:
            raise UnsupportedError("this engine serves no embedding model; start it with --embedding-model")
        assert self._loop is not None
        return await self._loop.run_in_executor(self._embed_pool, fn, self._embedding)

    async def get_load(self) -> LoadStats:
        return await self.call(lambda core: core.get_load())

    def _check_accepting(self, allow_draining: bool = False) -> None:
        state = self._state
        if state is EngineState.READY or (allow_draining and state is EngineState.DRAINING):
            return
        reason = {
            EngineState.LOADING: "the model is still loading",
            EngineState.DRAINING: "the engine is draining for shutdown",
            EngineState.STOPPED: "the engine has stopped",
            EngineState.FAILED: f"the engine failed to load: {self._load_error}",
        }.get(state, state.value)
        raise EngineUnavailableError(f"engine unavailable: {reason}")

    # ---- asyncio side of the hand-off --------------------------------------------------------
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:   # the loop has closed: nobody is listening any more
            pass

    def _on_loaded(self, error: BaseException | None) -> None:
        self._load_error = error
        if error is not None:
            self._state = EngineState.FAILED
        elif self._state is EngineState.LOADING:
            self._state = EngineState.READY
        assert self._ready is not None
        self._ready.set()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail_streams(self, request_ids: list[str], message: str) -> None:
        for rid in request_ids:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put_nowait(EngineStepError(message))

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            core = self._core_factory()
            self._embedding = self._embedding_factory() if self._embedding_factory else None
        except BaseException as exc:  # noqa: BLE001 - reported to wait_ready()
            if isinstance(exc, EngineError):   # says what is wrong with which file: one line
                log.error("engine failed to load: %s", exc)
            else:
                log.exception("engine failed to load")
            self._post(self._on_loaded, exc)
            return
        self._core = core
        self._post(self._on_loaded, None)
        while self._drain_commands(core, block=not core.has_unfinished_requests()):
            if core.has_unfinished_requests():
                self._step(core)
        log.info("engine thread stopped")

    def _drain_commands(self, core: EngineCore, block: bool) -> bool:
        """Apply every queued command; wait for one first if ``block``. False on stop."""
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, _Stop):
                return False
            self._apply(core, cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, core: EngineCore, cmd: _Add | _Abort | _Call) -> None:
        if isinstance(cmd, _Abort):
            core.abort_request(cmd.request_ids)
            return
        if not cmd.future.set_running_or_notify_cancel():
            # The caller gave up (cancelled, deadline) before the engine got here. Setting a
            # result now would raise InvalidStateError and kill this thread; an _Add's caller
            # has queued an _Abort behind it, which finds nothing to abort.
            return
        try:
            if isinstance(cmd, _Add):
                result = core.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.add_special_tokens,
                                          cmd.token_ids)
                self._live.add(cmd.request_id)
            else:
                result = cmd.fn(core)
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
            cmd.future.set_exception(exc)
        else:
            cmd.future.set_result(result)

    def _step(self, core: EngineCore) -> None:
        try:
            outputs = core.step()
        except Exception as exc:  # noqa: BLE001 - the loop must outlive a bad step
            log.exception("engine step failed; failing the requests in flight")
            failed = sorted(self._live)
            self._live.clear()
            try:
                core.abort_request(failed)
            except Exception:  # noqa: BLE001
                log.exception("abort after a failed step also failed")
            self._post(self._fail_streams, failed, f"engine fault: {type(exc).__name__}: {exc}")
            time.sleep(0.01)   # a core that keeps failing must not spin the CPU
            return
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        if outputs:
            self._post(self._dispatch, outputs)
