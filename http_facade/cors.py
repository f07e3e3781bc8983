"""CORS with MLC's flags: ``--allow-credentials``, ``--allowed-origins``, ``--allowed-methods``,
``--allowed-headers`` (JSON lists, default ``["*"]``).

A browser lets a page's script read only the CORS-safelisted response headers unless the server
exposes more: ``X-Request-Id`` is exposed, so that a web client can quote the id of a request
(the one its logs and traces carry)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # no aiohttp at run time: the supervisor builds a CorsPolicy (config.py)
    from aiohttp import web

_PREFLIGHT_MAX_AGE = "600"
# request_context.HEADER, spelled here: that module imports the app state, which imports this one.
_EXPOSED_HEADERS = "X-Request-Id"


@dataclass(frozen=True)
class CorsPolicy:
    allow_credentials: bool = False
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins

    def headers_for(self, request: web.Request, preflight: bool) -> dict[str, str]:
        origin = request.headers.get("Origin")
        if origin is None or not self.origin_allowed(origin):
            return {}
        # With credentials a wildcard is not allowed by browsers: echo the origin instead.
        wildcard = "*" in self.allowed_origins and not self.allow_credentials
        out = {"Access-Control-Allow-Origin": "*" if wildcard else origin}
        if not wildcard:
            out["Vary"] = "Origin"
        if self.allow_credentials:
            out["Access-Control-Allow-Credentials"] = "true"
        if preflight:
            asked_method = request.headers.get("Access-Control-Request-Method", "")
            asked_headers = request.headers.get("Access-Control-Request-Headers", "")
            out["Access-Control-Allow-Methods"] = (
                asked_method or "GET, POST, OPTIONS") if "*" in self.allowed_methods else ", ".join(self.allowed_methods)
            out["Access-Control-Allow-Headers"] = (
                asked_headers or "*") if "*" in self.allowed_headers else ", ".join(self.allowed_headers)
            out["Access-Control-Max-Age"] = _PREFLIGHT_MAX_AGE
        else:
            out["Access-Control-Expose-Headers"] = _EXPOSED_HEADERS
        return out

    def is_preflight(self, request: web.Request) -> bool:
        return request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers


def parse_json_list(text: str, flag: str) -> tuple[str, ...]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"{flag}: expected a JSON list of strings such as '[\"*\"]', got {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{flag}: expected a JSON list of strings, got {text!r}")
    return tuple(value)
