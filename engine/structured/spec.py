"""What a request's output is constrained to, and the manager's configuration. Pure Python:
``SamplingParams`` carries a ``GrammarSpec`` and neither imports xgrammar.

Kinds (``GrammarSpec.kind``):
  * ``json_object``: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``);
  * ``json_schema``: a JSON Schema, as JSON text; ``strict`` closes every object schema that
    says nothing of ``additionalProperties`` (OpenAI's ``strict: true``; not strict: such objects
    are open). Every keyword is enforced or refused (``schema.normalize``, ``schema.KEYWORDS``);
  * ``regex``: the whole output matches the regular expression;
  * ``choice``: the output is exactly one of the strings;
  * ``ebnf``: an EBNF grammar in xgrammar's (GBNF-like) dialect, with a ``root`` rule;
  * ``triggered_tags``: free text until a trigger string appears, then one of the tags it begins
    (``begin``, JSON matching the tag's schema, ``end``), then free text again; ``text`` is
    ``triggered_tags_text(...)``. Tool calls that the model may or may not make.

Bad values raise ``ValueError`` naming the field (``structured_output.regex: ...``). Whether a
schema, regex or grammar compiles is known only to the compiler: the manager reports that.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from sluice.engine.structured.schema import normalize, regex_unsupported

KINDS = ("json_object", "json_schema", "regex", "choice", "ebnf", "triggered_tags")
FIELD = "structured_output"


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    text: str = ""                     # json_schema: the schema's JSON; regex; ebnf
    choices: tuple[str, ...] = ()      # choice
    strict: bool = False               # json_schema
    # Where errors point: the facade's parameter name (response_format, guided_regex, tools ...).
    field: str = FIELD

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.field}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str):
            raise ValueError(f"{self.field}: must be a string, got {type(self.text).__name__}")
        if self.kind in ("regex", "ebnf") and not self.text:
            raise ValueError(f"{self.field}: the {self.kind} must not be empty")
        if self.kind == "json_schema":
            _check_schema_text(self.text, self.field, self.strict)
        if self.kind == "regex" and (why := regex_unsupported(self.text)):
            raise ValueError(f"{self.field}: {why}")
        if self.kind == "triggered_tags":
            _check_triggered_tags(self.text, self.field)
        if self.kind == "choice":
            object.__setattr__(self, "choices", tuple(self.choices))
            if not self.choices:
                raise ValueError(f"{self.field}: needs at least one choice")
            for c in self.choices:
                if not isinstance(c, str) or not c:
                    raise ValueError(f"{self.field}: every choice must be a non-empty string, got {c!r}")

    @property
    def key(self) -> tuple:
        """The compile cache's key: equal specs compile to the same grammar."""
        return (self.kind, self.text, self.choices, self.strict)

    @property
    def size(self) -> int:
        """Characters of grammar text, for the request caps."""
        return len(self.text) + sum(len(c) for c in self.choices)


@dataclass(frozen=True)
class Tag:
    begin: str
    schema_json: str
    end: str


def triggered_tags_text(triggers: list[str] | tuple[str, ...], tags: list[Tag] | tuple[Tag, ...],
                        stop_after_first: bool) -> str:
    """The canonical ``text`` of a ``triggered_tags`` spec (equal constraints, equal cache keys)."""
    return json.dumps({"triggers": list(triggers), "stop_after_first": bool(stop_after_first),
                       "tags": [{"begin": t.begin, "schema": t.schema_json, "end": t.end} for t in tags]},
                      ensure_ascii=False, separators=(",", ":"))


def parse_triggered_tags(text: str) -> tuple[list[str], list[Tag], bool]:
    value = json.loads(text)
    tags = [Tag(t["begin"], t["schema"], t["end"]) for t in value["tags"]]
    return value["triggers"], tags, value["stop_after_first"]


def _check_triggered_tags(text: str, field: str) -> None:
    try:
        triggers, tags, stop = parse_triggered_tags(text)
        ok = isinstance(triggers, list) and isinstance(stop, bool) and all(
            isinstance(x, str) for t in tags for x in (t.begin, t.schema_json, t.end))
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"{field}: triggered tags must be built by triggered_tags_text")
    if not triggers or not tags:
        raise ValueError(f"{field}: triggered tags need at least one trigger and one tag")
    if any(not isinstance(t, str) or not t for t in triggers):
        raise ValueError(f"{field}: every trigger must be a non-empty string")
    for i, tag in enumerate(tags):
        if not tag.begin:
            raise ValueError(f"{field}: tags[{i}].begin must not be empty")
        starts = [t for t in triggers if tag.begin.startswith(t)]
        if len(starts) != 1:
            raise ValueError(f"{field}: tags[{i}].begin {tag.begin!r} must start with exactly one trigger, "
                             f"it starts with {len(starts)}")
        _check_schema_text(tag.schema_json, f"{field}.tags[{i}]", strict=True)
    unused = [t for t in triggers if not any(tag.begin.startswith(t) for tag in tags)]
    if unused:
        raise ValueError(f"{field}: trigger {unused[0]!r} begins no tag")


def _check_schema_text(text: str, field: str, strict: bool = False) -> None:
    try:
        schema = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{field}: the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field}: a JSON schema must be an object (or true/false), got {type(schema).__name__}")
    # Every keyword enforced or refused (engine/structured/schema.py); the manager compiles the
    # normalized schema.
    normalize(schema, strict, field)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


@dataclass(frozen=True)
class StructuredOutputConfig:
    # A grammar that does not compile within this many seconds is refused (a 400); its compile
    # goes on in the background and lands in the cache, so other requests never wait on it.
    compile_timeout_s: float = 10.0
    compile_workers: int = 2               # grammars compiled at once
    compile_threads: int = 1               # xgrammar's own threads per compile
    cache_size: int = 256                  # compiled grammars kept (LRU)
    max_grammar_chars: int = 1 << 20       # schema / regex / grammar text per request

    def __post_init__(self) -> None:
        t = self.compile_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"compile_timeout_s: must be a positive number of seconds, got {t!r}")
        for name in ("compile_workers", "compile_threads", "cache_size", "max_grammar_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
