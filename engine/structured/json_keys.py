"""No repeated key in a generated JSON object.

A grammar cannot say "a key not written before": ``additionalProperties`` (or any JSON object)
admits ``{"a": 1, "a": 2}``, which parsers read as ``{"a": 2}``. So the manager follows each
constrained output through a small JSON lexer over its bytes and, at every step, clears from the
grammar's bitmask the tokens that would close a key string already present in the object being
written. Only tokens holding a ``"`` can close a key, so only those are simulated.

The lexer's state is an immutable tuple (a draft's rows each get their own without copying):
``(frames, mode, key, escaped, tail)``: ``frames`` one ``(is_object, keys, expects_key)`` per open
container; ``mode`` outside a string, in a key or in a value string (or, for tool calls, in
free text before a trigger); ``key`` the raw bytes of the key being written; ``tail`` the last
bytes of free text, to find a trigger that tokens split. Keys compare by their decoded value
(``"\\u0061"`` is ``"a"``).
"""
from __future__ import annotations

import json

_OUT, _KEY, _VALUE, _FREE = 0, 1, 2, 3
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN = (ord("{"), ord("["))
_CLOSE = (ord("}"), ord("]"))
_COMMA, _COLON = ord(","), ord(":")


class KeyTracker:
    """The lexer for one kind of constraint: JSON from the first byte, or free text in which each
    trigger (tool calls: ``{"name"``) starts a JSON object."""

    def __init__(self, triggers: tuple[bytes, ...] = ()) -> None:
        self.triggers = triggers
        self._tail = max((len(t) for t in triggers), default=0)
        self.initial = ((), _FREE if triggers else _OUT, b"", False, b"")

    def feed(self, state: tuple, data: bytes) -> tuple[tuple, bool]:
        """(the state after ``data``, whether ``data`` closed a key already in its object)."""
        frames, mode, key, escaped, tail = state
        dup = False
        for b in data:
            if mode == _FREE:
                tail = (tail + bytes((b,)))[-self._tail:]
                for t in self.triggers:
                    if tail.endswith(t):
                        (frames, mode, key, escaped, tail), _ = self.feed(((), _OUT, b"", False, b""), t)
                        break
                continue
            if mode != _OUT:                                   # inside a string
                if escaped:
                    escaped = False
                elif b == _BACKSLASH:
                    escaped = True
                elif b == _QUOTE:
                    if mode == _KEY:
                        name = _decode(key)
                        _, keys, _ = frames[-1]
                        dup = dup or name in keys
                        frames = frames[:-1] + ((True, keys | {name}, False),)
                    mode, key = _OUT, b""
                    continue
                if mode == _KEY:
                    key += bytes((b,))
                continue
            if b in _OPEN:
                frames = frames + ((b == _OPEN[0], frozenset(), True),)
            elif b in _CLOSE and frames:
                frames = frames[:-1]
                if not frames and self.triggers:
                    mode, tail = _FREE, b""
            elif b == _QUOTE:
                mode = _KEY if frames and frames[-1][0] and frames[-1][2] else _VALUE
            elif b == _COMMA and frames and frames[-1][0]:
                frames = frames[:-1] + ((True, frames[-1][1], True),)
            elif b == _COLON and frames and frames[-1][0]:
                frames = frames[:-1] + ((True, frames[-1][1], False),)
        return (frames, mode, key, escaped, tail), dup

    @staticmethod
    def may_repeat(state: tuple) -> bool:
        """Whether some open object already has a key (else no token can repeat one: a token
        would have to write a key and then the same key again)."""
        return any(is_obj and keys for is_obj, keys, _ in state[0])


def _decode(raw: bytes) -> str | bytes:
    try:
        return json.loads(b'"' + raw + b'"')
    except ValueError:
        return raw            # not a valid JSON string (the grammar will not let it close)


def quote_tokens(token_bytes: list[bytes]) -> list[tuple[int, bytes]]:
    """(id, bytes) of the tokens that hold a ``"``: the only ones that can close a key."""
    return [(i, b) for i, b in enumerate(token_bytes) if b'"' in b]


def clear_repeats(tracker: KeyTracker, state: tuple, candidates: list[tuple[int, bytes]], row) -> int:
    """Clear, in ``row`` (one bitmask row, [words] int32), the allowed candidates that would close
    a repeated key; returns how many were cleared."""
    if not tracker.may_repeat(state):
        return 0
    words = [w & 0xFFFFFFFF for w in row.tolist()]
    cleared = 0
    for tid, data in candidates:
        w, bit = tid >> 5, tid & 31
        if (words[w] >> bit) & 1 and tracker.feed(state, data)[1]:
            words[w] &= ~(1 << bit)
            cleared += 1
    if cleared:
        row.copy_(row.new_tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words]))
    return cleared
