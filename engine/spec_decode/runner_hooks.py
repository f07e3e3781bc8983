"""The runner contract of speculative decoding: what ``ModelRunner`` calls at named points of a
step, so that the runner keeps no speculative state of its own and no proposer reads the runner.

* ``prepare``: ``StepTrees.add`` for each sequence that runs several rows; a draft tree's nodes
  get their positions (``n - 1 + depth``), their cache slots are kept for a later KV move, and
  ``StepTrees.rows`` describes what each node attends to (``TreeRows``).
* ``sample``: ``SpecRunnerHooks.verify`` as the last stage of the rows of the sequences that
  carried drafts (after the step's shared sampling stages), with the draft distributions the
  decoder handed over (``expect``); a tree's accepted path has
  its K/V moved to the slots a chain of the same tokens would hold (``tree.accepted_moves``).
* after sampling: ``SpecRunnerHooks.capture`` puts the hidden states a proposer's heads read in
  ``RunnerOutput.hidden_states``; the engine passes them on to the proposer.
* ``drop``: a finished request's draft distributions go.

A runner always holds hooks: off (``capture`` None, no drafts handed over), they cost nothing
(nothing is captured, a step without drafts never verifies). Speculation's factory turns on the
capture its proposer reads.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from sluice.engine.attention.base import NO_TREE, TreeRows
from sluice.engine.spec_decode import tree
from sluice.engine.spec_decode.verify import DraftedSeq, verify

# What a step keeps of the target's hidden states for the proposer (RunnerOutput.hidden_states):
# "all": request id -> (first position, [n, H]) of every row computed for it, rejected drafts'
# included (EAGLE's cache); "last": request id -> (position, [H]) of the row behind the request's
# last token (Medusa).
CAPTURE_MODES = (None, "last", "all")


def step_parents(req, num_drafts: int) -> list[int] | None:
    """The parents of the drafts that run, when they are a tree (``Request.spec_parents``)."""
    parents = req.spec_parents if num_drafts else None
    if parents is None:
        return None
    if len(parents) < num_drafts:
        raise ValueError(f"request {req.request_id!r}: {num_drafts} drafts but {len(parents)} tree parents")
    return list(parents[:num_drafts])


class StepTrees:
    """The draft trees among one step's sequences, collected while ``prepare`` lays out rows."""

    def __init__(self) -> None:
        # first draft row -> (its tree's depths, parents, the nodes' slots, sequence index)
        self._trees: dict[int, tuple] = {}
        self.slots: dict[str, np.ndarray] = {}    # request id -> its nodes' cache slots, in draft order

    def add(self, req, seq: int, first_row: int, positions: np.ndarray, slots: np.ndarray) -> None:
        """A sequence's rows (``positions`` and ``slots`` of its new tokens, from ``first_row``):
        when its drafts are a tree, node i runs at index n + i (its slot) but sits at position
        n - 1 + depth, which this writes into ``positions``."""
        num_drafts = max(0, int(positions[-1]) + 1 - req.num_tokens)
        parents = step_parents(req, num_drafts)
        if parents is None:
            return
        depth = np.asarray(tree.depths(parents), dtype=np.int64)
        positions[len(positions) - num_drafts:] = req.num_tokens - 1 + depth
        nodes = slots[len(slots) - num_drafts:]
        self._trees[first_row + len(positions) - num_drafts] = (depth, parents, nodes, seq)
        self.slots[req.request_id] = nodes

    def rows(self, positions: torch.Tensor, device) -> TreeRows | None:
        """Both descriptions of the step's draft-tree rows (``TreeRows``), None without trees:
        every row's prefix length (position + 1) and, for a node's row, its path's slots from
        the first draft position on; and for a node's row the index of its tree's first node
        and which nodes it sees (its path)."""
        if not self._trees:
            return None
        trees = self._trees
        lens = positions + 1
        start = lens.clone()
        num_rows = len(positions)
        depth = max(int(d.max()) for d, _p, _s, _i in trees.values())
        tail = np.zeros((num_rows, depth), dtype=np.int64)
        node_start = np.full(num_rows, NO_TREE, dtype=np.int32)
        visible = np.zeros((num_rows, max(len(p) for _d, p, _s, _i in trees.values())), dtype=np.int8)
        for first, (_depth, parents, slots, _seq) in trees.items():
            first_pos = int(positions[first])     # node 0, a child of the last known token: position and index n
            nodes = slice(first, first + len(parents))
            seen = np.array(tree.visibility(parents), dtype=np.int8)
            for i in range(len(parents)):
                path = np.flatnonzero(seen[i])    # ancestors come before their children: the path in order
                tail[first + i, :len(path)] = slots[path]
            start[nodes] = first_pos
            node_start[nodes] = first_pos
            visible[nodes, :len(parents)] = seen
        return TreeRows(lens=lens.to(torch.int32).to(device), tail_start=start.to(torch.int32).to(device),
                        tail_slots=torch.from_numpy(tail).to(device),
                        node_start=torch.from_numpy(node_start).to(device),
                        visible=torch.from_numpy(visible).to(device),
                        tree_seqs=tuple(seq for _d, _p, _s, seq in trees.values()))


class SpecRunnerHooks:
    """Speculative decoding's state inside a step: the draft distributions handed over for the
    next verification and, during a step, the draft trees' accepted paths (which the capture of
    hidden states follows)."""

    def __init__(self, capture: str | None = None) -> None:
        if capture not in CAPTURE_MODES:
            raise ValueError(f"capture: expected one of {CAPTURE_MODES}, got {capture!r}")
        self.capture_mode = capture
        # request id -> [K, V] draft distributions for the drafts it carries into the next step
        # (absent: a point mass per draft token).
        self.draft_probs: dict[str, torch.Tensor] = {}
        self._accepted_nodes: dict[str, list[int]] = {}   # this step's draft trees: the accepted path

    def expect(self, request_id: str, probs: torch.Tensor | None) -> None:
        """The distributions the request's new drafts were drawn from (None: point masses)."""
        if probs is None:
            self.draft_probs.pop(request_id, None)
        else:
            self.draft_probs[request_id] = probs

    def drop(self, request_id: str) -> None:
        self.draft_probs.pop(request_id, None)

    def begin_step(self) -> None:
        self._accepted_nodes.clear()

    def verify(self, plan, penalised: torch.Tensor, batch, res, tree_slots: dict | None, generators,
               use_kernel: bool, move_kv: Callable) -> None:
        """Verify the drafted sequences of ``plan`` (``model_runner.SamplePlan``) into ``res``:
        the last stage of their rows, after the shared ones. ``penalised`` [rows, V] and
        ``batch`` (a ``SamplingBatch``) are the step's, over every sampled row (``rows_of`` per
        sequence, in plan order); ``move_kv(slots, moves)`` is the runner's K/V copy between
        cache slots."""
        seqs, wanted = [], []
        for i in plan.drafted:
            req, drafts = plan.seqs[i]
            seqs.append(DraftedSeq(req, len(wanted), drafts, self.draft_probs.pop(req.request_id, None),
                                   plan.parents[i]))
            wanted.extend(range(plan.first_row[i], plan.first_row[i] + len(drafts) + 1))
        if wanted == list(range(wanted[0], wanted[0] + len(wanted))):   # one run of rows: a view
            rows = penalised[wanted[0]:wanted[0] + len(wanted)]
        else:
            rows = penalised.index_select(0, torch.tensor(wanted, device=penalised.device))
        for s, v in zip(seqs, verify(rows, batch.select(wanted), seqs, generators, use_kernel, prepenalised=True)):
            rid = s.request.request_id
            res.sampled_token_ids[rid] = v.token_ids
            res.num_rejected_tokens[rid] = v.num_rejected
            if v.logprobs is not None:
                res.logprobs[rid] = v.logprobs
            if v.accepted_nodes is not None:
                self._accepted_nodes[rid] = v.accepted_nodes
                move_kv(tree_slots[rid], tree.accepted_moves(v.accepted_nodes))

    def capture(self, scheduled, sample_rows: torch.Tensor, hidden: torch.Tensor, res) -> None:
        """The hidden states the proposer reads (``capture_mode``) into ``res.hidden_states``."""
        if self.capture_mode == "all":
            row = 0
            for s in scheduled:
                rid = s.request.request_id
                rows = hidden[row:row + s.num_new_tokens]
                if rid in self._accepted_nodes:   # a tree: the known rows, then the accepted path's
                    known = s.num_new_tokens - _num_drafts(s)
                    rows = rows[[*range(known), *(known + a for a in self._accepted_nodes[rid])]]
                res.hidden_states[rid] = (s.num_computed_tokens, rows)
                row += s.num_new_tokens
        elif self.capture_mode == "last":
            self._capture_last(scheduled, sample_rows, hidden, res)

    def _capture_last(self, scheduled, sample_rows: torch.Tensor, hidden: torch.Tensor, res) -> None:
        """The row behind each sampled sequence's last new token: the last accepted draft's."""
        first = 0      # the sequence's first logit row: its last known token's
        for s in scheduled:
            if not s.sample:
                continue
            req, num_drafts = s.request, _num_drafts(s)
            rid = req.request_id
            if rid in res.sampled_token_ids:
                accepted = num_drafts - res.num_rejected_tokens.get(rid, 0)
                nodes = self._accepted_nodes.get(rid)
                row = int(sample_rows[first + (accepted if nodes is None else 1 + nodes[-1] if nodes else 0)])
                # The row's position: the last known token's (N - 1) plus the drafts accepted.
                res.hidden_states[rid] = (req.num_tokens - 1 + accepted, hidden[row])
            first += num_drafts + 1


def _num_drafts(s) -> int:
    """Draft tokens the scheduled sequence runs (the scheduler trimmed spec_token_ids to them)."""
    return max(0, s.num_computed_tokens + s.num_new_tokens - s.request.num_tokens)
