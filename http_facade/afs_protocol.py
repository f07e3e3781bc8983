"""AFS (Formosa Foundation Model API) requests: validation and translation to engine requests.

Parameters (``parameters`` object; a missing key or ``null`` takes the default, except ``seed``
where ``null`` means "random"):

============================  ========  =====================================================
name                          default   range / meaning
============================  ========  =====================================================
``max_new_tokens``            350       integer > 0
``temperature``               1.0       number > 0
``top_p``                     1.0       number in (0, 1]
``top_k``                     50        integer in [1, 100]
``frequence_penalty``         1.0       number > 0; multiplicative repetition penalty, 1.0 = none
``stop_sequences`` (``stop``) none      at most 4 non-empty strings, not included in the output
``show_probabilities``        false     boolean: ``details`` carries each token's log-probability
``seed``                      42        ``null`` (random) or an integer >= 0
============================  ========  =====================================================

``stop`` is accepted as a synonym of ``stop_sequences`` because the seed's LangChain wrappers
send ``"stop": []``. Unknown keys are ignored (as the AFS service does).

Every violation is an ``ApiError`` with status 422 naming the parameter (the AFS service is a
FastAPI app: request validation failures are 422 there); ``afs_errors`` documents the body.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade.afs_errors import invalid
from sluice.http_facade.afs_functions import FunctionSpec, call_text, parse_functions, with_function_prompt
from sluice.http_facade.limits import RequestLimits
from sluice.http_facade.protocol import check_json_size, check_message_caps, check_prompt_caps
from sluice.http_facade.tools import call_constraint

DEFAULT_SEED = 42
MAX_STOP_SEQUENCES = 4
_INT64_MAX = (1 << 63) - 1
_INT32_MAX = (1 << 31) - 1
FILL_ME = "<FILL_ME>"

_ROLES = {"system": pb.ROLE_SYSTEM, "human": pb.ROLE_USER, "user": pb.ROLE_USER,
          "assistant": pb.ROLE_ASSISTANT, "function": pb.ROLE_TOOL}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class AfsParams:
    max_new_tokens: int = 350
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    frequence_penalty: float = 1.0
    stop_sequences: tuple[str, ...] = ()
    show_probabilities: bool = False
    seed: int | None = DEFAULT_SEED

    def sampling(self) -> pb.SamplingParams:
        sp = pb.SamplingParams(max_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                               top_k=self.top_k, repetition_penalty=self.frequence_penalty,
                               stop=list(self.stop_sequences), include_stop_str_in_output=False)
        if self.seed is not None:
            sp.seed = self.seed
        if self.show_probabilities:
            sp.logprobs = True
        return sp


def _number(params: dict, name: str, default: float, low: float, high: float | None = None) -> float:
    """A number > ``low`` (and <= ``high`` when given)."""
    v = params.get(name)
    if v is None:
        return default
    bound = f"> {low:g}" + ("" if high is None else f" and <= {high:g}")
    if not _is_num(v) or not (v > low and (high is None or v <= high)):
        raise invalid(f"{name}: must be a number {bound}, got {v!r}", name)
    return float(v)


def _integer(params: dict, name: str, default: int, low: int, high: int) -> int:
    v = params.get(name)
    if v is None:
        return default
    if not _is_int(v) or not low <= v <= high:
        raise invalid(f"{name}: must be an integer in [{low}, {high}], got {v!r}", name)
    return v


def _stop_sequences(params: dict) -> tuple[str, ...]:
    given = [(n, params.get(n)) for n in ("stop_sequences", "stop") if params.get(n) not in (None, [])]
    if len(given) > 1:
        raise invalid("stop_sequences: give stop_sequences or stop, not both", "stop_sequences")
    if not given:
        return ()
    name, v = given[0]
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise invalid(f"{name}: must be a list of non-empty strings", name)
    if len(v) > MAX_STOP_SEQUENCES:
        raise invalid(f"{name}: at most {MAX_STOP_SEQUENCES} sequences, got {len(v)}", name)
    return tuple(v)


def parse_params(body: dict) -> AfsParams:
    params = body.get("parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise invalid("parameters: must be an object", "parameters")
    show = params.get("show_probabilities")
    if show is not None and not isinstance(show, bool):
        raise invalid(f"show_probabilities: must be true or false, got {show!r}", "show_probabilities")
    seed = params.get("seed", DEFAULT_SEED)
    if seed is not None and (not _is_int(seed) or not 0 <= seed <= _INT64_MAX):
        raise invalid(f"seed: must be null or an integer >= 0, got {seed!r}", "seed")
    return AfsParams(
        max_new_tokens=_integer(params, "max_new_tokens", 350, 1, _INT32_MAX),
        temperature=_number(params, "temperature", 1.0, 0.0),
        top_p=_number(params, "top_p", 1.0, 0.0, 1.0),
        top_k=_integer(params, "top_k", 50, 1, 100),
        frequence_penalty=_number(params, "frequence_penalty", 1.0, 0.0),
        stop_sequences=_stop_sequences(params),
        show_probabilities=bool(show),
        seed=seed,
    )


# ------------------------------------------------------------------------------------ caps
def check_caps(body: dict, limits: RequestLimits) -> None:
    """The request caps on the raw body (400 naming the field), before anything is built."""
    inputs = body.get("inputs")
    if isinstance(inputs, str):
        check_prompt_caps(inputs, limits, "inputs")
    check_message_caps(body.get("messages"), limits)
    if body.get("functions") is not None:
        check_json_size("functions", body["functions"], limits)


# ---------------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class AfsGeneration:
    """One AFS generation request: the engine request and what shaping the answer needs."""
    model: str
    request: pb.GenerateRequest
    params: AfsParams
    stream: bool
    functions: tuple[FunctionSpec, ...] = ()


def parse_model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: a model name is required", "model")
    return model


def parse_stream(body: dict) -> bool:
    v = body.get("stream")
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(f"stream: must be true or false, got {v!r}", "stream")
    return v


def _inputs_text(body: dict) -> str:
    text = body.get("inputs")
    if not isinstance(text, str) or not text:
        raise invalid("inputs: must be a non-empty string", "inputs")
    return text


def _content(m: dict, where: str, allow_null: bool) -> str:
    content = m.get("content")
    if content is None and allow_null:
        return ""
    if not isinstance(content, str):
        raise invalid(f"{where}.content: must be a string", f"{where}.content")
    return content


def _message(m: Any, i: int) -> pb.ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(f"{where}: must be an object", where)
    role = m.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise invalid(f"{where}.role: must be one of system, human, user, assistant, function; got {role!r}",
                      f"{where}.role")
    call = m.get("function_call") if role == "assistant" else None
    content = _content(m, where, allow_null=call is not None)
    msg = pb.ChatMessage(role=_ROLES[role], content=content)
    if call is not None:
        msg.content = "\n".join(filter(None, [content, call_text(call, f"{where}.function_call")]))
    if role == "function":
        name = m.get("name")
        if not isinstance(name, str) or not name:
            raise invalid(f"{where}.name: the function's name is required on a function message", f"{where}.name")
        # a tool result in the engine's terms; the id pairs it with the call it answers
        msg.name, msg.tool_call_id = name, f"call_{i}"
    return msg


def parse_conversation(body: dict) -> AfsGeneration:
    model = parse_model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: must be a non-empty list of messages", "messages")
    chat_messages = [_message(m, i) for i, m in enumerate(messages)]
    functions = parse_functions(body.get("functions"))
    if functions:
        chat_messages = with_function_prompt(chat_messages, functions)
    params = parse_params(body)
    sampling = params.sampling()
    if functions:
        # The model may answer, or call one function: once it writes {"name" the call is held to a
        # declared function and its parameters' schema, and the answer ends after it.
        sampling.structured_output.CopyFrom(call_constraint(
            [(f.name, json.loads(f.schema_json)["parameters"]) for f in functions], "functions", True))
    request = pb.GenerateRequest(chat=pb.ChatInput(messages=chat_messages), sampling=sampling)
    return AfsGeneration(model, request, params, parse_stream(body), functions)


def parse_generate(body: dict) -> AfsGeneration:
    model = parse_model(body)
    params = parse_params(body)
    request = pb.GenerateRequest(text=_inputs_text(body), sampling=params.sampling())
    return AfsGeneration(model, request, params, parse_stream(body))


def split_fill_me(text: str) -> tuple[str, str]:
    """(prefix, suffix) around the one ``<FILL_ME>``; 400 for none or several."""
    count = text.count(FILL_ME)
    if count != 1:
        raise invalid(f"inputs: must contain exactly one {FILL_ME} marker, found {count}", "inputs", 400)
    prefix, _, suffix = text.partition(FILL_ME)
    return prefix, suffix
