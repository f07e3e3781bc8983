"""Typed request models (pydantic v2) of the OpenAI dialect, of the endpoints beside it
(responses, rerank, score, tokenize) and of AFS: the source of ``/openapi.json`` (openapi.py)
and the first validation step of each request (``check`` here; ``afs_protocol.check`` for AFS).
The response models are in ``api_responses``.

``check(Model, body)`` validates the JSON body before the route's own parser runs: types, required
fields, enumerations and bounds that the model states. Its 400 names the parameter as the
parsers do (``messages[0].role``, ``max_tokens``) with the same kind of message
(``temperature: must be a number, got 'hot'``); the parsers then check what needs more than a
type (caps, cross-field rules, the engine's ranges). Unknown fields are allowed, as OpenAI
ignores them.

The grammar path's sub-objects (``tools``, ``tool_choice``, ``response_format``, the
``guided_*`` fields, ``text.format``) are documented precisely here but validated by
``tools.py`` / ``structured.py``, whose messages clients already rely on: their fields are typed
loosely for ``check`` and carry their real schema with ``WithJsonSchema``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, TypeAdapter,
                      ValidationError, WithJsonSchema)

from sluice.http_facade.errors import bad_request

Number = Union[StrictInt, StrictFloat]
TokenIds = list[StrictInt]


def inline(schema: dict) -> dict:
    """``schema`` with its ``$defs`` substituted where they are referenced (a schema embedded in
    another document cannot keep refs to its own root; none of these is recursive)."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk(defs[ref[len("#/$defs/"):]])
            return {k: walk(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


def shaped(annotation: Any) -> Any:
    """A field documented as ``annotation`` but checked by the route's parser, whose message for
    a wrong shape is more precise than a union's ("prompt[1]: must be a non-empty list of token
    ids")."""
    return Annotated[Any, WithJsonSchema(inline(TypeAdapter(annotation).json_schema()))]


class _Open(BaseModel):
    """Requests: unknown fields are allowed (and ignored)."""
    model_config = ConfigDict(extra="allow")


_TOOLS_SCHEMA = {"type": "array", "items": {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "description": {"type": "string"},
        "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}}}}
_TOOL_CHOICE_SCHEMA = {"oneOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]}
_RESPONSE_FORMAT_SCHEMA = {"oneOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]},
                                                            "schema": {}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_schema"}, "json_schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                         "strict": {"type": "boolean"}}}}}]}
Tools = Annotated[Any, WithJsonSchema(_TOOLS_SCHEMA)]
ToolChoice = Annotated[Any, WithJsonSchema(_TOOL_CHOICE_SCHEMA)]
ResponseFormat = Annotated[Any, WithJsonSchema(_RESPONSE_FORMAT_SCHEMA)]
JsonValue = Annotated[Any, WithJsonSchema({})]


# ------------------------------------------------------------------------------- requests
class StreamOptions(_Open):
    include_usage: StrictBool | None = None


class _Sampling(_Open):
    model: StrictStr = Field(description="a served model's name (GET /v1/models)")
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    n: StrictInt | None = Field(None, ge=1)
    seed: StrictInt | None = None
    stop: shaped(Union[StrictStr, list[StrictStr], None]) = None
    logit_bias: dict[str, Number] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    response_format: ResponseFormat = None
    guided_json: JsonValue = None
    guided_regex: JsonValue = None
    guided_choice: JsonValue = None
    guided_grammar: JsonValue = None


class TextPart(_Open):
    type: Literal["text"]
    text: StrictStr


class ToolCallFunction(_Open):
    name: StrictStr
    arguments: StrictStr


class ToolCall(_Open):
    id: StrictStr
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: shaped(Union[StrictStr, list[TextPart], None]) = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: Annotated[Any, WithJsonSchema({"type": "array", "items": inline(ToolCall.model_json_schema())})] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0)   # the cap is the server's max_logprobs (limits.py)
    tools: Tools = None
    tool_choice: ToolChoice = None
    parallel_tool_calls: StrictBool | None = None


class CompletionRequest(_Sampling):
    prompt: shaped(Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]])
    suffix: StrictStr | None = Field(None, description="fill in the middle (models with FIM tokens)")
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    echo: StrictBool | None = None
    best_of: StrictInt | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)


class EmbeddingRequest(_Open):
    model: StrictStr
    input: shaped(Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]])
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: StrictInt | None = Field(None, ge=1)


class Document(_Open):
    text: StrictStr


class RerankRequest(_Open):
    model: StrictStr
    query: StrictStr
    documents: shaped(list[Union[StrictStr, Document]])
    top_n: StrictInt | None = Field(None, ge=1)
    return_documents: StrictBool | None = None


class ScoreRequest(_Open):
    model: StrictStr
    text_1: shaped(Union[StrictStr, list[StrictStr]])
    text_2: shaped(Union[StrictStr, list[StrictStr]])


class TokenizeRequest(_Open):
    """Exactly one of ``prompt`` (vLLM), ``content`` (llama.cpp) or ``messages``."""
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    content: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_special: StrictBool | None = None
    add_generation_prompt: StrictBool | None = None
    tools: Tools = None
    return_token_strs: StrictBool | None = Field(None, description="vLLM: add token_strs, each token's spelling")
    with_pieces: StrictBool | None = Field(None, description="llama.cpp: tokens as {id, piece} objects")


class DetokenizeRequest(_Open):
    model: StrictStr | None = None
    tokens: shaped(list[Annotated[StrictInt, Field(ge=0)]])
    skip_special_tokens: StrictBool | None = None


class InputText(_Open):
    type: Literal["input_text", "output_text", "text"]
    text: StrictStr


class InputMessage(_Open):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[InputText]


class FunctionCallItem(_Open):
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr


class FunctionCallOutputItem(_Open):
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr | list[InputText]


_INPUT_ITEMS = {"type": "array", "minItems": 1, "items": {"anyOf": [
    inline(m.model_json_schema()) for m in (InputMessage, FunctionCallItem, FunctionCallOutputItem)]}}
_RESPONSE_TOOLS = {"type": "array", "items": {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"const": "function"}, "name": {"type": "string"}, "description": {"type": "string"},
    "parameters": {"type": "object"}, "strict": {"type": "boolean"}}}}
_TEXT_FORMAT = {"type": "object", "properties": {"format": {"oneOf": [
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "schema"], "properties": {
        "type": {"const": "json_schema"}, "name": {"type": "string"}, "schema": {"type": "object"},
        "strict": {"type": "boolean"}, "description": {"type": "string"}}}]}}}


class ResponseCreateRequest(_Open):
    model: StrictStr
    # Items are checked by responses_protocol (its messages name input[i].field).
    input: Annotated[Any, WithJsonSchema({"oneOf": [{"type": "string"}, _INPUT_ITEMS]})]
    instructions: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    tools: Annotated[Any, WithJsonSchema(_RESPONSE_TOOLS)] = None
    tool_choice: Annotated[Any, WithJsonSchema({"oneOf": [
        {"enum": ["none", "auto", "required"]},
        {"type": "object", "required": ["type", "name"], "properties": {"type": {"const": "function"},
                                                                        "name": {"type": "string"}}}]})] = None
    parallel_tool_calls: StrictBool | None = None
    text: Annotated[Any, WithJsonSchema(_TEXT_FORMAT)] = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Number | None = None
    top_p: Number | None = None
    stream: StrictBool | None = None
    store: StrictBool | None = None
    metadata: dict[str, StrictStr] | None = Field(None, max_length=16)
    user: StrictStr | None = None
    truncation: Literal["disabled"] | None = None
    # Checked by responses_protocol, whose 400s name include / reasoning.effort with the value.
    include: Annotated[Any, WithJsonSchema({"type": "array", "items": {"enum": ["message.output_text.logprobs"]},
                                            "description": "the one value offered: the output text's logprobs"})
                       ] = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    reasoning: Annotated[Any, WithJsonSchema({
        "type": "object", "description": "the served models have no reasoning mode: only null values",
        "properties": {"effort": {"type": "null"}, "summary": {"type": "null"}}})] = None
    background: StrictBool | None = Field(None, description="answer at once (queued); poll or cancel it by id")


# ---------------------------------------------------------------------- AFS (/models/...)
# The AFS dialect's requests: the validation of its routes (``afs_protocol.check``, whose 422
# names the parameter as AFS does, ``temperature`` inside ``parameters`` by its bare name) and the
# dialect's part of /openapi.json. A field's ``description`` is what it "must be" in the error
# message too ("top_k: must be an integer in [1, 100], got 0"). What needs more than a type stays
# with the parsers: which of two alternatives was given, ``<FILL_ME>``, a function message's
# name; ``shaped`` fields (stop sequences and their ``stop`` synonym, functions, embedding inputs,
# rerank pairs) are checked by the code both dialects share or by afs_functions.
_INT32_MAX = (1 << 31) - 1
_INT64_MAX = (1 << 63) - 1


class AfsParameters(_Open):
    """A missing key or ``null`` takes the default, except ``seed`` (``null``: random)."""
    max_new_tokens: StrictInt = Field(350, ge=1, le=_INT32_MAX, description=f"an integer in [1, {_INT32_MAX}]")
    temperature: StrictFloat = Field(1.0, gt=0, description="a number > 0")
    top_p: StrictFloat = Field(1.0, gt=0, le=1, description="a number > 0 and <= 1")
    top_k: StrictInt = Field(50, ge=1, le=100, description="an integer in [1, 100]")
    frequence_penalty: StrictFloat = Field(1.0, gt=0, description="a number > 0 (multiplicative; 1.0 = none)")
    stop_sequences: shaped(Annotated[list[str], Field(max_length=4)]) = None
    show_probabilities: StrictBool = Field(False, description="true or false")
    seed: StrictInt | None = Field(42, ge=0, le=_INT64_MAX, description="null (random) or an integer >= 0")


class AfsMessage(_Open):
    role: Literal["system", "human", "user", "assistant", "function"] = Field(
        description="one of system, human, user, assistant, function")
    content: StrictStr | None = Field(None, description="a string (null only beside a function_call)")
    name: StrictStr | None = Field(None, description="a string (the function's name, on a function message)")
    function_call: dict[str, Any] | None = Field(None, description="an object: name and arguments")


class AfsFunction(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _AfsRequest(_Open):
    """What every AFS request has."""
    model: StrictStr = Field(min_length=1, description="a served model's name")


class _AfsGeneration(_AfsRequest):
    parameters: AfsParameters | None = Field(None, description="an object")
    stream: StrictBool = Field(False, description="true or false")


class AfsConversationRequest(_AfsGeneration):
    messages: list[AfsMessage] = Field(min_length=1, description="a non-empty list of messages")
    functions: shaped(list[AfsFunction] | None) = None


class AfsGenerateRequest(_AfsGeneration):
    """``/models/generate``; ``/models/text_infilling`` too, its ``inputs`` holding one ``<FILL_ME>``."""
    inputs: StrictStr = Field(min_length=1, description="a non-empty string")


class AfsEmbedParameters(_Open):
    input_type: Literal["query", "document"] = Field("document", description="'query' or 'document'")
    normalize: StrictBool = Field(True, description="true or false")


class AfsEmbeddingsRequest(_AfsRequest):
    """V1 ``inputs`` (strings) or V2 / OpenAI-style ``input``: exactly one."""
    inputs: shaped(list[str] | None) = None
    input: shaped(Union[StrictStr, list[StrictStr], TokenIds, list[TokenIds]]) = None
    encoding_format: shaped(Literal["float", "base64"]) = "float"
    dimensions: shaped(Annotated[int, Field(ge=0)]) = 0
    parameters: AfsEmbedParameters | None = Field(None, description="an object")


class AfsRerankParameters(_Open):
    top_n: StrictInt = Field(3, ge=1, description="an integer >= 1")


class AfsRerankRequest(_AfsRequest):
    """``inputs`` as [query, document] pairs, or ``query`` + ``documents``."""
    inputs: shaped(list[Annotated[list[str], Field(min_length=2, max_length=2)]] | None) = None
    query: StrictStr | None = Field(None, min_length=1, description="a non-empty string (or send inputs pairs)")
    documents: list[Annotated[StrictStr, Field(min_length=1, description="a non-empty string")]] | None = Field(
        None, min_length=1, description="a non-empty list of non-empty strings")
    parameters: AfsRerankParameters | None = Field(None, description="an object")


# ---------------------------------------------------------------------------- validation
# Pydantic's error types → the facade's phrasing ("must be a number").
_PHRASES = {
    "bool_type": "must be a boolean", "int_type": "must be an integer", "float_type": "must be a number",
    "string_type": "must be a string", "list_type": "must be a list", "dict_type": "must be an object",
    "model_type": "must be an object", "model_attributes_type": "must be an object",
    "missing": "required", "too_short": "must not be empty", "int_from_float": "must be an integer",
}


def _field_names(model: type[BaseModel], seen: set | None = None) -> set[str]:
    seen = set() if seen is None else seen
    names: set[str] = set()
    if model in seen:
        return names
    seen.add(model)
    for name, info in model.model_fields.items():
        names.add(name)
        for arg in _types_in(info.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                names |= _field_names(arg, seen)
    return names


def _types_in(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", None)
    if not args:
        return [annotation]
    out = []
    for a in args:
        out += _types_in(a)
    return out


_FIELDS: dict[type, set[str]] = {}


def _param(model: type[BaseModel], loc: tuple) -> tuple[str, bool]:
    """``messages[0].content`` from a pydantic location, cut where a union or a mapping's key
    begins (those parts are pydantic's own tags or the client's keys); True when it was cut."""
    names = _FIELDS.setdefault(model, _field_names(model))
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in names:
            out += ("." if out else "") + part
        else:
            return out, True
    return out, False


def _message(err: dict, param: str, cut: bool, kinds: set[str]) -> str:
    got = err.get("input")
    shown = "" if err["type"] == "missing" else f", got {got!r}"[:200]
    if cut and kinds <= {"int_type", "float_type"}:
        return f"{param}: must be a number{shown}"
    if cut:
        return f"{param}: does not match the documented types (see /openapi.json){shown}"
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "literal_error":
        return f"{param}: must be one of {ctx.get('expected')}{shown}"
    if kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
        op = {"greater_than_equal": ">=", "less_than_equal": "<=", "greater_than": ">", "less_than": "<"}[kind]
        bound = next(iter(ctx.values()), "")
        return f"{param}: must be {op} {bound}{shown}"
    if kind == "too_long":
        return f"{param}: at most {ctx.get('max_length')} items{shown}"
    return f"{param}: {_PHRASES.get(kind, err['msg'])}{shown}"


def check(model: type[BaseModel], body: dict) -> None:
    """Validate ``body`` against ``model``; a 400 naming the first wrong parameter."""
    try:
        model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        err = errors[0]
        param, cut = _param(model, tuple(err["loc"]))
        kinds = {e["type"] for e in errors if _param(model, tuple(e["loc"]))[0] == param}
        raise bad_request(_message(err, param or "body", cut, kinds), param or None) from None
