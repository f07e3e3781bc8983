"""Request validation: an OpenAI JSON body → a ``GenerationPlan`` holding the engine requests.

The facade checks types and the parameters only it understands (content parts, prompt shapes,
logit_bias keys, unsupported features); value ranges (top_p in (0, 1], ...) are the engine's
to check, and its INVALID_ARGUMENT comes back as a 400 naming the parameter. Unknown fields are
ignored, as OpenAI does; features we cannot honour are refused with a 400 naming the
parameter, never silently dropped. ``suffix`` makes each text prompt the prefix of a
fill-in-the-middle request (the route checks that the model has FIM tokens).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc.client_tools import tool_calls
from sluice.http_facade.errors import bad_request
from sluice.http_facade.json_body import decode_json
from sluice.http_facade.limits import RequestLimits, over, utf8_len
from sluice.http_facade.structured import structured_output
from sluice.http_facade.tools import tool_plan

_ROLES = {"system": pb.ROLE_SYSTEM, "developer": pb.ROLE_SYSTEM, "user": pb.ROLE_USER,
          "assistant": pb.ROLE_ASSISTANT, "tool": pb.ROLE_TOOL}
_MAX_COMPLETION_LOGPROBS = 5     # OpenAI's bound for the completions API's integer logprobs
_MAX_TOP_LOGPROBS = 20
_INT64 = (-(1 << 63), (1 << 63) - 1)
_INT32 = (-(1 << 31), (1 << 31) - 1)

# Numbers copied into SamplingParams when present: OpenAI name -> (proto field, kind).
_SAMPLING_NUMBERS = (
    ("temperature", "float"), ("top_p", "float"), ("top_k", "int"), ("min_p", "float"),
    ("presence_penalty", "float"), ("frequency_penalty", "float"), ("repetition_penalty", "float"),
    ("n", "int"), ("min_tokens", "int"), ("seed", "int64"),
)


@dataclass(frozen=True)
class GenerationPlan:
    kind: str                              # "chat" or "completion"
    model: str
    requests: tuple[pb.GenerateRequest, ...]  # one per prompt; choice index = prompt * n + j
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    echo: bool
    user: str | None
    tool_calls: str | None = None          # "auto" or "forced": the output may hold tool calls
    tool_names: tuple[str, ...] = ()       # the tools offered


# ------------------------------------------------------------------------------- primitives
def parse_json(raw: bytes) -> dict:
    """The body as a dict, or a 400 (``json_body.decode_json``: the one decoding path)."""
    return decode_json(raw)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


is_int = _is_int


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def get_int(body: dict, name: str, bounds: tuple[int, int] = _INT32) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad_request(f"{name}: must be an integer, got {v!r}", name)
    if not bounds[0] <= v <= bounds[1]:
        raise bad_request(f"{name}: must be in [{bounds[0]}, {bounds[1]}], got {v}", name)
    return v


def get_num(body: dict, name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v):
        raise bad_request(f"{name}: must be a number, got {v!r}", name)
    return float(v)


def get_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{name}: must be a boolean, got {v!r}", name)
    return v


def get_str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad_request(f"{name}: must be a string, got {type(v).__name__}", name)
    return v


def get_model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: you must provide a model name (see GET /v1/models)", "model")
    return model


# ---------------------------------------------------------------------------------- caps
def check_caps(body: dict, limits: RequestLimits) -> None:
    """The request caps, on the raw body, before anything is built from it: each check is a
    ``len()`` or a walk over items whose count is already capped. Types are checked later."""
    n = body.get("n")
    if _is_int(n) and n > limits.max_n:
        raise bad_request(over("n", "choices per request", n, limits.max_n, "max_n"), "n")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list):
        if len(stop) > limits.max_stop_strings:
            raise bad_request(over("stop", "stop strings", len(stop), limits.max_stop_strings, "max_stop_strings"),
                              "stop")
        longest = max((len(s) for s in stop if isinstance(s, str)), default=0)
        if longest > limits.max_stop_length:
            raise bad_request(over("stop", "characters per stop string", longest, limits.max_stop_length,
                                   "max_stop_length"), "stop")
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > limits.max_logit_bias:
        raise bad_request(over("logit_bias", "entries", len(bias), limits.max_logit_bias, "max_logit_bias"),
                          "logit_bias")
    for name in ("top_logprobs", "logprobs"):
        v = body.get(name)
        if _is_int(v) and v > limits.max_logprobs:
            raise bad_request(over(name, "alternatives per token", v, limits.max_logprobs, "max_logprobs"), name)
    check_prompt_caps(body.get("prompt"), limits)
    check_message_caps(body.get("messages"), limits)
    for name in ("tools", "functions"):
        if body.get(name) is not None:
            check_json_size(name, body[name], limits)


def check_prompt_caps(prompt: Any, limits: RequestLimits, name: str = "prompt") -> None:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list):
        return
    if prompt and all(_is_int(t) for t in prompt):
        prompt = [prompt]                         # one token prompt
    if len(prompt) > limits.max_prompts:
        raise bad_request(over(name, "prompts per request", len(prompt), limits.max_prompts, "max_prompts"),
                          name)
    for p in prompt:
        if isinstance(p, str) and len(p) > limits.max_prompt_bytes // 4 and utf8_len(p) > limits.max_prompt_bytes:
            raise bad_request(over(name, "bytes of UTF-8 text", utf8_len(p), limits.max_prompt_bytes,
                                   "max_prompt_bytes"), name)
        if isinstance(p, list) and len(p) > limits.max_prompt_tokens:
            raise bad_request(over(name, "token ids", len(p), limits.max_prompt_tokens, "max_prompt_tokens"),
                              name)


def check_message_caps(messages: Any, limits: RequestLimits) -> None:
    if not isinstance(messages, list):
        return
    if len(messages) > limits.max_chat_messages:
        raise bad_request(over("messages", "messages", len(messages), limits.max_chat_messages,
                               "max_chat_messages"), "messages")
    total = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            if isinstance(text, str):
                total += utf8_len(text)
        if total > limits.max_prompt_bytes:
            raise bad_request(over("messages", "bytes of message text", total, limits.max_prompt_bytes,
                                   "max_prompt_bytes"), "messages")
        if m.get("tool_calls") is not None:
            check_json_size("messages", m["tool_calls"], limits)


def check_json_size(name: str, value: Any, limits: RequestLimits) -> None:
    size = utf8_len(json.dumps(value, ensure_ascii=False))
    if size > limits.max_tools_bytes:
        raise bad_request(over(name, "bytes of JSON", size, limits.max_tools_bytes, "max_tools_bytes"), name)


# ------------------------------------------------------------------------------ sampling
def _sampling(body: dict, max_tokens: int | None) -> pb.SamplingParams:
    sp = pb.SamplingParams()
    for name, kind in _SAMPLING_NUMBERS:
        v = get_num(body, name) if kind == "float" else get_int(body, name, _INT64 if kind == "int64" else _INT32)
        if v is not None:
            setattr(sp, name, v)
    if max_tokens is None:
        sp.max_tokens_unlimited = True
    else:
        sp.max_tokens = max_tokens
    if get_bool(body, "ignore_eos"):
        sp.ignore_eos = True
    sp.stop.extend(_stop(body.get("stop")))
    for tok, bias in _logit_bias(body.get("logit_bias")).items():
        sp.logit_bias[tok] = bias
    constraint = structured_output(body)
    if constraint is not None:
        sp.structured_output.CopyFrom(constraint)
    return sp


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise bad_request("stop: must be a string or a list of strings", "stop")


def _logit_bias(value: Any) -> dict[int, float]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("logit_bias: must be an object mapping token ids to biases", "logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias: key {key!r} is not a token id", "logit_bias") from None
        if not _INT32[0] <= tok <= _INT32[1]:
            raise bad_request(f"logit_bias: token id {key!r} is out of range", "logit_bias")
        if not _is_num(bias):
            raise bad_request(f"logit_bias: the bias of token {key} must be a number", "logit_bias")
        out[tok] = float(bias)
    return out


def _max_tokens(body: dict, names: tuple[str, ...], default: int | None) -> int | None:
    for name in names:
        v = get_int(body, name)
        if v is not None:
            if v < 1:
                raise bad_request(f"{name}: must be >= 1, got {v}", name)
            return v
    return default


def _stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise bad_request("stream_options: must be an object", "stream_options")
    if not stream:
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")
    return get_bool(opts, "include_usage")


# ---------------------------------------------------------------------------------- chat
def _content(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"{where}: must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                              f"supported, got {kind!r}", f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def _message(m: Any, i: int) -> pb.ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where}: must be an object", where)
    role = m.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise bad_request(f"{where}.role: must be one of system, developer, user, assistant, tool; got {role!r}",
                          f"{where}.role")
    msg = pb.ChatMessage(role=_ROLES[role], content=_content(m.get("content"), f"{where}.content"))
    for name in ("name", "tool_call_id"):
        v = m.get(name)
        if v is not None:
            if not isinstance(v, str):
                raise bad_request(f"{where}.{name}: must be a string", f"{where}.{name}")
            setattr(msg, name, v)
    if role == "tool" and not msg.tool_call_id:
        raise bad_request(f"{where}.tool_call_id: required for a tool message", f"{where}.tool_call_id")
    calls = m.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls: a list, on assistant messages only", f"{where}.tool_calls")
        try:
            msg.tool_calls.extend(tool_calls(calls, f"{where}.tool_calls"))
        except ValueError as exc:   # "messages[1].tool_calls[0].function.name: ..."
            raise bad_request(str(exc), str(exc).split(":", 1)[0]) from None
    return msg


def chat_messages(messages: list) -> list[pb.ChatMessage]:
    """OpenAI chat messages, validated (400 naming ``messages[i]...``)."""
    return [_message(m, i) for i, m in enumerate(messages)]


def parse_chat(body: dict, default_max_tokens: int | None = None,
               limits: RequestLimits = RequestLimits()) -> GenerationPlan:
    """``default_max_tokens``: used when the client sets none (None: until the context window is full)."""
    check_caps(body, limits)
    model = get_model(body)
    tools = tool_plan(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: must be a non-empty list of messages", "messages")
    chat = pb.ChatInput(messages=[_message(m, i) for i, m in enumerate(messages)])
    if tools is not None:
        chat.tools.extend(tools.tools)
    stream = get_bool(body, "stream")
    logprobs = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs", (0, _MAX_TOP_LOGPROBS))
    if top is not None and not logprobs:
        raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    sp = _sampling(body, _max_tokens(body, ("max_completion_tokens", "max_tokens"), default_max_tokens))
    if logprobs:
        sp.logprobs = True
        sp.top_logprobs = top or 0
    if tools is not None:
        if sp.HasField("structured_output"):
            raise bad_request(f"tools: tool calls (tool_choice {tools.mode}) cannot be combined with "
                              f"{sp.structured_output.param}; set tool_choice to \"none\" or drop "
                              f"{sp.structured_output.param}", "tools")
        sp.structured_output.CopyFrom(tools.constraint)
    req = pb.GenerateRequest(chat=chat, sampling=sp)
    return GenerationPlan("chat", model, (req,), sp.n if sp.HasField("n") else 1, stream,
                          _stream_options(body, stream), logprobs, top or 0, False, get_str(body, "user"),
                          tool_calls=tools.mode if tools is not None else None,
                          tool_names=tools.names if tools is not None else ())


# ---------------------------------------------------------------------------- completions
def _prompts(value: Any) -> list[pb.GenerateRequest]:
    """A string, a list of strings, a list of token ids or a list of token-id lists."""
    if isinstance(value, str):
        return [pb.GenerateRequest(text=value)]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return [pb.GenerateRequest(text=p) for p in value]
        if all(_is_int(t) for t in value):
            return [_token_prompt(value, "prompt")]
        if all(isinstance(p, list) for p in value):
            return [_token_prompt(p, f"prompt[{i}]") for i, p in enumerate(value)]
    raise bad_request("prompt: must be a string, a list of strings, a list of token ids or a list of "
                      "token-id lists (non-empty)", "prompt")


def _token_prompt(ids: list, where: str) -> pb.GenerateRequest:
    if not ids or not all(_is_int(t) and _INT32[0] <= t <= _INT32[1] for t in ids):
        raise bad_request(f"{where}: must be a non-empty list of token ids", where)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))


def _infill(req: pb.GenerateRequest, suffix: str, index: int | None) -> pb.GenerateRequest:
    """``suffix``: fill in the middle, the prompt being the prefix (a model with FIM tokens;
    the route checks the model's "infilling" capability)."""
    where = "prompt" if index is None else f"prompt[{index}]"
    if req.WhichOneof("input") != "text":
        raise bad_request(f"{where}: a suffix needs text prompts (the prefix), not token ids", where)
    if not req.text and not suffix:
        raise bad_request("suffix: the prompt (prefix) and suffix cannot both be empty", "suffix")
    return pb.GenerateRequest(infill=pb.InfillInput(prefix=req.text, suffix=suffix))


def parse_completion(body: dict, limits: RequestLimits = RequestLimits()) -> GenerationPlan:
    check_caps(body, limits)
    model = get_model(body)
    bases = _prompts(body.get("prompt"))
    suffix = get_str(body, "suffix")
    if suffix is not None:
        bases = [_infill(req, suffix, i if len(bases) > 1 else None) for i, req in enumerate(bases)]
    stream = get_bool(body, "stream")
    lp = get_int(body, "logprobs", (0, _MAX_COMPLETION_LOGPROBS))
    echo = get_bool(body, "echo")
    if echo and suffix is not None:
        raise bad_request("echo: cannot be combined with suffix (the prompt of an infill is built by the "
                          "engine from the model's FIM tokens)", "echo")
    if echo and lp is not None:
        raise bad_request("echo: echo together with logprobs needs prompt logprobs, not supported yet", "echo")
    sp = _sampling(body, _max_tokens(body, ("max_tokens",), 16))   # OpenAI's completions default
    n = sp.n if sp.HasField("n") else 1
    best_of = get_int(body, "best_of")
    if best_of is not None and best_of != n:
        raise bad_request("best_of: only best_of == n is supported", "best_of")
    if lp is not None:
        sp.logprobs = True
        sp.top_logprobs = lp
    for req in bases:
        req.sampling.CopyFrom(sp)
    return GenerationPlan("completion", model, tuple(bases), n, stream, _stream_options(body, stream),
                          lp is not None, lp or 0, echo, get_str(body, "user"))
