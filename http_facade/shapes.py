"""OpenAI response shapes: chat and completion objects, chunks, logprobs, finish reasons."""
from __future__ import annotations

import hashlib
import math
from typing import Any
from dataclasses import dataclass, field

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade.errors import ApiError, engine_failure, unavailable
from sluice.http_facade.tools import split_calls

_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}
_MIN_LOGPROB = -9999.0   # JSON has no -Infinity


def fingerprint(model: pb.ModelInfo) -> str:
    key = "|".join((model.name, model.path, model.dtype, model.device, model.attention_backend))
    return "fp_sluice_" + hashlib.sha256(key.encode()).hexdigest()[:10]


def finish_reason(final: pb.ChoiceFinal) -> str:
    """The OpenAI finish_reason, or raise for a choice the engine aborted or failed."""
    reason = _FINISH.get(final.finish_reason)
    if reason is not None:
        return reason
    if final.finish_reason == pb.FINISH_REASON_ABORT:
        raise unavailable("the request was aborted by the engine (it is shutting down or draining)")
    raise engine_failure(final.error)


def finish_error(final: pb.ChoiceFinal) -> ApiError | None:
    try:
        finish_reason(final)
    except ApiError as err:
        return err
    return None


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _MIN_LOGPROB


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(items: list[pb.TokenLogprob]) -> dict:
    content = [{"token": lp.token, "logprob": _lp(lp.logprob), "bytes": _bytes(lp.token),
                "top_logprobs": [{"token": t.token, "logprob": _lp(t.logprob), "bytes": _bytes(t.token)}
                                 for t in lp.top]}
               for lp in items]
    return {"content": content, "refusal": None}


def completion_logprobs(items: list[pb.TokenLogprob], offset: int) -> dict:
    """The legacy completions shape; ``offset`` is where the first token's text starts."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in items:
        tokens.append(lp.token)
        values.append(_lp(lp.logprob))
        tops.append({t.token: _lp(t.logprob) for t in lp.top})
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


@dataclass
class ChoiceState:
    """One choice accumulated over the stream (non-streaming responses, offsets, role)."""
    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    final: pb.ChoiceFinal | None = None
    started: bool = False
    offset: int = 0           # characters emitted so far (completion logprobs' text_offset)
    scanner: Any = None       # tools offered: the stream's http_facade.tools.CallScanner

    def add(self, delta: pb.ChoiceDelta) -> None:
        self.text.append(delta.text)
        self.logprobs.extend(delta.logprobs)
        if delta.HasField("final"):
            self.final = delta.final


@dataclass(frozen=True)
class Envelope:
    """The fields every object and chunk of one response shares."""
    id: str
    created: int
    model: str
    system_fingerprint: str

    def base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint}


def chat_response(env: Envelope, choices: list[ChoiceState], usage: dict, logprobs: bool,
                  tool_names: tuple[str, ...] | None = None) -> dict:
    """``tool_names``: tools were offered, and each choice's text is split into content and
    ``tool_calls`` (``http_facade.tools.split_calls``); a choice that made calls and stopped has
    ``finish_reason: "tool_calls"``."""
    out = env.base("chat.completion")
    out["choices"] = []
    for c in choices:
        text, reason = "".join(c.text), finish_reason(c.final)
        message = {"role": "assistant", "content": text, "refusal": None, "tool_calls": None}
        if tool_names is not None:
            content, calls = split_calls(text, tool_names)
            if calls:
                message["content"], message["tool_calls"] = content, calls
                reason = "tool_calls" if reason == "stop" else reason
        out["choices"].append({"index": c.index, "message": message,
                               "logprobs": chat_logprobs(c.logprobs) if logprobs else None,
                               "finish_reason": reason})
    out["usage"] = usage
    return out


def completion_response(env: Envelope, choices: list[ChoiceState], usage: dict, logprobs: bool,
                        echo_texts: dict[int, str]) -> dict:
    out = env.base("text_completion")
    out["choices"] = []
    for c in choices:
        prefix = echo_texts.get(c.index, "")
        out["choices"].append({
            "index": c.index,
            "text": prefix + "".join(c.text),
            "logprobs": completion_logprobs(c.logprobs, len(prefix)) if logprobs else None,
            "finish_reason": finish_reason(c.final),
        })
    out["usage"] = usage
    return out


def chat_chunk(env: Envelope, index: int, delta: dict, finish: str | None, logprobs: dict | None,
               with_usage_field: bool) -> dict:
    out = env.base("chat.completion.chunk")
    out["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    if with_usage_field:
        out["usage"] = None
    return out


def completion_chunk(env: Envelope, index: int, text: str, finish: str | None, logprobs: dict | None,
                     with_usage_field: bool) -> dict:
    out = env.base("text_completion")
    out["choices"] = [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]
    if with_usage_field:
        out["usage"] = None
    return out


def usage_chunk(env: Envelope, kind: str, usage: dict) -> dict:
    out = env.base("chat.completion.chunk" if kind == "chat" else "text_completion")
    out["choices"] = []
    out["usage"] = usage
    return out
