"""The runner's persistent row batch: one slot per running request, kept across steps.

A slot holds what a step reads of its request, as rows of arrays that change only where the
request changed:

* its known tokens (prompt, then output; a step appends the tokens sampled since the previous
  one) and, past them, the drafts it runs this step: ``prepare`` gathers a step's input ids with
  one index into ``tokens``;
* its block table (a step copies in only the blocks allocated since the previous one; a table
  only grows while its request holds its blocks, except with attention sinks, where a step that
  dropped blocks after the sinks rewrites the row): the step's block tables are one index into
  ``tables``, zero past each row's blocks;
* its sampling parameters (``sampler.RowParams``, checked against the vocabulary once, when the
  request takes its slot): a step's sampling tensors are one gather per field;
* its penalty tally (``engine.penalty_rows``), which outlives a preemption: the request keeps its
  tokens and the tally stays true.

The scheduler's diff updates it: a request scheduled for the first time (or again after a
preemption) takes a free slot in ``sync``; ``release`` (preempted: its blocks went back to the
pool) and ``drop`` (finished) give the slot back.
"""
from __future__ import annotations

import numpy as np

from sluice.engine.penalty_rows import PenaltyRows
from sluice.engine.sampler import RowParams


class RowBatch:
    def __init__(self, vocab_size: int, capacity: int = 16) -> None:
        self.vocab_size = vocab_size
        self.tallies = PenaltyRows()
        self._slot: dict[str, int] = {}          # request id -> slot
        self._owner: list = [None] * capacity    # the Request holding each slot
        self._free = list(range(capacity - 1, -1, -1))
        self._known = [0] * capacity             # tokens of the slot's request in `tokens`
        self._blocks = [0] * capacity            # blocks of its table in `tables`
        self.tokens = np.zeros((capacity, 64), dtype=np.int32)
        self.tables = np.zeros((capacity, 16), dtype=np.int32)
        self._params = {f: np.zeros(capacity, dtype=t) for f, t in zip(RowParams.FIELDS, RowParams.DTYPES)}
        self._logprobs: list[int | None] = [None] * capacity
        self._bias = [False] * capacity
        self._version = 0            # bumped when a slot changes hands: keys the last gather
        self._gathered: tuple | None = None     # (slots, version, RowParams) of the last params()

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._slot

    def slot(self, request_id: str) -> int:
        return self._slot[request_id]

    # ---- the scheduler's diff -----------------------------------------------------------------
    def release(self, request_id: str) -> None:
        """A preempted request: its blocks went back to the pool, its slot goes; its tally stays."""
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._version += 1
            self._owner[slot] = None
            self.tables[slot, :self._blocks[slot]] = 0
            self._blocks[slot] = self._known[slot] = 0
            self._free.append(slot)

    def drop(self, request_id: str) -> None:
        """A finished request: its slot and its tally go."""
        self.release(request_id)
        self.tallies.drop(request_id)

    def sync(self, scheduled) -> np.ndarray:
        """[len(scheduled)] each scheduled sequence's slot (taken for a request seen for the first
        time), with its block table and tokens brought up to date and its drafts for this step
        written after its known tokens."""
        out = np.empty(len(scheduled), dtype=np.int64)
        for i, s in enumerate(scheduled):
            req = s.request
            slot = self._slot.get(req.request_id)
            if slot is None or self._owner[slot] is not req:
                slot = self._take(req)
            out[i] = slot
            self._sync_table(slot, s.block_ids, rewrite=getattr(s, "num_shifted_tokens", 0) > 0)
            n = req.num_tokens
            if self._known[slot] != n:
                self._sync_tokens(slot, req, n)
            end = s.num_computed_tokens + s.num_new_tokens
            if end > n:    # this step's drafts, after the known tokens (overwritten as they are accepted)
                self._fit_tokens(end)
                self.tokens[slot, n:end] = req.spec_token_ids[:end - n]
        return out

    def params(self, slots) -> RowParams:
        """The sampling parameters of the rows whose slots are ``slots`` (a row per entry)."""
        key = tuple(slots)
        last = self._gathered
        if last is not None and last[0] == key and last[1] == self._version:   # a steady batch: as before
            return last[2]
        idx = np.asarray(key, dtype=np.int64)
        params = RowParams(**{f: a[idx] for f, a in self._params.items()},
                           num_logprobs=tuple(self._logprobs[i] for i in key),
                           any_bias=any(self._bias[i] for i in key))
        self._gathered = (key, self._version, params)
        return params

    # ---- slots --------------------------------------------------------------------------------
    def _take(self, req) -> int:
        self.release(req.request_id)     # a reused id: the old request's slot goes first
        entry = RowParams.entry(req, self.vocab_size)   # raises before a slot is taken
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._version += 1
        self._slot[req.request_id] = slot
        self._owner[slot] = req
        for f, v in zip(RowParams.FIELDS, entry):
            self._params[f][slot] = v
        self._logprobs[slot], self._bias[slot] = entry[-2], entry[-1]
        return slot

    def _grow(self) -> None:
        old = len(self._owner)
        cap = 2 * old
        self.tokens = _resized(self.tokens, cap, self.tokens.shape[1])
        self.tables = _resized(self.tables, cap, self.tables.shape[1])
        self._params = {f: _resized(a, cap) for f, a in self._params.items()}
        for name in ("_owner", "_logprobs"):
            getattr(self, name).extend([None] * old)
        for name in ("_known", "_blocks"):
            getattr(self, name).extend([0] * old)
        self._bias.extend([False] * old)
        self._free.extend(range(cap - 1, old - 1, -1))

    def _sync_table(self, slot: int, block_ids, rewrite: bool = False) -> None:
        n, filled = len(block_ids), self._blocks[slot]
        if rewrite or filled > n or (filled and int(self.tables[slot, 0]) != block_ids[0]):
            self.tables[slot, :filled] = 0     # not the table kept: start again
            filled = 0
        if n > filled:
            if n > self.tables.shape[1]:
                self.tables = _resized(self.tables, self.tables.shape[0], max(n, 2 * self.tables.shape[1]))
            self.tables[slot, filled:n] = block_ids[filled:n]
        self._blocks[slot] = n

    def _sync_tokens(self, slot: int, req, n: int) -> None:
        known, n_prompt = self._known[slot], req.num_prompt_tokens
        if known == n - 1 and known >= n_prompt and n <= self.tokens.shape[1]:   # a decode step: one token
            self.tokens[slot, known] = req.output_token_ids[-1]
            self._known[slot] = n
            return
        self._fit_tokens(n)
        row = self.tokens[slot]
        if known > n or known < n_prompt:   # new, or its output shrank (a stop string cut drafts)
            row[:n_prompt] = req.prompt_token_ids
            known = n_prompt
        if n > known:
            row[known:n] = req.output_token_ids[known - n_prompt:n - n_prompt]
        self._known[slot] = n

    def _fit_tokens(self, n: int) -> None:
        if n > self.tokens.shape[1]:
            self.tokens = _resized(self.tokens, self.tokens.shape[0], max(n, 2 * self.tokens.shape[1]))


def _resized(a: np.ndarray, rows: int, cols: int | None = None) -> np.ndarray:
    """``a`` copied into a zeroed array of ``rows`` (x ``cols``)."""
    out = np.zeros((rows,) if cols is None else (rows, cols), dtype=a.dtype)
    out[tuple(slice(0, d) for d in a.shape)] = a
    return out
