"""``sluice facade`` and ``sluice serve``: entry points.

``engine/cli.py`` registers the two subcommands (their flags: ``arguments.py``); ``sluice
facade`` runs ``main_facade`` and ``sluice serve`` the supervisor. The module also runs on its
own (``python -m sluice.http_facade.cli facade --engine HOST:PORT``), which is how ``sluice serve``
starts the facade process.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from aiohttp import web

from sluice.http_facade.app import build_app
# The parsers live in arguments.py (no aiohttp there, for the ``sluice`` command line); this
# module's own ``main`` uses them, and callers may still take them from here.
from sluice.http_facade.arguments import add_facade_arguments, add_serve_arguments
from sluice.http_facade.auth import AuthPolicy
from sluice.http_facade.config import DEFAULT_MAX_BODY_BYTES, AfsConfig, FacadeConfig
from sluice.http_facade.cors import CorsPolicy
from sluice.http_facade.options import afs_config, facade_config
from sluice.http_facade.state import STATE_KEY

log = logging.getLogger("sluice.facade")


# ---------------------------------------------------------------------------------- running
# After the grace, streams get their error event and end; aiohttp cancels what is left after this.
_END_MARGIN_S = 3.0
_LINGER_S = 2.0


async def serve_facade(config: FacadeConfig, host: str, port: int, stop: asyncio.Event,
                       afs: AfsConfig | None = None, grace_s: float = 30.0) -> None:
    """Serve until ``stop`` is set, then drain: stop listening, refuse new requests (503), let
    the requests in flight run for ``grace_s``, then end each stream still open with an error
    event. Disconnected clients cancel their handlers (and engine requests)."""
    app = build_app(config, afs=afs)
    # keepalive_timeout also bounds a connection's wait for its first request, so a client that
    # sends nothing, or its headers a byte at a time (slowloris), is dropped after it.
    # lingering_time: how long the unread rest of a refused body (413, 408) is read and dropped
    # before the connection closes.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, lingering_time=_LINGER_S,
                           keepalive_timeout=config.idle_timeout_s, shutdown_timeout=grace_s + _END_MARGIN_S)
    await runner.setup()
    state = app[STATE_KEY]
    ender: asyncio.TimerHandle | None = None
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        print(f"sluice facade: listening on http://{host}:{port} (engines {', '.join(config.engines)})",
              file=sys.stderr, flush=True)
        await stop.wait()
        state.draining = True
        ender = asyncio.get_running_loop().call_later(grace_s, state.ending.set)
        log.info("draining: requests in flight have %.0fs", grace_s)
    finally:
        await runner.cleanup()   # stops listening, waits for the handlers in flight
        if ender is not None:
            ender.cancel()


def run_facade(engine_addr: str, host: str = "127.0.0.1", port: int = 8000, api_keys: Sequence[str] = (),
               cors: CorsPolicy | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               enable_tracing: bool = False) -> int:
    """Run the facade until SIGTERM/SIGINT; returns the exit code (0)."""
    config = FacadeConfig(engine_addr=engine_addr, auth=AuthPolicy(keys=tuple(api_keys)),
                          cors=cors or CorsPolicy(), max_body_bytes=max_body_bytes, enable_tracing=enable_tracing)
    return asyncio.run(_run_until_signal(config, host, port))


async def _run_until_signal(config: FacadeConfig, host: str, port: int, afs: AfsConfig | None = None,
                            grace_s: float = 30.0) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve_facade(config, host, port, stop, afs, grace_s)
    return 0


def main_facade(args: argparse.Namespace) -> int:
    try:
        config = facade_config(args, args.engine)
        afs = afs_config(args)
    except ValueError as exc:
        print(f"sluice facade: error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run_until_signal(config, args.host, args.port, afs, args.grace))
    except OSError as exc:   # e.g. the port is taken
        print(f"sluice facade: error: {exc}", file=sys.stderr)
        return 1


def main_serve(args: argparse.Namespace) -> int:
    from sluice.http_facade.supervisor import serve_from_args

    return serve_from_args(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sluice.http_facade.cli")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    add_facade_arguments(sub.add_parser("facade", help="run the HTTP facade in front of a running engine"))
    add_serve_arguments(sub.add_parser("serve", help="run the engine and the facade, supervised"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return main_facade(args) if args.command == "facade" else main_serve(args)


if __name__ == "__main__":
    sys.exit(main())
