"""Request caps (``LimitsConfig``), checked before anything is allocated or tokenized.

Each check costs O(1) per capped item: counts are compared before any per-item work, so a
request with a million stop strings is refused after one ``len()``. Messages start with the
parameter's name (``n: ...``), which the servicer turns into INVALID_ARGUMENT and the facade
into a 400 naming the parameter.
"""
from __future__ import annotations

import json
from collections.abc import Sequence

from sluice.engine.config import LimitsConfig
from sluice.engine.errors import ContextLengthError
from sluice.engine.sampling_params import SamplingParams


def over_cap(name: str, what: str, got: int, cap: int, key: str) -> ValueError:
    return ValueError(f"{name}: at most {cap} {what}, got {got} (the server's {key})")


def check_params(params: SamplingParams, limits: LimitsConfig) -> None:
    n = params.n
    if isinstance(n, int) and n > limits.max_n:
        raise over_cap("n", "choices per request", n, limits.max_n, "max_n")
    stop = params.stop
    if isinstance(stop, list):
        if len(stop) > limits.max_stop_strings:
            raise over_cap("stop", "stop strings", len(stop), limits.max_stop_strings, "max_stop_strings")
        for s in stop:
            if isinstance(s, str) and len(s) > limits.max_stop_length:
                raise over_cap("stop", "characters per stop string", len(s), limits.max_stop_length,
                            "max_stop_length")
    if isinstance(params.stop_token_ids, list) and len(params.stop_token_ids) > limits.max_stop_strings:
        raise over_cap("stop_token_ids", "stop tokens", len(params.stop_token_ids), limits.max_stop_strings,
                    "max_stop_strings")
    if isinstance(params.logit_bias, dict) and len(params.logit_bias) > limits.max_logit_bias:
        raise over_cap("logit_bias", "entries", len(params.logit_bias), limits.max_logit_bias, "max_logit_bias")
    lp = params.logprobs
    if isinstance(lp, int) and lp > limits.max_logprobs:
        raise over_cap("logprobs", "alternatives per token", lp, limits.max_logprobs, "max_logprobs")


def check_prompt(prompt: str | Sequence[int], limits: LimitsConfig, max_model_len: int) -> None:
    """A text prompt's bytes (before tokenizing it) or a token prompt's length."""
    if isinstance(prompt, str):
        # len() bounds the UTF-8 size from below (1 byte per char) and from above (4): encode
        # only when the cheap bounds do not decide.
        if len(prompt) > limits.max_prompt_bytes or (
                4 * len(prompt) > limits.max_prompt_bytes and utf8_len(prompt) > limits.max_prompt_bytes):
            raise over_cap("prompt", "bytes of UTF-8 text", utf8_len(prompt), limits.max_prompt_bytes,
                        "max_prompt_bytes")
    elif len(prompt) >= max_model_len:
        raise ContextLengthError(f"prompt: {len(prompt)} tokens leave no room to generate within the context "
                         f"window of {max_model_len} tokens")


def check_chat(messages: Sequence[dict], tools: Sequence[dict] | None, limits: LimitsConfig) -> None:
    """Before the chat template renders anything."""
    if len(messages) > limits.max_chat_messages:
        raise over_cap("messages", "messages", len(messages), limits.max_chat_messages, "max_chat_messages")
    total = 0
    for m in messages:
        for key, v in m.items():
            if isinstance(v, str):
                total += utf8_len(v) if key != "tool_calls" else 0
        if total > limits.max_prompt_bytes:
            raise over_cap("messages", "bytes of message text", total, limits.max_prompt_bytes, "max_prompt_bytes")
    structured = [tools or [], [m["tool_calls"] for m in messages if m.get("tool_calls")]]
    size = len(json.dumps(structured, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > limits.max_tools_bytes:
        raise over_cap("tools", "bytes of tool definitions and calls (JSON)", size, limits.max_tools_bytes,
                    "max_tools_bytes")


def utf8_len(text: str) -> int:
    # surrogatepass: a lone surrogate has a size too; rejecting it is not this check's job.
    return len(text.encode("utf-8", "surrogatepass"))
