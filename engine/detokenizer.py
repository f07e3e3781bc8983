"""Incremental detokenization with stop strings.

Each step decodes only a small window of tokens, not the whole output: ``ids[prefix:read]`` is
the chunk emitted last (decoded again only as context, so that tokenizers whose decoding
depends on the previous token — SentencePiece's leading space — come out right) and
``ids[read:]`` are the tokens not yet settled. The text they add is
``decode(ids[prefix:]) minus decode(ids[prefix:read])``.

Broken UTF-8: byte-level tokens can split a character; decoding a partial character yields
U+FFFD at the end of the text. While the window's text ends in U+FFFD the window stays open and
only the text before that trailing run is taken (it can no longer change). A window kept open by
a long run of undecodable bytes is split once splitting provably changes nothing, so the
window stays bounded.

Stop strings: the text is scanned for every stop string as it arrives; the first stop to be
completed wins (earliest end, then earliest start), which makes the result independent of how
the text was cut into tokens. Text that could still be the start of a stop string (the longest
suffix that is a proper prefix of one) is held back, so a delta never carries part of a stop.

Invariant: the concatenated deltas (``add_tokens`` then ``finish``) equal the decoded output,
cut at the matched stop string (which is kept only with ``include_stop_str_in_output``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded ahead of the output as context (see the module docstring).
_PROMPT_CONTEXT_TOKENS = 5
# An open window longer than this is split where splitting does not change the text. A UTF-8
# character is at most 4 bytes, so only the last 3 tokens can hold an unfinished character.
_MAX_OPEN_TOKENS = 8
_KEEP_OPEN_TOKENS = 4


class TokenizerLike(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...

    def is_special(self, token_id: int) -> bool: ...


@dataclass(frozen=True)
class DetokResult:
    delta_text: str                 # new text safe to show: no broken character, no partial stop
    stop_string: str | None = None  # the stop string that ended the request, if one did


class IncrementalDetokenizer:
    """One choice's output text, built token by token; see the module docstring."""

    def __init__(
        self,
        tokenizer: TokenizerLike,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop: must be a list of non-empty strings")
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = tuple(dict.fromkeys(stop))
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop_str_in_output
        self._ids = self._prompt_context(prompt_token_ids)
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text: str | None = None   # decode(ids[prefix:read]), computed lazily
        self._window_chars = 0                 # chars of the open window already taken
        self._pending = ""                     # decoded text not emitted yet (a partial stop)
        self._pieces: list[str] = []
        self._stop_string: str | None = None
        self._done = False

    # ---- public ---------------------------------------------------------------------------------
    def add_tokens(self, new_ids: Sequence[int]) -> DetokResult:
        if self._done:
            raise RuntimeError("add_tokens: the detokenizer already finished (stop string or finish())")
        self._ids.extend(self._visible(new_ids))
        return self._emit(self._decode_window(final=False), final=False)

    def finish(self) -> str:
        """Flush the held-back text at the end of the request; idempotent, '' after a stop."""
        if self._done:
            return ""
        result = self._emit(self._decode_window(final=True), final=True)
        self._done = True
        return result.delta_text

    @property
    def output_text(self) -> str:
        """The text emitted so far (after the end: the final text)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def stop_string(self) -> str | None:
        return self._stop_string

    @property
    def finished(self) -> bool:
        return self._done

    # ---- decoding -------------------------------------------------------------------------------
    def _visible(self, ids: Sequence[int]) -> list[int]:
        if not self._skip:
            return list(ids)
        return [t for t in ids if not self._tok.is_special(t)]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        context = self._visible(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # A prompt that ends inside a character would make the output's first bytes rewrite the
        # context's text; decode the output on its own instead.
        if context and self._decode(context).endswith(_REPLACEMENT):
            return []
        return context

    def _decode_window(self, final: bool) -> str:
        """New settled text of the window ids[prefix:]; advances the offsets when it closes."""
        if len(self._ids) == self._read:
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        tail = text[len(self._prefix_text):]
        if final or not tail.endswith(_REPLACEMENT):
            new = tail[self._window_chars:]
            self._advance(len(self._ids))
            return new
        stable = tail.rstrip(_REPLACEMENT)
        new = stable[self._window_chars:]
        self._window_chars += len(new)
        if len(self._ids) - self._read > _MAX_OPEN_TOKENS:
            new += self._split_open_window(text)
        return new

    def _advance(self, read: int) -> None:
        """Close the window at ``read``: ids[old read:read] becomes the next prefix."""
        del self._ids[:self._read]
        self._prefix, self._read = 0, read - self._read
        self._prefix_text = None
        self._window_chars = 0

    def _split_open_window(self, text: str) -> str:
        """Close the first part of a long open window if decoding the parts apart gives the same
        text (it does unless the cut falls inside a byte sequence); returns text it settles."""
        cut = len(self._ids) - _KEEP_OPEN_TOKENS
        head = self._decode(self._ids[self._prefix:cut])
        if head + self._decode(self._ids[cut:]) != text or len(head) < len(self._prefix_text):
            return ""
        head_tail = head[len(self._prefix_text):]
        # The chars taken so far are a prefix of the window's text; those past the cut carry
        # over to the window that stays open.
        taken = self._window_chars
        new = head_tail[taken:]
        self._advance(cut)
        self._window_chars = max(0, taken - len(head_tail))
        return new

    # ---- stop strings ---------------------------------------------------------------------------
    def _emit(self, new: str, final: bool) -> DetokResult:
        old_len = len(self._pending)
        self._pending += new
        match = self._find_stop(old_len)
        if match is not None:
            start, stop = match
            delta = self._pending[:start + len(stop) if self._include_stop else start]
            self._pending = ""
            self._stop_string = stop
            self._done = True
        else:
            cut = len(self._pending) - (0 if final else self._partial_stop_len())
            delta, self._pending = self._pending[:cut], self._pending[cut:]
        if delta:
            self._pieces.append(delta)
        return DetokResult(delta, self._stop_string)

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """The first stop completed in the pending text; old_len chars were scanned before."""
        # A new match ends past old_len, so it starts at most max_stop - 1 chars before it.
        begin = max(0, old_len - self._max_stop + 1)
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            at = self._pending.find(stop, begin)
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self) -> int:
        """Length of the longest pending suffix that is a proper prefix of some stop string."""
        for n in range(min(self._max_stop - 1, len(self._pending)), 0, -1):
            suffix = self._pending[-n:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return n
        return 0
