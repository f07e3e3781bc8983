"""Logit rows: a request with K draft tokens gives K + 1 rows, one per position it predicts.

Row ``j`` of a request sees its known tokens plus drafts ``d_0 .. d_{j-1}``: its logits are the
target's distribution for the token after them. Each is a ``sampler.SampleRow`` (the request and
those drafts), from which every sampling stage reads the row's history: penalties count the
drafts before the position, ``min_tokens`` counts them as output, and seeded draws key on the
position.
"""
from __future__ import annotations

from sluice.engine.request import Request
from sluice.engine.sampler import SampleRow
from sluice.engine.spec_decode import tree


def rows_of(req: Request, drafts: list[int], parents: list[int] | None = None) -> list[SampleRow]:
    """The K + 1 rows of a request with K drafts (one row when K is 0). For a draft tree
    (``parents``, ``spec_decode.tree``) node i's row holds the drafts on its path."""
    if not drafts:
        return [SampleRow(req)]
    if parents is not None:
        return [SampleRow(req, ())] + [SampleRow(req, tree.path_tokens(drafts, parents, i)) for i in range(len(drafts))]
    return [SampleRow(req, tuple(drafts[:j])) for j in range(len(drafts) + 1)]
