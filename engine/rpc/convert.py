"""Protobuf <-> engine dataclasses, at the edge only. Nothing past the servicer sees a message.

Every conversion error is a ``ValueError`` whose message starts with the offending field's path
in the request (``sampling.top_logprobs: ...``, ``chat.messages[1].role: ...``).
"""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Callable

from sluice.engine.config import LimitsConfig
from sluice.engine.limits import over_cap
from sluice.engine.outputs import CompletionDelta, RequestOutput, TokenLogprob
from sluice.engine.rpc import engine_pb2 as pb
from sluice.engine.rpc.convert_embed import embedding_info
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.structured.spec import GrammarSpec, Tag, parse_triggered_tags, triggered_tags_text

if TYPE_CHECKING:
    from sluice.engine.embedding import EmbeddingEngine
    from sluice.engine.engine_core import LoadStats, ModelInfo

# proto3 `optional` scalars copied as-is when present; unset means the engine's default.
_OPTIONAL_SCALARS = (
    "n", "max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens",
)
ROLE_NAMES = {pb.ROLE_SYSTEM: "system", pb.ROLE_USER: "user", pb.ROLE_ASSISTANT: "assistant", pb.ROLE_TOOL: "tool"}
_FIELD_NAME = re.compile(r"[A-Za-z_][\w.\[\]]{0,63}")
FINISH_REASONS = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH,
                  "abort": pb.FINISH_REASON_ABORT, "error": pb.FINISH_REASON_ERROR}


def check_sampling_caps(msg: pb.SamplingParams, limits: LimitsConfig) -> None:
    """The request caps read off the message itself, before anything is copied out of it: a
    million stop strings cost one ``len()`` on the event loop, not a list and a dataclass built
    only to be refused. The messages of ``limits.check_params`` (which the engine still runs),
    named by the message's own fields (``sampling.top_logprobs``), as every gRPC error is."""
    if msg.HasField("n") and msg.n > limits.max_n:
        raise over_cap("sampling.n", "choices per request", msg.n, limits.max_n, "max_n")
    if len(msg.stop) > limits.max_stop_strings:
        raise over_cap("sampling.stop", "stop strings", len(msg.stop), limits.max_stop_strings, "max_stop_strings")
    for s in msg.stop:      # at most max_stop_strings of them now
        if len(s) > limits.max_stop_length:
            raise over_cap("sampling.stop", "characters per stop string", len(s), limits.max_stop_length, "max_stop_length")
    if len(msg.stop_token_ids) > limits.max_stop_strings:
        raise over_cap("sampling.stop_token_ids", "stop tokens", len(msg.stop_token_ids), limits.max_stop_strings,
                       "max_stop_strings")
    if len(msg.logit_bias) > limits.max_logit_bias:
        raise over_cap("sampling.logit_bias", "entries", len(msg.logit_bias), limits.max_logit_bias, "max_logit_bias")
    if msg.HasField("top_logprobs") and msg.top_logprobs > limits.max_logprobs:
        raise over_cap("sampling.top_logprobs", "alternatives per token", msg.top_logprobs, limits.max_logprobs, "max_logprobs")


def sampling_from_proto(msg: pb.SamplingParams, limits: LimitsConfig | None = None) -> SamplingParams:
    """``limits``: checked on the message first (``check_sampling_caps``)."""
    if limits is not None:
        check_sampling_caps(msg, limits)
    kwargs: dict = {name: getattr(msg, name) for name in _OPTIONAL_SCALARS if msg.HasField(name)}
    if msg.max_tokens_unlimited:
        if msg.HasField("max_tokens"):
            raise ValueError("sampling.max_tokens: must be unset when max_tokens_unlimited is true")
        kwargs["max_tokens"] = None
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.HasField("top_logprobs") and not msg.logprobs:
        raise ValueError("sampling.top_logprobs: requires logprobs to be true")
    if msg.logprobs:
        kwargs["logprobs"] = msg.top_logprobs if msg.HasField("top_logprobs") else 0
    try:
        if msg.HasField("structured_output"):
            kwargs["structured"] = structured_from_proto(msg.structured_output)
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise ValueError(f"sampling.{exc}") from None


def structured_from_proto(msg: pb.StructuredOutput) -> GrammarSpec:
    """The typed constraint as a ``GrammarSpec``; errors name ``msg.param`` (or structured_output)."""
    param = msg.param or "structured_output"
    if not _FIELD_NAME.fullmatch(param):
        raise ValueError(f"structured_output.param: must be a parameter name, got {param!r}")
    kind = msg.WhichOneof("constraint")
    if kind is None:
        raise ValueError(f"{param}: a constraint (json_object, json_schema, regex, choice, ebnf or "
                         "triggered_tags) is required")
    if kind == "json_schema":
        return GrammarSpec("json_schema", msg.json_schema.schema_json, strict=msg.json_schema.strict, field=param)
    if kind == "choice":
        return GrammarSpec("choice", choices=tuple(msg.choice.choices), field=param)
    if kind == "triggered_tags":
        t = msg.triggered_tags
        tags = [Tag(x.begin, x.schema_json, x.end) for x in t.tags]
        return GrammarSpec("triggered_tags", triggered_tags_text(list(t.triggers), tags, t.stop_after_first),
                           field=param)
    return GrammarSpec(kind, "" if kind == "json_object" else getattr(msg, kind), field=param)


def structured_to_proto(spec: GrammarSpec) -> pb.StructuredOutput:
    msg = pb.StructuredOutput(param=spec.field)
    if spec.kind == "json_object":
        msg.json_object.SetInParent()
    elif spec.kind == "json_schema":
        msg.json_schema.schema_json, msg.json_schema.strict = spec.text, spec.strict
    elif spec.kind == "choice":
        msg.choice.choices.extend(spec.choices)
    elif spec.kind == "triggered_tags":
        triggers, tags, stop = parse_triggered_tags(spec.text)
        msg.triggered_tags.triggers.extend(triggers)
        msg.triggered_tags.tags.extend(pb.TriggeredTag(begin=t.begin, schema_json=t.schema_json, end=t.end)
                                       for t in tags)
        msg.triggered_tags.stop_after_first = stop
    else:
        setattr(msg, spec.kind, spec.text)
    return msg


def chat_from_proto(msg: pb.ChatInput, field: str = "chat") -> tuple[list[dict], list[dict] | None, bool]:
    """Returns (messages, tools, add_generation_prompt) as the chat template expects them."""
    if not msg.messages:
        raise ValueError(f"{field}.messages: must hold at least one message")
    messages = []
    for i, m in enumerate(msg.messages):
        role = ROLE_NAMES.get(m.role)
        if role is None:
            raise ValueError(f"{field}.messages[{i}].role: must be system, user, assistant or tool")
        out: dict = {"role": role, "content": m.content}
        if m.name:
            out["name"] = m.name
        if m.tool_call_id:
            out["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            where = f"{field}.messages[{i}].tool_calls"
            out["tool_calls"] = [_tool_call(c, f"{where}[{j}]") for j, c in enumerate(m.tool_calls)]
        messages.append(out)
    tools = [_tool(t, f"{field}.tools[{j}]") for j, t in enumerate(msg.tools)] or None
    add_gen = msg.add_generation_prompt if msg.HasField("add_generation_prompt") else True
    return messages, tools, add_gen


# Tools and tool calls reach the chat template in the OpenAI shape, the one HF templates are
# written against: {"type": "function", "function": {...}}.
def _tool_type(value: int, field: str) -> str:
    if value not in (pb.TOOL_TYPE_UNSPECIFIED, pb.TOOL_TYPE_FUNCTION):
        raise ValueError(f"{field}: must be TOOL_TYPE_FUNCTION, got {value}")
    return "function"


def _tool(msg: pb.ToolDefinition, field: str) -> dict:
    f = msg.function
    if not f.name:
        raise ValueError(f"{field}.function.name: must not be empty")
    function: dict = {"name": f.name}
    if f.HasField("description"):
        function["description"] = f.description
    if f.HasField("parameters_json"):
        function["parameters"] = _json_object(f.parameters_json, f"{field}.function.parameters_json")
    return {"type": _tool_type(msg.type, f"{field}.type"), "function": function}


def _tool_call(msg: pb.ToolCall, field: str) -> dict:
    if not msg.function.name:
        raise ValueError(f"{field}.function.name: must not be empty")
    return {"id": msg.id, "type": _tool_type(msg.type, f"{field}.type"),
            "function": {"name": msg.function.name, "arguments": msg.function.arguments}}


def _json_object(text: str, field: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{field}: not valid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field}: must be a JSON object (a JSON Schema), got {type(value).__name__}")
    return value


def output_to_proto(out: RequestOutput, token_text: Callable[[int], str], first: bool) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=out.request_id)
    if first and out.prompt_token_ids:
        msg.prompt_token_ids.extend(out.prompt_token_ids)
    for d in out.deltas:
        _delta_to_proto(d, msg.choices.add(), token_text)
    return msg


def _delta_to_proto(d: CompletionDelta, c: pb.ChoiceDelta, token_text: Callable[[int], str]) -> None:
    c.index = d.index
    c.text = d.text
    c.token_ids.extend(d.token_ids)
    for lp in d.logprobs or ():
        _logprob_to_proto(lp, c.logprobs.add(), token_text)
    if d.finish_reason is None:
        return
    f = c.final
    f.finish_reason = FINISH_REASONS.get(d.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
    if isinstance(d.stop_reason, str):
        f.stop_string = d.stop_reason
    elif isinstance(d.stop_reason, int):
        f.stop_token_id = d.stop_reason
    if d.usage is not None:
        f.usage.prompt_tokens = d.usage.prompt_tokens
        f.usage.completion_tokens = d.usage.completion_tokens
        f.usage.cached_prompt_tokens = d.usage.cached_tokens
        f.usage.draft_tokens = d.usage.draft_tokens
        f.usage.accepted_tokens = d.usage.accepted_tokens
    m = d.metrics
    if m is not None:
        for name in ("queued_s", "ttft_s", "total_s"):
            value = getattr(m, name)
            if value is not None:
                setattr(f.timings, name, value)
    f.timings.SetInParent()
    if d.error:
        f.error = d.error


def _logprob_to_proto(lp: TokenLogprob, msg: pb.TokenLogprob, token_text: Callable[[int], str]) -> None:
    msg.token_id = lp.token_id
    msg.logprob = lp.logprob
    msg.token = token_text(lp.token_id)
    for tok, logprob in lp.top:
        msg.top.add(token_id=tok, logprob=logprob, token=token_text(tok))


def model_info_to_proto(info: ModelInfo, embedding: EmbeddingEngine | None = None) -> pb.ModelInfo:
    caps, extra = embedding_info(embedding)
    return pb.ModelInfo(
        name=info.name, path=info.path, architecture=info.architecture, max_model_len=info.max_model_len,
        vocab_size=info.vocab_size, dtype=info.dtype, device=info.device,
        attention_backend=info.attention_backend, capabilities=sorted(info.capabilities | caps), **extra,
        speculative_mode=info.speculative_mode, spec_draft_length=info.spec_draft_length,
    )


def load_to_proto(load: LoadStats, num_in_flight: int) -> pb.GetLoadResponse:
    return pb.GetLoadResponse(
        num_running=load.num_running, num_waiting=load.num_waiting, kv_blocks_used=load.kv_blocks_used,
        kv_blocks_total=load.kv_blocks_total, prefix_cache_hit_rate=load.prefix_cache_hit_rate,
        num_in_flight=num_in_flight, spec_num_drafts=load.spec_num_drafts,
        spec_draft_tokens=load.spec_draft_tokens, spec_accepted_tokens=load.spec_accepted_tokens,
        spec_accepted_per_position=load.spec_accepted_per_position,
    )


class TokenPieces:
    """Tokenize's ``pieces`` and ``spellings`` for a tokenizer. The bytes come from the table that
    grammars match on (``structured.vocab.token_bytes``), built on first use only: it walks the
    whole vocabulary. That table leaves special tokens empty (a grammar never spells them); here
    they are their text, as llama.cpp's ``with_pieces`` shows them."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._table: list[bytes] | None = None

    def pieces(self, ids: list[int]) -> list[bytes]:
        if self._table is None:
            from sluice.engine.structured.vocab import token_bytes
            self._table = token_bytes(self._tokenizer, self._tokenizer.vocab_size)
        table, tok = self._table, self._tokenizer
        return [(tok.id_to_token(i) or "").encode("utf-8") if tok.is_special(i) else table[i] for i in ids]

    def spellings(self, ids: list[int]) -> list[str]:
        return [self._tokenizer.id_to_token(i) or "" for i in ids]
