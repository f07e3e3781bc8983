"""The flags of ``sluice facade`` and ``sluice serve``.

``engine/cli.py`` registers the two subcommands with ``add_facade_arguments`` /
``add_serve_arguments``. Standard library only (the constants come from ``config.py``): every
``sluice`` process builds these parsers, the engine's and the supervisor's included, and neither
should pay for the facade's imports (aiohttp, pydantic, gRPC) on its way to loading the model.
"""
from __future__ import annotations

import argparse

from sluice.http_facade.config import DEFAULT_MAX_BODY_BYTES, LOG_FORMATS, POLICIES

_MODES = ("local", "interactive", "server")


def _add_http_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP server binds (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    p.add_argument("--api-key", action="append", default=[], dest="api_key",
                   help="an accepted API key (repeatable); also SLUICE_API_KEYS (comma-separated)")
    p.add_argument("--api-key-file", default=None, help="a file of API keys, one per line")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--allowed-origins", default='["*"]', help='CORS: JSON list of origins (default: ["*"])')
    p.add_argument("--allowed-methods", default='["*"]', help='CORS: JSON list of methods (default: ["*"])')
    p.add_argument("--allowed-headers", default='["*"]', help='CORS: JSON list of headers (default: ["*"])')
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest accepted request body (default: {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--default-max-tokens", type=int, default=None,
                   help="chat max_tokens when a request sets none (default: until the context window)")
    p.add_argument("--enable-tracing", action="store_true",
                   help="log per-request events with timings; served at POST /debug/dump_event_trace")
    p.add_argument("--idle-timeout", type=float, default=15.0, metavar="S",
                   help="close a connection that sends no complete request for S seconds (default: 15)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="a request body must arrive within S seconds, else 408 (default: 30)")
    p.add_argument("--limits", default="", metavar='"KEY=N;..."',
                   help="request caps, e.g. \"max_n=16;max_prompt_bytes=65536\" (README: Limits); with "
                        "serve, the keys the engine knows reach it too")
    p.add_argument("--afs-ping-interval", type=float, default=15.0, metavar="S",
                   help="AFS streams: seconds without a record before an 'event: ping' (default: 15)")
    p.add_argument("--routing", default="prefix", choices=POLICIES,
                   help="how requests are spread over several engines: prefix (to the engine that last "
                        "served the prompt's leading text, unless it is overloaded; else the least loaded) "
                        "or round_robin (default: prefix)")
    p.add_argument("--afs-query-prefix", default=None, metavar="TEXT",
                   help="AFS embeddings: prefix for input_type 'query' (default: the embedding model's own)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the name(s) clients use for the model (the first engine's); /v1/models lists each, "
                        "and the model's own name is no longer accepted (default: its own name)")
    p.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without an API key (default: it needs one when keys are set)")
    p.add_argument("--request-log", default="off", choices=LOG_FORMATS,
                   help="json: one JSON line per request on stderr, with its request id and timings (default: off)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export OpenTelemetry spans over OTLP/HTTP, e.g. http://localhost:4318/v1/traces; the "
                        "engine's spans join the facade's by traceparent (needs the otel extra)")


def add_facade_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", required=True, action="append", metavar="HOST:PORT",
                        help="an engine's gRPC address; repeat it for several engines (replicas, or "
                             "engines serving different models: requests are routed by model name)")
    parser.add_argument("--grace", type=float, default=30.0,
                        help="seconds in-flight requests may run on after SIGTERM, then their streams "
                             "end with an error event (default: 30)")
    _add_http_arguments(parser)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="smollm2",
                        help="a .gguf file, a Hugging Face folder or a short name (default: smollm2)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    parser.add_argument("--mode", default="local", choices=_MODES, help="engine preset (default: local)")
    parser.add_argument("--overrides", default="", help='engine options "key=value;..." as mlc_llm serve')
    parser.add_argument("--quantization", default=None, choices=("none", "bf16", "int8", "int4", "w8a8", "w4a8", "auto"),
                        help="the engine's weights in memory (default: auto; see sluice engine --help)")
    parser.add_argument("--speculative-mode", default=None, metavar="MODE",
                        help="the engine's speculative decoding: disable | ngram | small_draft | eagle | medusa "
                             "(the last three need --additional-models; default: disable)")
    parser.add_argument("--additional-models", default=None, nargs="+", metavar="MODEL",
                        help="without a speculative mode: more models to serve, each by its own engine "
                             "(requests are routed by model name); small_draft: the draft model, with the "
                             "target's tokenizer vocabulary; eagle, medusa: the heads' folder (public "
                             "EAGLE-1 / Medusa layout)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                        help="each engine splits the model across N ranks (the override tensor_parallel_shards)")
    parser.add_argument("--data-parallel", type=int, default=1, metavar="N",
                        help="N engines of the model, each with an equal share of the CPU cores (or one "
                             "GPU each), behind the one facade (default: 1)")
    parser.add_argument("--engine-port", type=int, default=0, help="the engine's gRPC port (default: a free one)")
    parser.add_argument("--grace", type=float, default=30.0,
                        help="seconds in-flight requests may run on after SIGTERM (default: 30)")
    parser.add_argument("--ready-timeout", type=float, default=600.0,
                        help="seconds to wait for the engine to load (default: 600)")
    parser.add_argument("--embedding-model", default=None, metavar="PATH_OR_NAME",
                        help="the engine's embedding model, or 'none' (default: the engine's: the packaged "
                             "all-MiniLM-L6-v2 when installed)")
    parser.add_argument("--rerank-model", default=None, metavar="PATH",
                        help="a cross-encoder folder for rerank (default: the embedding model's cosine similarity)")
    _add_http_arguments(parser)
