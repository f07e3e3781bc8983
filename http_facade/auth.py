"""Optional API keys, compared in constant time.

A request's key is taken by the first ``KeyExtractor`` that finds one; the default reads
``Authorization: Bearer <key>``, then AFS's ``X-API-KEY: <key>``; both are checked against the
same keys in constant time, on every route. Another dialect's header is another extractor.
"""
from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

from sluice.http_facade.errors import ApiError

if TYPE_CHECKING:   # no aiohttp at run time: the supervisor builds an AuthPolicy (config.py)
    from aiohttp import web

KeyExtractor = Callable[["web.Request"], "str | None"]
ENV_KEYS = "SLUICE_API_KEYS"
# Routes that never need a key: the liveness and readiness probes, the API's documentation and the
# chat page. openapi.ENDPOINTS marks the same ones public (test_facade_app checks every route
# against this policy); they are spelled here so that this module needs no OpenAPI models.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/docs", "/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css",
                          "/openapi.json", "/", "/ui/chat.js", "/ui/chat.css"})


def bearer_key(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def x_api_key(request: web.Request) -> str | None:
    """The AFS dialect's header (header names are case-insensitive: ``X-API-Key`` too). Its
    companion ``X-API-HOST`` routes requests inside AFS's own gateway; here it is ignored."""
    key = request.headers.get("X-API-KEY", "").strip()
    return key or None


@dataclass(frozen=True)
class AuthPolicy:
    keys: tuple[str, ...] = ()
    extractors: tuple[KeyExtractor, ...] = (bearer_key, x_api_key)
    public_paths: frozenset[str] = field(default=PUBLIC_PATHS)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def accepts(self, presented: str) -> bool:
        # compare_digest against every key (no early exit) so timing says nothing about which matched
        candidate = presented.encode("utf-8")
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(candidate, key.encode("utf-8"))
        return ok

    def check(self, request: web.Request) -> None:
        if not self.enabled or request.path in self.public_paths or request.method == "OPTIONS":
            return
        presented = next((k for k in (ex(request) for ex in self.extractors) if k), None)
        if presented is None:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>' or 'X-API-KEY: <key>'",
                           "invalid_request_error",
                           None, "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        if not self.accepts(presented):
            raise ApiError(401, "incorrect API key provided", "invalid_request_error", None, "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"})


def load_keys(cli_keys: Iterable[str] = (), key_file: str | None = None, env: dict | None = None) -> tuple[str, ...]:
    """Keys from ``--api-key`` (repeatable), ``SLUICE_API_KEYS`` (comma-separated) and
    ``--api-key-file`` (one per line, ``#`` comments). Empty entries are dropped."""
    env = os.environ if env is None else env
    keys = [k.strip() for k in cli_keys]
    keys += env.get(ENV_KEYS, "").split(",")
    if key_file:
        try:
            with open(key_file, encoding="utf-8") as fh:
                keys += [line.split("#", 1)[0] for line in fh]
        except OSError as exc:
            raise ValueError(f"api_key_file: cannot read {key_file}: {exc.strerror}") from None
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))
