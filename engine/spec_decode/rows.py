"""Logit rows: a request with K draft tokens gives K + 1 rows, one per position it predicts.

Row ``j`` of a request sees its known tokens plus drafts ``d_0 .. d_{j-1}``: its logits are the
target's distribution for the token after them. Every sampling stage reads its history from the
row, not from the request, so penalties count the drafts before the position, ``min_tokens``
counts them as output, and seeded draws key on the position. ``SampleRow`` exposes exactly the
attributes ``SamplingBatch.from_requests`` reads; a request without drafts is its own row.
"""
from __future__ import annotations

from dataclasses import dataclass

from sluice.engine.request import Request
from sluice.engine.spec_decode import tree


@dataclass(frozen=True)
class SampleRow:
    request: Request
    drafts: tuple[int, ...]          # the draft tokens before this row's position

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def sampling_params(self):
        return self.request.sampling_params

    @property
    def seed(self) -> int | None:
        return self.request.seed

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.request.eos_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + list(self.drafts)

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts)


def rows_of(req: Request, drafts: list[int], parents: list[int] | None = None) -> list[Request | SampleRow]:
    """The K + 1 rows of a request with K drafts (the request itself when K is 0). For a draft
    tree (``parents``, ``spec_decode.tree``) node i's row holds the drafts on its path."""
    if not drafts:
        return [req]
    if parents is not None:
        return [SampleRow(req, ())] + [SampleRow(req, tree.path_tokens(drafts, parents, i)) for i in range(len(drafts))]
    return [SampleRow(req, tuple(drafts[:j])) for j in range(len(drafts) + 1)]
