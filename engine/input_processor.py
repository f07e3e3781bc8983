"""Requests in: render, tokenize, validate, against the size caps and the context window.

Nothing here reads or changes engine state, and the tokenizer is thread-safe, so ``AsyncEngine``
calls ``prepare`` off the step thread: a long prompt stalls no one's decode. The core then only
queues what ``prepare`` returned (``EngineCore.add_request``).
"""
from __future__ import annotations

from dataclasses import dataclass

from sluice.engine import limits
from sluice.engine.config import LimitsConfig
from sluice.engine.errors import ContextLengthError, UnsupportedError
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.tool_prompt import fallback_messages, template_renders_tools

# CodeLlama ends an infilled middle with <EOT> (SentencePiece spelling "▁<EOT>"), not with eos.
_END_OF_INFILL = ("\u2581<EOT>", "<EOT>")


@dataclass(frozen=True)
class InfillPrompt:
    token_ids: list[int]               # the fill-in-the-middle prompt, special tokens included
    stop_token_ids: tuple[int, ...]    # end-of-infill tokens that are not already eos


def build_infill_prompt(tokenizer, prefix: str, suffix: str) -> InfillPrompt:
    """Prefix-suffix-middle prompt from the tokenizer's own FIM tokens, as token ids:
    ``[bos?] PRE enc(prefix) SUF enc'(suffix) MID``. StarCoder-style (``<fim_prefix>{prefix}
    <fim_suffix>{suffix}<fim_middle>``, no BOS) and CodeLlama alike: CodeLlama's documented text
    form is ``<s> <PRE> {prefix} <SUF>{suffix} <MID>`` (transformers' CodeLlamaTokenizer,
    ``set_infilling_processor``; Meta's ``infilling_prompt_tokens``), i.e. the prefix keeps
    SentencePiece's leading-space marker and the suffix is encoded without it (``enc'``)."""
    fim = tokenizer.fim_tokens
    if fim is None:
        raise UnsupportedError("infill: the model's tokenizer has no fill-in-the-middle tokens")
    for name, value in (("infill.prefix", prefix), ("infill.suffix", suffix)):
        if not isinstance(value, str):
            raise ValueError(f"{name}: must be a string, got {type(value).__name__}")
    if not prefix and not suffix:
        raise ValueError("infill: prefix and suffix must not both be empty")
    probe = tokenizer.encode("a", add_special_tokens=True)
    bos = [probe[0]] if tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id] else []
    pre = tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
    suf = _encode_continuation(tokenizer, suffix) if suffix else []
    stops = (tokenizer.token_to_id(t) for t in _END_OF_INFILL)
    extra = tuple(dict.fromkeys(t for t in stops if t is not None and t not in tokenizer.eos_token_ids))
    return InfillPrompt([*bos, fim.prefix, *pre, fim.suffix, *suf, fim.middle], extra)


def _encode_continuation(tokenizer, text: str) -> list[int]:
    """``text``'s ids as the continuation of earlier text: without the space marker a
    SentencePiece-style tokenizer prepends to the start of a text (Meta's ``encode_infilling``
    trick: encode behind an anchor, drop the anchor's ids). Byte-level BPE adds no marker."""
    plain = tokenizer.encode(text, add_special_tokens=False)
    first = tokenizer.id_to_token(tokenizer.encode("a", add_special_tokens=False)[0]) or ""
    if not first.startswith("\u2581"):
        return plain
    anchor = tokenizer.encode("\n", add_special_tokens=False)
    joined = tokenizer.encode("\n" + text, add_special_tokens=False)
    return joined[len(anchor):] if joined[:len(anchor)] == anchor else plain


class InputProcessor:
    """Turns what a client sent into checked prompt token ids. ``structured`` (the grammar
    manager) compiles a request's grammar here, so that the step only looks it up."""

    def __init__(self, tokenizer, limits_config: LimitsConfig, structured, *, model_name: str,
                 vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.limits = limits_config
        self.structured = structured
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> str:
        if not messages:
            raise ValueError("messages: must hold at least one message")
        limits.check_chat(messages, tools, self.limits)
        has_tool_turns = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if (tools or has_tool_turns) and not template_renders_tools(self.tokenizer.chat_template):
            messages, tools = fallback_messages(messages, tools), None   # engine.tool_prompt's format
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    def render_infill(self, prefix: str, suffix: str) -> InfillPrompt:
        if getattr(self.tokenizer, "fim_tokens", None) is None:
            raise UnsupportedError(f"infill: model {self.model_name} does not support infilling "
                                   "(its tokenizer has no fill-in-the-middle tokens)")
        return build_infill_prompt(self.tokenizer, prefix, suffix)

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text prompt, or a token prompt checked against the vocabulary. The
        size caps come first: nothing is tokenized or walked beyond them."""
        limits.check_prompt(prompt, self.limits, self.max_model_len)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: must not be empty")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt: token id {t!r} is outside the vocabulary (size {vocab})")
        return ids

    def check_length(self, n_prompt: int, params: SamplingParams) -> None:
        limit = self.max_model_len
        if n_prompt >= limit:
            raise ContextLengthError(
                f"prompt: {n_prompt} tokens leave no room to generate within the context window of {limit} tokens")
        if params.max_tokens is not None and n_prompt + params.max_tokens > limit:
            raise ContextLengthError(
                f"max_tokens: {n_prompt} prompt tokens + max_tokens {params.max_tokens} exceed the context "
                f"window of {limit} tokens")

    def prepare(self, prompt: str | list[int], params: SamplingParams, add_special_tokens: bool = True) -> list[int]:
        """Checks the caps and the parameters, then tokenizes and checks the length: everything
        about a new request that needs no engine state."""
        limits.check_params(params, self.limits)
        params.validate()
        params.check_vocab(self.vocab_size)
        ids = self.encode_prompt(prompt, add_special_tokens)
        self.check_length(len(ids), params)
        if params.structured is not None:   # waits up to compile_timeout_s; cached for add_request
            self.structured.compile(params.structured)
        return ids
