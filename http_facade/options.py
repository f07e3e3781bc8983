"""Parsed command-line flags → the facade's configuration. ``sluice facade`` (``cli.py``) and
``sluice serve``'s supervisor (``supervisor.py``, which hands its facade process the same flags)
both read them here, so neither imports the other. Like ``config.py``, standard library only: the
supervisor checks every flag here before it starts a process."""
from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence

from sluice.engine.rpc.tracing import EXTRA_HINT
from sluice.http_facade.auth import PUBLIC_PATHS, AuthPolicy, load_keys
from sluice.http_facade.config import AfsConfig, FacadeConfig
from sluice.http_facade.cors import CorsPolicy, parse_json_list
from sluice.http_facade.limits import parse_limits


def _otel_installed() -> bool:
    """Whether the ``otel`` extra is importable (a missing parent package ends find_spec with an
    error rather than None, so it is asked first)."""
    return importlib.util.find_spec("opentelemetry") is not None and \
        importlib.util.find_spec("opentelemetry.sdk") is not None


def afs_config(args: argparse.Namespace) -> AfsConfig:
    """Raises ValueError naming the flag for a bad value."""
    try:
        return AfsConfig(ping_interval_s=args.afs_ping_interval, query_prefix=args.afs_query_prefix)
    except ValueError as exc:
        raise ValueError(f"--afs-ping-interval: {exc}") from None


def facade_config(args: argparse.Namespace, engine_addr: str | Sequence[str]) -> FacadeConfig:
    """Raises ValueError naming the flag for a bad value."""
    addrs = (engine_addr,) if isinstance(engine_addr, str) else tuple(engine_addr)
    cors = CorsPolicy(
        allow_credentials=args.allow_credentials,
        allowed_origins=parse_json_list(args.allowed_origins, "--allowed-origins"),
        allowed_methods=parse_json_list(args.allowed_methods, "--allowed-methods"),
        allowed_headers=parse_json_list(args.allowed_headers, "--allowed-headers"),
    )
    keys = load_keys(args.api_key, args.api_key_file)
    if args.otlp_traces_endpoint and not _otel_installed():
        raise ValueError(f"--otlp-traces-endpoint: {EXTRA_HINT}")
    public = PUBLIC_PATHS | {"/metrics"} if args.public_metrics else PUBLIC_PATHS
    try:
        FacadeConfig(engine_addrs=addrs, routing=args.routing)
    except ValueError as exc:
        flag = "--routing" if str(exc).startswith("routing") else "--engine"
        raise ValueError(f"{flag}: {str(exc).split(': ', 1)[-1]}") from None
    return FacadeConfig(engine_addr=addrs[0], engine_addrs=addrs, routing=args.routing,
                        auth=AuthPolicy(keys=keys, public_paths=public), cors=cors,
                        max_body_bytes=args.max_body_bytes, enable_tracing=args.enable_tracing,
                        default_max_tokens=args.default_max_tokens, limits=parse_limits(args.limits),
                        idle_timeout_s=args.idle_timeout, body_timeout_s=args.body_timeout,
                        served_model_names=tuple(args.served_model_name or ()), request_log=args.request_log,
                        otlp_traces_endpoint=args.otlp_traces_endpoint)


def operations_flags(args: argparse.Namespace) -> list[str]:
    """The operations flags of ``sluice serve`` that its facade process gets as they are."""
    out = ["--served-model-name", *args.served_model_name] if args.served_model_name else []
    out += ["--public-metrics"] * args.public_metrics + ["--request-log", args.request_log]
    return out + (["--otlp-traces-endpoint", args.otlp_traces_endpoint] if args.otlp_traces_endpoint else [])
