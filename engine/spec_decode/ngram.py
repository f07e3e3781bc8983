"""Prompt-lookup drafts: the request's own prompt and output predict its continuation.

For ``n`` from ``max_n`` down to ``min_n``: take the last ``n`` tokens, find their latest earlier
occurrence in prompt + output, and propose the (up to ``k``) tokens that followed it. Summaries,
edits and code rewrites copy long runs of their input, which is where this pays. Pure Python,
no model; the draft is a point mass on each token.
"""
from __future__ import annotations

from collections.abc import Sequence

from sluice.engine.request import Request
from sluice.engine.spec_decode.proposer import Draft, draft_room


def ngram_lookup(tokens: Sequence[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` (length ``max_n`` down to ``min_n``) that occurs earlier; [] when none does."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = list(tokens[size - n:])
        first = suffix[0]
        # Latest start i < size - n whose n tokens equal the suffix (the suffix itself excluded).
        for i in range(size - n - 1, -1, -1):
            if tokens[i] == first and list(tokens[i:i + n]) == suffix:
                return list(tokens[i + n:i + n + k])
    return []


class NgramProposer:
    name = "ngram"

    def __init__(self, max_n: int, min_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"spec_ngram_min: must be in [1, spec_ngram_max={max_n}], got {min_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, requests: Sequence[Request], k: int) -> dict[str, Draft]:
        drafts = {}
        for req in requests:
            room = draft_room(req, k)
            if room == 0:
                continue
            toks = ngram_lookup(req.all_token_ids, room, self.max_n, self.min_n)
            if toks:
                drafts[req.request_id] = Draft(toks)
        return drafts

    def observe(self, requests, hidden_states) -> None:
        pass

    def drop(self, request_id: str) -> None:
        pass   # stateless
