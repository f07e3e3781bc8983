"""Render a model's Jinja chat template with Hugging Face's semantics.

Like transformers' ``apply_chat_template``: an ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks``; ``raise_exception(msg)``, ``strftime_now(fmt)`` and a
``tojson`` filter that keeps non-ASCII as is; the ``{% generation %}`` ... ``{% endgeneration %}``
block (transformers marks the assistant's tokens with it; here it renders its body as is, which is
what transformers renders); variables ``messages``, ``tools``,
``add_generation_prompt``, ``bos_token``, ``eos_token`` plus any extra keyword. Message content
given as a list of text parts (OpenAI style) is joined into one string first, for templates
that expect a string. Any template failure becomes ``ValueError("messages: ...")``.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class GenerationBlock(Extension):
    """``{% generation %}body{% endgeneration %}`` renders ``body``. Templates written for
    transformers' assistant-token masks use it (SmolLM3's, several fine-tunes'); without the tag
    they would not compile."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compiled once per distinct template string (pure function of the source: safe to cache)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _flatten_content(content):
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages: content part {i} must be {{'type': 'text', 'text': str}}, got {part!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"messages: content must be a string or a list of text parts, got {type(content).__name__}")


def normalize_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: must be a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ValueError(f"messages: message {i} must be a dict with a string 'role', got {msg!r}")
        try:
            out.append({**msg, "content": _flatten_content(msg.get("content"))})
        except ValueError as exc:
            raise ValueError(f"messages: message {i}: {str(exc).removeprefix('messages: ')}") from None
    return out


def render_chat_template(
    template: str,
    messages,
    *,
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **extra,
) -> str:
    try:
        compiled = compile_template(template)
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"messages: the model's chat template does not compile: {exc}") from exc
    msgs = normalize_messages(messages)
    try:
        return compiled.render(
            messages=msgs, tools=tools, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "", eos_token=eos_token or "", **extra,
        )
    except (jinja2.exceptions.TemplateError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"messages: the chat template rejected them: {exc}") from exc
