"""Tools for chat templates that do not render them: sluice's documented fallback prompt format.

A template that names ``tools`` (Llama 3.1, Qwen2.5, Mistral, Hermes ...) renders the tools, the
assistant's ``tool_calls`` and the ``tool`` results itself. For one that does not (SmolLM2's
ChatML template, for one), ``fallback_messages`` rewrites the conversation into plain messages:

  * a system message (merged after an existing first system message) that lists the tools and
    says how to call them::

        You can call these tools. Each one's arguments follow its JSON Schema:
        [{"name": "get_weather", "description": "...", "parameters": {...}}]
        To call tools, answer with only a JSON list of calls, and nothing else:
        [{"name": "<tool name>", "arguments": {<the arguments>}}]
        If no tool is needed, answer the user directly.

  * an assistant message that made calls: its content followed by that same JSON list;
  * a ``tool`` message: ``Result of call <tool_call_id>: <content>`` in the tool role.

The list of calls is also the shape the facade constrains a forced call to (``tool_choice``
``required`` or a named function); with ``auto`` each ``{"name": ...}`` call the model starts is
constrained, and the facade parses the calls back into ``tool_calls``.
"""
from __future__ import annotations

import json

HEADER = "You can call these tools. Each one's arguments follow its JSON Schema:"
FOOTER = ('To call tools, answer with only a JSON list of calls, and nothing else:\n'
          '[{"name": "<tool name>", "arguments": {<the arguments>}}]\n'
          'If no tool is needed, answer the user directly.')


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def tools_text(tools: list[dict]) -> str:
    listed = []
    for t in tools:
        f = t.get("function", {})
        item = {"name": f.get("name")}
        if f.get("description"):
            item["description"] = f["description"]
        item["parameters"] = f.get("parameters", {"type": "object"})
        listed.append(item)
    return f"{HEADER}\n{json.dumps(listed, ensure_ascii=False)}\n{FOOTER}"


def calls_text(calls: list[dict]) -> str:
    out = []
    for c in calls:
        f = c.get("function", {})
        args = f.get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass   # as the client sent it
        out.append({"name": f.get("name"), "arguments": args})
    return json.dumps(out, ensure_ascii=False)


def fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` with tools, tool calls and tool results written out as plain text."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            text = m.get("content") or ""
            m["content"] = (text + "\n" if text else "") + calls_text(m.pop("tool_calls"))
        elif m.get("role") == "tool":
            m["content"] = f"Result of call {m.pop('tool_call_id', '')}: {m.get('content') or ''}"
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    if tools:
        prompt = tools_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
