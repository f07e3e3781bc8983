"""Stop strings inside a run of accepted drafts: the text is cut where the stop completes, and so
are the tokens (the ones after it were never output)."""
from __future__ import annotations

from collections.abc import Sequence

from sluice.engine.detokenizer import DetokResult, IncrementalDetokenizer


def add_tokens_until_stop(detok: IncrementalDetokenizer, token_ids: Sequence[int]) -> tuple[DetokResult, int]:
    """Feeds ``token_ids`` one at a time until a stop string completes. Returns the combined
    result and how many tokens were used (all of them unless a stop string ended the run)."""
    if len(token_ids) <= 1:
        return detok.add_tokens(token_ids), len(token_ids)
    text = []
    for used, tok in enumerate(token_ids, 1):
        r = detok.add_tokens([tok])
        text.append(r.delta_text)
        if r.stop_string is not None:
            return DetokResult("".join(text), r.stop_string), used
    return DetokResult("".join(text)), len(token_ids)
