"""The token history that penalties read, per sampled row, as the distinct tokens it holds.

Repetition, presence and frequency penalties change the logits of the tokens a sequence already
holds and of no other. A row is therefore kept as its distinct tokens (``ids``), how often each
occurs in the output (``counts``) and whether it occurs in the prompt (``in_prompt``): the
sampler gathers those logits, penalises them and scatters them back, which costs
O(distinct tokens) per row instead of O(vocabulary) (a [32, 49152] count table rebuilt from the
token lists took 9 ms of a 54 ms decode step at 1024 tokens of context, 22 ms at 4096).

``PenaltyRows`` keeps each running request's tally across steps and adds only the tokens sampled
since the previous step. Rows with drafts (``sampler.SampleRow``) add their drafts to a
copy. A request's tally is rebuilt when it is not the one tallied (a reused id) or its output
shrank (a stop string cut a run of accepted drafts); ``drop`` forgets finished requests.

The prompt is tallied only for rows with a repetition penalty (the one penalty that reads it).
"""
from __future__ import annotations

import numpy as np
import torch


class _Tally:
    """One request's distinct tokens: ids, output counts, prompt membership (capacity grows ×2)."""

    __slots__ = ("owner", "with_prompt", "slot", "ids", "counts", "in_prompt", "n", "n_out")

    def __init__(self, owner, with_prompt: bool, vocab_size: int) -> None:
        self.owner, self.with_prompt = owner, with_prompt
        prompt = owner.prompt_token_ids if with_prompt else ()
        ids, counts, in_prompt = tally_arrays(prompt, owner.output_token_ids, vocab_size)
        cap = max(64, 2 * len(ids))
        self.ids = np.zeros(cap, np.int64)
        self.counts = np.zeros(cap, np.float32)
        self.in_prompt = np.zeros(cap, np.bool_)
        self.n = len(ids)
        self.ids[:self.n], self.counts[:self.n], self.in_prompt[:self.n] = ids, counts, in_prompt
        self.slot = dict(zip(ids.tolist(), range(self.n)))
        self.n_out = len(owner.output_token_ids)

    def add(self, tokens, vocab_size: int) -> None:
        for t in tokens:
            i = self.slot.get(t)
            if i is None:
                _check_ids(t, t, vocab_size)
                i = self.n
                if i == len(self.ids):
                    self._grow()
                self.ids[i], self.counts[i], self.in_prompt[i] = t, 0.0, False
                self.slot[t] = i
                self.n += 1
            self.counts[i] += 1.0
        self.n_out += len(tokens)

    def _grow(self) -> None:
        cap = 2 * len(self.ids)
        for name in ("ids", "counts", "in_prompt"):
            old = getattr(self, name)
            new = np.zeros(cap, old.dtype)
            new[:self.n] = old[:self.n]
            setattr(self, name, new)

    def arrays(self, drafts, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids, counts, in_prompt) of the tally plus ``drafts`` (copies where drafts change them)."""
        n = self.n
        ids, counts, in_prompt = self.ids[:n], self.counts[:n], self.in_prompt[:n]
        if not drafts:
            return ids, counts, in_prompt
        counts = counts.copy()
        extra: dict[int, int] = {}
        for t in drafts:
            i = self.slot.get(t)
            if i is not None:
                counts[i] += 1.0
            else:
                extra[t] = extra.get(t, 0) + 1
        if extra:
            new = np.fromiter(extra, np.int64, len(extra))
            _check_ids(int(new.min()), int(new.max()), vocab_size)
            ids = np.concatenate([ids, new])
            counts = np.concatenate([counts, np.fromiter(extra.values(), np.float32, len(extra))])
            in_prompt = np.concatenate([in_prompt, np.zeros(len(extra), np.bool_)])
        return ids, counts, in_prompt


def tally_arrays(prompt, output, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, output counts, in prompt) of the distinct tokens of ``prompt`` and ``output``, ids sorted."""
    out = np.asarray(output, dtype=np.int64)
    pro = np.asarray(prompt, dtype=np.int64)
    for a in (out, pro):
        if a.size:
            _check_ids(int(a.min()), int(a.max()), vocab_size)
    out_ids, out_counts = np.unique(out, return_counts=True)
    if not pro.size:
        return out_ids, out_counts.astype(np.float32), np.zeros(len(out_ids), np.bool_)
    pro_ids = np.unique(pro)
    ids = np.union1d(pro_ids, out_ids)
    counts = np.zeros(len(ids), np.float32)
    counts[np.searchsorted(ids, out_ids)] = out_counts
    return ids, counts, np.isin(ids, pro_ids, assume_unique=True)


def _check_ids(lo: int, hi: int, vocab_size: int) -> None:
    # Checked on the host: an out-of-range index would be a device-side assert on CUDA.
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token ids: a prompt or output token is outside the vocabulary (size {vocab_size})")


class PenaltyRows:
    """Per-request tallies kept across steps (owned by the model runner, like its generators)."""

    def __init__(self) -> None:
        self._by_request: dict[str, _Tally] = {}

    def tally(self, req, with_prompt: bool, vocab_size: int) -> _Tally:
        t = self._by_request.get(req.request_id)
        n_out = len(req.output_token_ids)
        if t is None or t.owner is not req or t.with_prompt != with_prompt or t.n_out > n_out:
            t = self._by_request[req.request_id] = _Tally(req, with_prompt, vocab_size)
        elif t.n_out < n_out:
            t.add(req.output_token_ids[t.n_out:], vocab_size)
        return t

    def drop(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._by_request)


def penalty_tensors(rows, needs: list[bool], with_prompt: list[bool], vocab_size: int, device,
                    state: PenaltyRows | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, U] (ids int64, output counts float32, seen bool) for the rows; rows that need no
    penalty hold nothing. ``rows``: ``sampler.SampleRow``s (a request, the drafts before the row).

    Padding repeats the row's first entry (or token 0 with count 0, unseen, for an empty row), so
    a scatter of the penalised values writes each logit once with one value."""
    per_row = []
    for row, need, prompt in zip(rows, needs, with_prompt):
        if not need:
            per_row.append(None)
            continue
        req, drafts = row.request, row.drafts
        if state is not None:
            per_row.append(state.tally(req, prompt, vocab_size).arrays(drafts, vocab_size))
        else:
            per_row.append(tally_arrays(req.prompt_token_ids if prompt else (),
                                        list(req.output_token_ids) + list(drafts), vocab_size))
    width = max(1, max((len(r[0]) for r in per_row if r is not None), default=1))
    ids = np.zeros((len(per_row), width), np.int64)
    counts = np.zeros((len(per_row), width), np.float32)
    seen = np.zeros((len(per_row), width), np.bool_)
    for i, r in enumerate(per_row):
        if r is None or not len(r[0]):
            continue
        n = len(r[0])
        ids[i, :n], counts[i, :n], seen[i, :n] = r[0], r[1], r[2]
        ids[i, n:], counts[i, n:], seen[i, n:] = r[0][0], r[1][0], r[2][0]
    seen |= counts > 0
    return (torch.from_numpy(ids).to(device), torch.from_numpy(counts).to(device),
            torch.from_numpy(seen).to(device))
