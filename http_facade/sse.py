"""Server-sent events: each event is written (one HTTP chunk) and drained on its own.

Clients that split on network reads (``iter_content(chunk_size=None)`` then ``chunk[6:]``, as
in MLC's examples) therefore see exactly one ``data: ...`` event per read. An HTTP/1.0 client
gets the events as a body that ends when the connection closes (no chunked encoding there).
"""
from __future__ import annotations

import json

from aiohttp import web

from sluice.http_facade.errors import ApiError

# The CORS headers of a request, for responses prepared by the handler itself.
CORS_HEADERS: web.RequestKey[dict[str, str]] = web.RequestKey("sluice_cors_headers", dict)


class SSEWriter:
    def __init__(self, request: web.Request) -> None:
        self.request = request
        # HTTP/1.0 has no chunked encoding (aiohttp refuses it with an error): there the stream
        # is the body up to the end of the connection, with no Content-Length.
        http10 = request.version < (1, 1)
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "Connection": "close" if http10 else "keep-alive",
            "X-Accel-Buffering": "no",
            **request.get(CORS_HEADERS, {}),   # set by the CORS middleware
        })
        if http10:
            self.response.force_close()
        else:
            self.response.enable_chunked_encoding()
        self.prepared = False

    async def prepare(self) -> None:
        if not self.prepared:
            await self.response.prepare(self.request)
            self.prepared = True

    async def send(self, payload: dict) -> None:
        await self._write("data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n")

    async def send_event(self, event: str, payload: dict) -> None:
        """A named event (``event: <name>``), as OpenAI's Responses stream sends them."""
        await self._write(f"event: {event}\ndata: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
                          + "\n\n")

    async def send_error(self, err: ApiError) -> None:
        await self.send(err.body())

    async def done(self) -> web.StreamResponse:
        await self._write("data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response

    async def finish(self) -> web.StreamResponse:
        """End the stream without [DONE] (after an error event)."""
        await self.response.write_eof()
        return self.response

    async def _write(self, text: str) -> None:
        await self.prepare()
        # One write = one HTTP chunk handed to the transport at once (TCP_NODELAY is aiohttp's
        # default); it awaits a drain when the transport's buffer is full.
        await self.response.write(text.encode("utf-8"))
