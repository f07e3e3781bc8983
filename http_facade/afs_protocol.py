"""AFS (Formosa Foundation Model API) requests: validation and translation to engine requests.

Parameters (the ``parameters`` object): ``max_new_tokens``, ``temperature``, ``top_p``,
``top_k``, ``frequence_penalty`` (a multiplicative repetition penalty), ``stop_sequences`` (not
included in the output), ``show_probabilities`` (``details`` carries each token's
log-probability) and ``seed``; their defaults and ranges are ``api_models.AfsParameters``'. A
missing key or ``null`` takes the default, except ``seed``, where ``null`` means "random".

``stop`` is accepted as a synonym of ``stop_sequences`` because the seed's LangChain wrappers
send ``"stop": []``. Unknown keys are ignored (as the AFS service does).

The requests' types, ranges and defaults are the AFS models of ``api_models`` (the same ones
``/openapi.json`` shows): ``check`` validates a body with them. Every violation is an
``ApiError`` with status 422 naming the parameter (the AFS service is a FastAPI app: request
validation failures are 422 there); ``afs_errors`` documents the body. This module keeps what
needs more than a type: the ``stop`` synonym, a function message's name, ``<FILL_ME>``.
"""
from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from sluice.engine.rpc import engine_pb2 as pb
from sluice.http_facade import api_models as am
from sluice.http_facade.afs_errors import invalid
from sluice.http_facade.afs_functions import FunctionSpec, call_text, parse_functions, with_function_prompt
from sluice.http_facade.limits import RequestLimits
from sluice.http_facade.protocol import check_json_size, check_message_caps, check_prompt_caps
from sluice.http_facade.tools import call_constraint

MAX_STOP_SEQUENCES = 4
FILL_ME = "<FILL_ME>"

_ROLES = {"system": pb.ROLE_SYSTEM, "human": pb.ROLE_USER, "user": pb.ROLE_USER,
          "assistant": pb.ROLE_ASSISTANT, "function": pb.ROLE_TOOL}


# ------------------------------------------------------------------------------- validation
def check(model: type[BaseModel], body: dict) -> Any:
    """``body`` as ``model`` (an AFS request of ``api_models``). ``null`` is a missing key (the
    default), except ``seed``, where it means "random"."""
    try:
        return model.model_validate(_nulls_dropped(body))
    except ValidationError as exc:
        err = exc.errors()[0]
        param, description = _described(model, err["loc"])
        if err["type"] == "missing":
            message = f"{param}: required" + (f" ({description})" if description else "")
        else:
            wanted = description or ("an object" if err["type"] in _OBJECT_ERRORS else None)
            got = repr(err.get("input"))[:200]
            message = f"{param}: must be {wanted}, got {got}" if wanted else f"{param}: {err['msg']}"
        raise invalid(message, param) from None


_OBJECT_ERRORS = ("model_type", "model_attributes_type", "dict_type")


def _nulls_dropped(body: dict) -> dict:
    out = {k: v for k, v in body.items() if v is not None}
    if isinstance(out.get("parameters"), dict):
        out["parameters"] = {k: v for k, v in out["parameters"].items() if v is not None or k == "seed"}
    return out


def _described(model: type[BaseModel], loc: tuple) -> tuple[str, str | None]:
    """The parameter at pydantic's ``loc`` as AFS names it (``messages[0].role``; a field of
    ``parameters`` by its bare name) and its description; a union's tag in ``loc`` ends the walk."""
    param, description, annotation = "", None, model
    for part in loc:
        if isinstance(part, int):
            annotation, info = _item_of(annotation)
            param += f"[{part}]"
            description = info.description if info is not None else None
        elif (fields := _fields_of(annotation)) and part in fields:
            info = fields[part]
            param = part if param == "parameters" else f"{param}.{part}" if param else part
            annotation, description = info.annotation, info.description
        else:
            break
    return param, description


def _optional_of(annotation: Any) -> Any:
    """``X`` of ``X | None``; anything else as it is."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if len(args) == 1 else annotation


def _fields_of(annotation: Any) -> dict[str, FieldInfo]:
    annotation = _optional_of(annotation)
    return annotation.model_fields if isinstance(annotation, type) and issubclass(annotation, BaseModel) else {}


def _item_of(annotation: Any) -> tuple[Any, FieldInfo | None]:
    """A list's item type, and the ``Field`` its ``Annotated`` carries (if any)."""
    args = typing.get_args(_optional_of(annotation))
    item = args[0] if args else Any
    info = next((m for m in getattr(item, "__metadata__", ()) if isinstance(m, FieldInfo)), None)
    return item, info


# ------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class AfsParams:
    """The validated ``parameters`` (``api_models.AfsParameters`` holds their defaults and ranges)."""
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    frequence_penalty: float
    stop_sequences: tuple[str, ...]
    show_probabilities: bool
    seed: int | None

    def sampling(self) -> pb.SamplingParams:
        sp = pb.SamplingParams(max_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                               top_k=self.top_k, repetition_penalty=self.frequence_penalty,
                               stop=list(self.stop_sequences), include_stop_str_in_output=False)
        if self.seed is not None:
            sp.seed = self.seed
        if self.show_probabilities:
            sp.logprobs = True
        return sp


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
    """``body["parameters"]`` alone, validated."""
    return _params(check(_ParametersOnly, {"parameters": body.get("parameters")}).parameters, body)


def _params(p: am.AfsParameters | None, body: dict) -> AfsParams:
    """The checked ``parameters`` (``None``: all defaults) and the stop sequences of the raw body."""
    p = p or am.AfsParameters()
    raw = body.get("parameters")
    return AfsParams(p.max_new_tokens, float(p.temperature), float(p.top_p), p.top_k, float(p.frequence_penalty),
                     _stop_sequences(raw if isinstance(raw, dict) else {}), p.show_probabilities, p.seed)


class _ParametersOnly(BaseModel):
    """``parameters`` alone (text infilling checks its ``inputs`` itself)."""
    parameters: am.AfsParameters | None = None


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


def _content(m: am.AfsMessage, where: str, allow_null: bool) -> str:
    if m.content is None and not allow_null:
        raise invalid(f"{where}.content: must be a string", f"{where}.content")
    return m.content or ""


def _message(m: am.AfsMessage, i: int) -> pb.ChatMessage:
    where = f"messages[{i}]"
    call = m.function_call if m.role == "assistant" else None
    content = _content(m, where, allow_null=call is not None)
    msg = pb.ChatMessage(role=_ROLES[m.role], content=content)
    if call is not None:
        msg.content = "\n".join(filter(None, [content, call_text(call, f"{where}.function_call")]))
    if m.role == "function":
        if not m.name:
            raise invalid(f"{where}.name: the function's name is required on a function message", f"{where}.name")
        # a tool result in the engine's terms; the id pairs it with the call it answers
        msg.name, msg.tool_call_id = m.name, f"call_{i}"
    return msg


def parse_conversation(body: dict) -> AfsGeneration:
    req = check(am.AfsConversationRequest, body)
    chat_messages = [_message(m, i) for i, m in enumerate(req.messages)]
    functions = parse_functions(body.get("functions"))
    if functions:
        chat_messages = with_function_prompt(chat_messages, functions)
    params = _params(req.parameters, body)
    sampling = params.sampling()
    if functions:
        # The model may answer, or call one function: once it writes {"name" the call is held to a
        # declared function and its parameters' schema, and the answer ends after it.
        sampling.structured_output.CopyFrom(call_constraint(
            [(f.name, json.loads(f.schema_json)["parameters"]) for f in functions], "functions", True))
    request = pb.GenerateRequest(chat=pb.ChatInput(messages=chat_messages), sampling=sampling)
    return AfsGeneration(req.model, request, params, req.stream, functions)


def parse_generate(body: dict) -> AfsGeneration:
    req = check(am.AfsGenerateRequest, body)
    params = _params(req.parameters, body)
    request = pb.GenerateRequest(text=req.inputs, sampling=params.sampling())
    return AfsGeneration(req.model, request, params, req.stream)


def parse_infilling(body: dict) -> AfsGeneration:
    """``/models/text_infilling``: ``inputs`` around one ``<FILL_ME>``."""
    req = check(am.AfsGenerateRequest, body)
    prefix, suffix = split_fill_me(req.inputs)
    params = _params(req.parameters, body)
    request = pb.GenerateRequest(infill=pb.InfillInput(prefix=prefix, suffix=suffix), sampling=params.sampling())
    return AfsGeneration(req.model, request, params, req.stream)


def split_fill_me(text: str) -> tuple[str, str]:
    """(prefix, suffix) around the one ``<FILL_ME>``; 400 for none or several."""
    count = text.count(FILL_ME)
    if count != 1:
        raise invalid(f"inputs: must contain exactly one {FILL_ME} marker, found {count}", "inputs", 400)
    prefix, _, suffix = text.partition(FILL_ME)
    return prefix, suffix
