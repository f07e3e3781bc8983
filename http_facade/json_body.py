"""The one way every dialect (OpenAI, MLC, AFS) reads a JSON request body.

``read_json`` refuses a body whose Content-Type is not JSON (415: a cross-site "simple request"
may send ``text/plain`` without a CORS preflight, so such a body must never be acted on), then
``decode_json`` turns the bytes into a dict or a 400 for anything malformed:

* not UTF-8, not JSON, or not an object at the top;
* nested deeper than the decoder's recursion allows (100k brackets);
* an integer of more than ``MAX_INT_DIGITS`` digits (Python would refuse 4300+ digits with a
  ValueError deep inside the decoder), or the non-standard ``NaN`` / ``Infinity``;
* any string, key or value, holding a lone surrogate (``"a\\ud800"``): JSON allows the escape,
  but it is not a Unicode character, and neither protobuf nor the tokenizer can encode it.

The status and body shape are the dialect's: the error middleware renders the ``ApiError`` in
the AFS shape under ``/models/`` and in the OpenAI shape elsewhere.
"""
from __future__ import annotations

import asyncio
import json

from aiohttp import web

from sluice.http_facade.errors import ApiError, bad_request

MAX_INT_DIGITS = 64
_JSON_TYPES = ("application/json",)


def is_json_type(content_type: str) -> bool:
    ct = content_type.lower()
    return ct in _JSON_TYPES or (ct.startswith("application/") and ct.endswith("+json"))


async def read_json(request: web.Request, timeout_s: float) -> dict:
    """The body as a dict; 415 for a non-JSON Content-Type, 408 when it takes over ``timeout_s``."""
    if not is_json_type(request.content_type):
        given = request.headers.get("Content-Type") or "none"
        raise ApiError(415, f"the request body must be JSON sent with Content-Type: application/json "
                            f"(got {given})", "invalid_request_error", None, "unsupported_media_type")
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        # A slow body holds a handler and its buffers: refuse it, and close the connection after
        # the answer (what is left of the body would be read as the next request).
        if request.protocol is not None:
            request.protocol.close()
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g}s", "invalid_request_error",
                       None, "request_timeout", {"Connection": "close"}) from None
    return decode_json(raw)


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _constant(name: str):
    raise _Refused(f"{name} (not JSON)")


class _Refused(ValueError):
    pass


def decode_json(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8: {exc}") from None
    try:
        body = json.loads(text, parse_int=_int, parse_constant=_constant)
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad_request("the request body is not valid JSON: nested too deeply") from None
    except _Refused as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        # C-speed walk of every key and string; fails on the first lone surrogate.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text_around(exc)
        raise bad_request(f"the request body holds a lone UTF-16 surrogate{bad}, which is not a "
                          "Unicode character") from None
    except RecursionError:
        raise bad_request("the request body is not valid JSON: nested too deeply") from None
    return body


def text_around(exc: UnicodeEncodeError) -> str:
    s = exc.object
    if not isinstance(s, str):
        return ""
    return f" ({ascii(s[max(0, exc.start - 10):exc.end + 10])})"
