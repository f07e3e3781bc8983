"""Request caps the facade checks while it parses a body, before it builds any per-choice
state or engine request: ``n``, stop strings, logit-bias entries, logprob alternatives, prompt
bytes and tokens, prompts per request, messages, tool and function definitions.

The engine checks its own copy of the shared caps (``sluice.engine.config.LimitsConfig``, which
the facade may not import) for gRPC clients; the defaults agree, and ``sluice serve --limits``
sets both. Every violation is a 400 naming the parameter. ``--limits "max_n=16;max_prompt_bytes=65536"``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

# The caps the engine knows too (its --overrides keys of the same names).
ENGINE_KEYS = ("max_n", "max_stop_strings", "max_stop_length", "max_logit_bias", "max_logprobs",
               "max_prompt_bytes", "max_chat_messages", "max_tools_bytes")


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = 128                     # choices per request (OpenAI's bound)
    max_stop_strings: int = 16           # stop strings per request
    max_stop_length: int = 256           # characters in one stop string
    max_logit_bias: int = 1024           # logit_bias entries
    max_logprobs: int = 20               # top alternatives per token
    max_prompt_bytes: int = 1 << 20      # UTF-8 bytes of one prompt, or of all a chat's messages
    max_prompt_tokens: int = 1 << 17     # token ids in one token prompt
    max_prompts: int = 128               # prompts in one completions request
    max_chat_messages: int = 4096        # messages in one chat
    max_tools_bytes: int = 256 << 10     # JSON bytes of tools / functions and tool calls

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f.name}: must be a positive integer, got {v!r}")


def parse_limits(text: str | None, base: RequestLimits | None = None) -> RequestLimits:
    """``"max_n=16;max_stop_strings=4"`` over ``base`` (default: the defaults)."""
    names = {f.name for f in fields(RequestLimits)}
    values: dict[str, int] = {}
    for item in (text or "").split(";"):
        item = item.strip()
        if not item:
            continue
        key, sep, raw = (s.strip() for s in item.partition("="))
        if not sep or key not in names:
            raise ValueError(f"--limits: expected key=value with a key among {', '.join(sorted(names))}, "
                             f"got {item!r}")
        try:
            values[key] = int(raw.replace("_", ""), 10)
        except ValueError:
            raise ValueError(f"--limits: {key}={raw!r} is not an integer") from None
    try:
        return replace(base or RequestLimits(), **values)
    except ValueError as exc:
        raise ValueError(f"--limits: {exc}") from None


def over(name: str, what: str, got: int, cap: int, key: str) -> str:
    """The message of a cap violation (the caller raises it in its dialect's shape)."""
    return f"{name}: at most {cap} {what}, got {got} (the server's {key})"


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))
