"""The structured-output manager, owned by the engine core (the scheduler never sees it).

Life of a constrained request:
  1. ``compile(spec)`` (thread-safe; ``EngineCore.prepare_prompt`` calls it off the step thread)
     hands the grammar to a small compile pool and waits at most ``compile_timeout_s``. Compiled
     grammars, and compile errors, are cached by ``spec.key`` (LRU), so a repeated schema costs
     nothing. A compile that times out is refused (``ValueError`` naming the parameter, a 400)
     but goes on in the pool and lands in the cache. Because the wait happens before the request
     reaches the engine thread, a slow grammar delays only its own request: nothing is queued
     behind it, and the scheduler only ever sees requests whose grammar is ready.
  2. ``add(request_id, spec)`` (step thread) gives the request its own matcher.
  3. Each step the runner asks ``fill_bitmask(rows)`` for the rows it samples: one bitmask row per
     sampled row, all ones for unconstrained rows; a request with K drafts has K + 1 rows, filled
     by advancing its matcher through the drafts and rolling it back.
  4. ``accept(request_id, tokens)`` advances the matcher by the tokens the step appended (after
     the stop checks cut them). A token the grammar rejects fails that request.
  5. ``drop(request_id)`` when the request has reported its end.

EOS: the tokenizer's stop ids are xgrammar's stop tokens, which the matcher allows exactly when
the grammar can end (and then, at a complete grammar, only them). Preemption by recompute keeps
the output tokens, so the matcher stays where it was; drafts are the only tokens rolled back.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections import OrderedDict

import torch

from sluice.engine.structured.bitmask import bitmask_words
from sluice.engine.structured.json_keys import KeyTracker, clear_repeats, quote_tokens
from sluice.engine.structured.schema import normalize
from sluice.engine.structured.spec import GrammarSpec, StructuredOutputConfig, parse_triggered_tags
from sluice.engine.structured.vocab import build_tokenizer_info, token_bytes

log = logging.getLogger("sluice.structured")


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, config: StructuredOutputConfig | None = None) -> None:
        self.config = config or StructuredOutputConfig()
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._compiler = None                  # built on first use: most servers never need it
        self._compiler_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(self.config.compile_workers,
                                                           thread_name_prefix="sluice-grammar")
        self._cache: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._matchers: dict[str, object] = {}  # request id -> xgrammar.GrammarMatcher
        # Requests whose grammar reached a state that no token of the vocabulary continues (a
        # grammar needing text this tokenizer cannot spell): their row is left unmasked, so that
        # it cannot turn into an all -inf row (NaN probabilities for the whole batch's sampler),
        # and ``accept`` fails them with this reason.
        self._dead_ends: set[str] = set()
        # Request id -> (KeyTracker, its state after the accepted tokens); see json_keys.
        self._keys: dict[str, tuple[KeyTracker, tuple]] = {}
        self._token_bytes: list[bytes] = []
        self._quote_tokens: list[tuple[int, bytes]] = []

    # ---- compiling (any thread) ---------------------------------------------------------------
    def compile(self, spec: GrammarSpec):
        """The compiled grammar, waiting at most ``compile_timeout_s``; ``ValueError`` naming
        ``spec.field`` when it does not compile or not in time."""
        if spec.size > self.config.max_grammar_chars:
            raise ValueError(f"{spec.field}: {spec.size} characters of grammar exceed the limit of "
                             f"{self.config.max_grammar_chars} (max_grammar_chars)")
        future = self._future(spec)
        timeout = self.config.compile_timeout_s
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise ValueError(f"{spec.field}: the grammar did not compile within {timeout:g} s "
                             "(compile_timeout_s)") from None
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError with its message
            raise ValueError(f"{spec.field}: {_compile_message(spec, exc)}") from None

    def _future(self, spec: GrammarSpec) -> concurrent.futures.Future:
        with self._cache_lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._compile_now, spec)
            self._cache[spec.key] = future
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
            return future

    def _compile_now(self, spec: GrammarSpec):
        compiler = self._get_compiler()
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "json_schema":
            return compiler.compile_grammar(json_schema_grammar(spec.text, spec.strict))
        if spec.kind == "regex":
            return compiler.compile_regex(spec.text)
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_ebnf(spec.choices))
        if spec.kind == "triggered_tags":
            return compiler.compile_structural_tag(structural_tag(spec.text))
        return compiler.compile_grammar(spec.text)

    def warm_up(self) -> concurrent.futures.Future:
        """Import xgrammar and build the tokenizer info and the compiler in the pool (2-3 s for
        SmolLM2's 49k tokens on this CPU). Otherwise the first constrained request does that
        inside its compile time limit; engines are not warmed up by default, since most never
        see a grammar."""
        return self._pool.submit(self._get_compiler)

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                self._token_bytes = token_bytes(self._tokenizer, self.vocab_size)
                self._quote_tokens = quote_tokens(self._token_bytes)
                info = build_tokenizer_info(self._tokenizer, self.vocab_size, self._token_bytes)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.config.compile_threads)
            return self._compiler

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- matchers (step thread) ---------------------------------------------------------------
    def add(self, request_id: str, spec: GrammarSpec) -> None:
        import xgrammar as xgr

        self._matchers[request_id] = xgr.GrammarMatcher(self.compile(spec))
        tracker = self._key_tracker(spec)
        if tracker is not None:
            self._keys[request_id] = (tracker, tracker.initial)

    def _key_tracker(self, spec: GrammarSpec) -> KeyTracker | None:
        """JSON constraints get a key tracker (``json_keys``): objects never repeat a key."""
        if spec.kind in ("json_object", "json_schema"):
            return KeyTracker()
        if spec.kind == "triggered_tags":
            triggers = tuple(t.encode() for t in parse_triggered_tags(spec.text)[0])
            return KeyTracker(triggers)
        return None

    def is_constrained(self, request_id: str) -> bool:
        return request_id in self._matchers

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._keys.pop(request_id, None)
        self._dead_ends.discard(request_id)

    def request_ids(self) -> set[str]:
        return set(self._matchers)

    def accept(self, request_id: str, token_ids) -> bool:
        """Advance by the tokens a step appended; False when the grammar rejects one (the
        matcher then stays before that token)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return True
        if request_id in self._dead_ends:
            raise ValueError("grammar: no token of the model's vocabulary can continue the output here "
                             "(the constraint needs text that this tokenizer cannot produce)")
        ok = all(matcher.accept_token(int(t)) for t in token_ids)
        keys = self._keys.get(request_id)
        if keys is not None:
            tracker, state = keys
            state, _ = tracker.feed(state, b"".join(self._token_bytes[int(t)] for t in token_ids))
            self._keys[request_id] = (tracker, state)
        return ok

    def is_finished(self, request_id: str) -> bool:
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_terminated()

    def fill_bitmask(self, rows, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """[num_rows, ceil(V / 32)] int32 for ``rows`` = [(request, drafts), ...] in sampling
        order, K + 1 rows for K drafts; None when no request among them is constrained."""
        if not any(req.request_id in self._matchers for req, _ in rows):
            return None
        num_rows = sum(len(drafts) + 1 for _, drafts in rows)
        bitmask = torch.full((num_rows, bitmask_words(self.vocab_size)), -1, dtype=torch.int32)
        row = 0
        for req, drafts in rows:
            matcher = self._matchers.get(req.request_id)
            if matcher is None:
                row += len(drafts) + 1
                continue
            advanced = 0
            keys = self._keys.get(req.request_id)
            for j in range(len(drafts) + 1):
                if advanced == j and not matcher.is_terminated():
                    matcher.fill_next_token_bitmask(bitmask, row + j)
                    if keys is not None:
                        clear_repeats(keys[0], keys[1], self._quote_tokens, bitmask[row + j])
                    if not bool(bitmask[row + j].any()):
                        # A dead end now fails the request; one behind a draft only if the target
                        # accepts that draft (the next step's first row finds it then).
                        if j == 0:
                            self._dead_ends.add(req.request_id)
                        bitmask[row + j] = -1
                        break
                    if j < len(drafts) and matcher.accept_token(int(drafts[j])):
                        advanced += 1
                        if keys is not None:
                            keys = (keys[0], keys[0].feed(keys[1], self._token_bytes[int(drafts[j])])[0])
                # Rows past a draft the grammar rejects stay all ones: that draft's own row
                # forbids it, so verification stops there and never samples from them.
            if advanced:
                matcher.rollback(advanced)
            row += len(drafts) + 1
        return bitmask.to(device, non_blocking=True)


def structural_tag(text: str) -> str:
    """xgrammar's structural tag (JSON) for a ``triggered_tags`` spec's text. Tag content is
    compact JSON, like every other JSON constraint here (``any_whitespace=False``)."""
    triggers, tags, stop_after_first = parse_triggered_tags(text)
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": triggers, "at_least_one": False, "stop_after_first": stop_after_first,
        "tags": [{"type": "tag", "begin": t.begin, "end": t.end,
                  "content": {"type": "json_schema", "json_schema": normalize(json.loads(t.schema_json), True, "tools")}}
                 for t in tags]}})


# xgrammar (0.2) spells the characters of a string with maxLength / minLength as [^"\\\r\n]
# (its printed grammar: r'[^\"\\\r\n]'). That admits the control characters U+0000-U+001F, which
# JSON forbids raw in a string (json.loads refuses the output), where its unbounded strings use
# [^\0-\x1f"\\\r\n]. Bounded strings get JSON's class here (still without escapes).
_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'
_JSON_STRING_CHARS = r'[^\0-\x1f\"\\]'


def json_schema_grammar(schema: str, strict: bool):
    """xgrammar's grammar for a JSON Schema (compact JSON), normalized first (``schema.normalize``:
    the spec was checked with it, so it does not raise here), with its bounded-length strings held
    to JSON's string characters (no raw control characters; escapes stay out of them)."""
    import xgrammar as xgr

    normalized = json.dumps(normalize(json.loads(schema), strict, "json_schema"))
    grammar = xgr.Grammar.from_json_schema(normalized, any_whitespace=False, strict_mode=strict)
    text = str(grammar)
    fixed = text.replace(_BOUNDED_STRING_CHARS, _JSON_STRING_CHARS)
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """``root ::= "a" | "b"``: JSON string escapes are valid EBNF string-literal escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _compile_message(spec: GrammarSpec, exc: Exception) -> str:
    """xgrammar's message without its source location prefix ("[time] file.cc:94: ")."""
    text = str(exc).strip()
    if "] " in text[:40] and ".cc:" in text:
        text = text.split(": ", 1)[-1] if ": " in text else text
    what = {"json_schema": "invalid JSON schema", "json_object": "invalid JSON schema", "regex": "invalid regex",
            "choice": "invalid choice", "ebnf": "invalid grammar",
            "triggered_tags": "invalid tool call schema"}[spec.kind]
    return f"{what}: {text}"
