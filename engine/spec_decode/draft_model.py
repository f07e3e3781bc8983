"""``small_draft``: a second, smaller model proposes drafts greedily.

The draft model has its own KV tensors, indexed by the target's block ids: the two share one
block pool and one budget (``shared_num_blocks`` sizes the pool for both), so a request's draft
KV is allocated, preempted and freed with its target KV, and the scheduler never knows there
are two. The draft's KV of a position is valid while the token there is the one the draft
computed it for: after each verification ``propose`` keeps the common prefix of what it
computed and the request's tokens, and computes from there (prompt on first sight, accepted
tokens and the added one after). A preemption frees the blocks, so the draft starts over.

One propose() for K drafts is K forwards of the draft over the decoding requests: the first
catches up (positions ``done .. N-1``) and yields ``d_0``, each next one runs ``d_{i-1}`` at
position ``N-1+i``. The draft's logits go through the request's penalties, bias and min_tokens
mask on the draft's own row history (``rows``). A greedy request's draft is their argmax (a
point mass: with the target as its own draft every greedy draft is accepted); a sampling
request's draft is drawn from the draft's own distribution after the request's temperature,
top-k/p and min-p (``processed_probs``), and that distribution goes with the draft to the
rejection sampler, which accepts ``d`` with probability min(1, p(d) / q(d)). The draws use the
draft runner's generators (a seeded request: its own seed), never the target's.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sluice.engine.request import Request
from sluice.engine.spec_decode.proposer import Draft, draft_room, draw
from sluice.engine.sampler import SampleRow


def check_same_vocabulary(target, draft, draft_name: str) -> None:
    """Drafts are token ids of the target's vocabulary: the two tokenizers must agree on every id."""
    tv, dv = target.arch.vocab_size, draft.arch.vocab_size
    if tv != dv:
        raise ValueError(f"additional_models: draft model {draft_name} has a vocabulary of {dv} tokens, "
                         f"the target's has {tv}; small_draft needs the same tokenizer vocabulary")
    tt, dt = target.tokenizer, draft.tokenizer
    for i in range(min(tt.vocab_size, tv)):
        if tt.id_to_token(i) != dt.id_to_token(i):
            raise ValueError(f"additional_models: draft model {draft_name} spells token {i} "
                             f"{dt.id_to_token(i)!r}, the target {tt.id_to_token(i)!r}; small_draft "
                             "needs the same tokenizer vocabulary")


def kv_bytes_per_block(arch, dtype_bytes: int, block_size: int) -> int:
    return 2 * arch.num_hidden_layers * block_size * arch.num_key_value_heads * arch.head_dim * dtype_bytes


@dataclass
class _View:
    """The token view ``ModelRunner.prepare`` reads: known tokens plus the drafts so far."""
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    spec_token_ids: tuple = ()
    spec_parents: None = None          # the draft model's drafts are a chain

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass(frozen=True)
class _Seq:
    """A ScheduledSeq for the draft runner."""
    request: _View
    num_new_tokens: int
    num_computed_tokens: int
    block_ids: tuple[int, ...]
    sample: bool = True


class DraftModelProposer:
    name = "small_draft"

    def __init__(self, draft_runner, kv_manager, block_size: int) -> None:
        self.runner = draft_runner          # a ModelRunner over the draft model and its own KV
        self.kv = kv_manager
        self.block_size = block_size
        self._computed: dict[str, list[int]] = {}     # request id -> tokens with draft KV
        self._preemptions: dict[str, int] = {}

    def observe(self, requests, hidden_states) -> None:
        pass

    def drop(self, request_id: str) -> None:
        self._computed.pop(request_id, None)
        self._preemptions.pop(request_id, None)
        self.runner.generators.drop(request_id)

    def propose(self, requests: Sequence[Request], k: int) -> dict[str, Draft]:
        work = []   # (request, done, room, block ids)
        for req in requests:
            blocks = tuple(self.kv.get_block_ids(req.request_id))
            # The draft writes d_0 .. d_{room-2} at N .. N+room-2: within the reserved slots.
            room = min(draft_room(req, k), len(blocks) * self.block_size - req.num_tokens + 1)
            if room <= 0:
                continue
            work.append((req, self._done(req), room, blocks))
        drafts: dict[str, list[int]] = {req.request_id: [] for req, *_ in work}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, *_ in work}
        step = 0
        while work:
            seqs, rows = [], []
            for req, done, room, blocks in work:
                d = drafts[req.request_id]
                view = _View(req.prompt_token_ids, req.output_token_ids + d)
                start = done if step == 0 else view.num_tokens - 1
                seqs.append(_Seq(view, view.num_tokens - start, start, blocks))
                rows.append(SampleRow(req, tuple(d)))
            tokens, dists = self._next(seqs, rows)
            for (req, _done, _room, _blocks), tok, q in zip(work, tokens, dists):
                drafts[req.request_id].append(tok)
                if q is not None:
                    probs[req.request_id].append(q)
            step += 1
            work = [w for w in work if len(drafts[w[0].request_id]) < w[2]]
        out, by_id = {}, {r.request_id: r for r in requests}
        for rid, d in drafts.items():
            req = by_id[rid]
            # KV now holds the known tokens and every draft but the last.
            self._computed[rid] = req.all_token_ids + d[:-1]
            self._preemptions[rid] = req.num_preemptions
            out[rid] = Draft(d, torch.stack(probs[rid]) if probs[rid] else None)
        return out

    def _done(self, req: Request) -> int:
        """Leading tokens whose draft KV is still valid (at most N - 1: the last known token's
        row is always run, it yields d_0)."""
        if self._preemptions.get(req.request_id) != req.num_preemptions:
            self._computed.pop(req.request_id, None)
        had = self._computed.get(req.request_id, ())
        tokens = req.all_token_ids
        n = 0
        limit = min(len(had), len(tokens) - 1)
        while n < limit and had[n] == tokens[n]:
            n += 1
        return n

    def _next(self, seqs: list[_Seq], rows: list[SampleRow]) -> tuple[list[int], list[torch.Tensor | None]]:
        """Each row's next draft token, and the [V] distribution it was drawn from (None: argmax)."""
        runner = self.runner
        batch = runner.prepare(seqs)
        hidden = runner.forward(batch)
        with torch.inference_mode():
            logits = runner.model.compute_logits(hidden[batch.sample_rows])     # [len(seqs), V]
            return draw(logits, rows, runner.generators, runner.vocab_size, runner.device)
