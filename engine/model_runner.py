"""The model runner: one scheduler output in, sampled tokens out.

CPU → device flow of one step:
  1. host: for each scheduled sequence, the slice of its tokens to compute this step
     (``num_computed_tokens .. +num_new_tokens``), their positions and cache slots, and its
     block table — built with numpy, then copied to the device once;
  2. device: model forward over the flattened varlen batch (attention through the backend,
     which stores K/V by slot and reads through block tables);
  3. device: logits only for sequences that caught up with their tokens (``sample``), then
     the sampler;
  4. host: one copy of the sampled ids (and logprobs when asked) back.
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from sluice.engine.attention.base import AttentionBackend, AttentionMetadata, KVCache
from sluice.engine.outputs import RunnerOutput, TokenLogprob
from sluice.engine.penalty_rows import PenaltyRows
from sluice.engine.sampler import GeneratorCache, Sampler, SampleRow, SamplingBatch
from sluice.engine.spec_decode.runner_hooks import SpecRunnerHooks, StepTrees, step_parents


@dataclass(frozen=True)
class BatchInputs:
    input_ids: torch.Tensor        # [num_tokens] int64
    positions: torch.Tensor        # [num_tokens] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor      # [num_sampled] int64: hidden row of each sampled sequence's last token
    # request id -> the cache slots of its draft tree's nodes, in draft order (StepTrees.slots)
    tree_slots: dict | None = None


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV tensor. On CPU its memory is a private anonymous mapping: pages the kernel
    maps, already zero, when they are first written (page-aligned), so a 1 GiB pool costs nothing
    to make (torch.zeros wrote every byte: ~0.5 s here) and only the blocks ever written become
    resident. calloc would often do the same, but not always: from a heap that has been used it
    clears the memory itself. Elsewhere, torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # The tensor keeps the mapping alive; it is unmapped when the last view of it goes.
    raw = torch.frombuffer(mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE), dtype=torch.uint8)
    return raw[:nbytes].view(dtype).view(shape)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        dtype: torch.dtype,
        attn: AttentionBackend,
        sampler_backend: str = "auto",
        seed: int = 0,
        grammar=None,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.attn = attn
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches: list[KVCache] = [
            (zeroed_pool(shape, dtype, device), zeroed_pool(shape, dtype, device)) for _ in range(num_layers)
        ]
        self.sampler = Sampler(backend=sampler_backend, device=device)
        self.generators = GeneratorCache(seed=seed, device=device)
        self.penalty_rows = PenaltyRows()   # penalised requests' token tallies, kept across steps
        self.block_tables = BlockTableRows()
        # engine.structured's manager (owned by the engine core): fills the grammar bitmask rows.
        self.grammar = grammar
        # Speculative decoding's runner contract (spec_decode.runner_hooks): verification, the
        # draft distributions handed over for it, and the hidden states a proposer reads.
        # build_spec_decoder replaces it with the decoder's; off, it captures nothing.
        self.spec = SpecRunnerHooks()
        self._move_slots = None          # CPU with the C++ kernels built: their move_slots (move_kv)
        if device.type == "cpu":
            from sluice.kernels import cpu_ext

            if cpu_ext.available():
                self._move_slots = cpu_ext.module().move_slots

    def execute(self, out) -> RunnerOutput:
        """Run one ``SchedulerOutput``; returns the tokens sampled for sequences that caught up."""
        for request_id in out.finished_ids:
            self.generators.drop(request_id)
            self.penalty_rows.drop(request_id)
            self.block_tables.drop(request_id)
            self.spec.drop(request_id)
        for request_id in out.preempted_ids:
            self.block_tables.drop(request_id)
        self.spec.begin_step()
        if not out.scheduled:
            return RunnerOutput()
        batch = self.prepare(out.scheduled, self.block_tables)
        hidden = self.forward(batch)
        # Work that needs the batch but not the logits (a grammar bitmask) goes here.
        res = self.sample(out.scheduled, batch, hidden)
        self.spec.capture(out.scheduled, batch.sample_rows, hidden, res)
        return res

    def forward(self, batch: BatchInputs) -> torch.Tensor:
        """[num_tokens, hidden] for the flattened batch; writes its K/V into the cache."""
        with torch.inference_mode():
            return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.attn)

    def sample(self, scheduled, batch: BatchInputs, hidden: torch.Tensor) -> RunnerOutput:
        """Sample, or verify drafts, on the logit rows of the sequences that caught up: one row
        per sequence, K + 1 for a sequence with K drafts (``spec_decode.rows``)."""
        plan = sample_plan(scheduled)
        if not plan.seqs:
            return RunnerOutput()
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[batch.sample_rows])  # [num_rows, vocab]
            res = RunnerOutput()
            if plan.plain:
                reqs = [plan.seqs[i][0] for i in plan.plain]
                if plan.drafted:
                    idx = torch.tensor([plan.first_row[i] for i in plan.plain], device=self.device)
                    plain_logits = logits[idx]                                    # [num_plain, vocab]
                else:
                    plain_logits = logits
                sb = self.sampling_batch([SampleRow(r) for r in reqs], [(r, ()) for r in reqs])
                self._to_output(reqs, self.sampler(plain_logits, sb), res)
            if plan.drafted:
                self.spec.verify(plan, logits, res, batch.tree_slots, self.sampling_batch, self.generators,
                                 self.sampler.backend == "triton", self.move_kv)
        return res

    def sampling_batch(self, rows: list[SampleRow], grammar_rows) -> SamplingBatch:
        """The sampling batch of logit rows, with the grammar bitmask of ``grammar_rows``
        ((request, drafts) pairs) and the tallies kept across steps."""
        return SamplingBatch.from_rows(rows, self.vocab_size, self.device, self.generators,
                                           self._bitmask(grammar_rows), self.penalty_rows)

    def move_kv(self, slots: np.ndarray, moves: list[tuple[int, int]]) -> None:
        """Copy the K/V of draft nodes to other draft slots (``tree.accepted_moves``), every layer."""
        if not moves:
            return
        src = torch.from_numpy(slots[[a for a, _b in moves]]).to(self.device)
        dst = torch.from_numpy(slots[[b for _a, b in moves]]).to(self.device)
        tp = getattr(self.model, "tp", None)     # tensor parallelism: the other ranks move theirs
        if tp is not None:
            tp.move_kv(src, dst)
        if self._move_slots is not None:      # CPU: one C++ call for every layer's K and V
            self._move_slots([c for cache in self.kv_caches for c in cache], src, dst)
            return
        for cache in self.kv_caches:
            for c in cache:
                flat = c.view(-1, *c.shape[2:])
                flat[dst] = flat[src]

    def _bitmask(self, rows) -> torch.Tensor | None:
        """[num_rows, ceil(V / 32)] grammar bitmask for (request, drafts) rows, or None."""
        return None if self.grammar is None else self.grammar.fill_bitmask(rows, self.device)

    def prepare(self, scheduled, kept: BlockTableRows | None = None) -> BatchInputs:
        """The step's input tensors. ``kept``: block-table rows kept across steps (``execute``
        passes the runner's, whose requests' tables it sees freed); without it each table is
        converted afresh (the draft and training runners, whose tables change under them)."""
        bs = self.block_size
        if kept is not None:
            tables_rows = [kept.row(s.request.request_id, s.block_ids) for s in scheduled]
        else:
            tables_rows = [np.asarray(s.block_ids, dtype=np.int32) for s in scheduled]
        tables = np.zeros((len(scheduled), max(len(r) for r in tables_rows)), dtype=np.int32)
        ids, pos, slots, q_lens, seq_lens, ctx_lens, sample_rows = [], [], [], [], [], [], []
        trees = StepTrees()
        single = True
        row = 0
        for i, (s, table) in enumerate(zip(scheduled, tables_rows)):
            req = s.request
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            tables[i, : len(table)] = table
            if s.num_new_tokens == 1:   # decode: plain ints, no arrays
                ids.append(_token_at(req, start))
                pos.append(start)
                slots.append(int(table[start // bs]) * bs + start % bs)
            else:
                single = False
                ids.append(_token_slice(req, start, end))
                p = np.arange(start, end, dtype=np.int64)
                slots.append(table[p // bs].astype(np.int64) * bs + p % bs)
                trees.add(req, i, row, p, slots[-1])
                pos.append(p)
            q_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            ctx_lens.append(start)
            row += s.num_new_tokens
            if s.sample:   # the last known token's row, then one per draft
                sample_rows.extend(range(row - 1 - _num_drafts(s), row))
        dev = self.device
        if single:
            input_ids = torch.tensor(ids, dtype=torch.int64)
            positions = torch.tensor(pos, dtype=torch.int64)
            slot_mapping = torch.tensor(slots, dtype=torch.int64)
            qsl = torch.arange(len(q_lens) + 1, dtype=torch.int32)
        else:
            as_array = lambda xs: [np.asarray([x], dtype=np.int64) if isinstance(x, int) else x for x in xs]
            input_ids = torch.from_numpy(np.concatenate(as_array(ids)))
            positions = torch.from_numpy(np.concatenate(as_array(pos)))
            slot_mapping = torch.from_numpy(np.concatenate(as_array(slots)))
            qsl = np.zeros(len(q_lens) + 1, dtype=np.int32)
            np.cumsum(q_lens, out=qsl[1:])
            qsl = torch.from_numpy(qsl)
        tree_rows = trees.rows(positions, dev)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            query_start_loc=qsl.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            block_size=bs,
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=tuple(q_lens),
            seq_lens_cpu=tuple(seq_lens),
            tree=tree_rows,
        )
        return BatchInputs(
            input_ids=input_ids.to(dev),
            positions=positions.to(dev),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            tree_slots=trees.slots or None,
        )

    @staticmethod
    def _to_output(sampled, so, res: RunnerOutput) -> None:
        token_ids = so.token_ids.tolist()
        want_lp = [r.sampling_params.logprobs is not None for r in sampled]
        lp = so.logprobs.tolist() if any(want_lp) and so.logprobs is not None else None
        top_ids = so.top_ids.tolist() if lp is not None and so.top_ids is not None else None
        top_lp = so.top_logprobs.tolist() if top_ids is not None else None
        for i, req in enumerate(sampled):
            res.sampled_token_ids[req.request_id] = [token_ids[i]]
            if lp is not None and want_lp[i]:
                k = req.sampling_params.logprobs or 0
                top = tuple(zip(top_ids[i][:k], top_lp[i][:k])) if top_ids is not None else ()
                res.logprobs[req.request_id] = [TokenLogprob(token_ids[i], lp[i], top)]


@dataclass(frozen=True)
class SamplePlan:
    seqs: list[tuple]          # (request, its drafts) per sampled sequence, in batch order
    first_row: list[int]       # each one's first logit row
    plain: list[int]           # indices into seqs without drafts
    drafted: list[int]         # indices into seqs with drafts
    parents: list[list[int] | None]   # each one's draft tree (spec_decode.tree), None: a chain


def _num_drafts(s) -> int:
    """Draft tokens the scheduled sequence runs (the scheduler trimmed spec_token_ids to them)."""
    return max(0, s.num_computed_tokens + s.num_new_tokens - s.request.num_tokens)


def sample_plan(scheduled) -> SamplePlan:
    seqs, first, plain, drafted, parents, row = [], [], [], [], [], 0
    for s in scheduled:
        if not s.sample:
            continue
        drafts = list(s.request.spec_token_ids[:_num_drafts(s)])
        (drafted if drafts else plain).append(len(seqs))
        seqs.append((s.request, drafts))
        parents.append(step_parents(s.request, len(drafts)))
        first.append(row)
        row += len(drafts) + 1
    return SamplePlan(seqs, first, plain, drafted, parents)


def _token_at(req, i: int) -> int:
    """Token ``i`` of the request: prompt, then output, then this step's drafts."""
    n_prompt = req.num_prompt_tokens
    if i < n_prompt:
        return req.prompt_token_ids[i]
    i -= n_prompt
    n_out = len(req.output_token_ids)
    return req.output_token_ids[i] if i < n_out else req.spec_token_ids[i - n_out]


class BlockTableRows:
    """Each scheduled request's block table as a numpy row kept across steps: a step copies in only
    the blocks allocated since the previous one (a table only grows while its request holds it).
    ``drop`` forgets a request that finished or was preempted (its blocks went back to the pool)."""

    def __init__(self) -> None:
        self._rows: dict[str, list] = {}       # request id -> [int32 array (capacity), filled]

    def row(self, request_id: str, block_ids) -> np.ndarray:
        n = len(block_ids)
        entry = self._rows.get(request_id)
        if entry is None or entry[1] > n or (entry[1] and int(entry[0][0]) != block_ids[0]):
            entry = self._rows[request_id] = [np.empty(max(16, 2 * n), dtype=np.int32), 0]
        arr, filled = entry
        if n > filled:
            if n > len(arr):
                arr = np.concatenate([arr[:filled], np.empty(max(n, 2 * len(arr)) - filled, dtype=np.int32)])
                entry[0] = arr
            arr[filled:n] = block_ids[filled:n]
            entry[1] = n
        return arr[:n]

    def drop(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._rows)


def _token_slice(req, start: int, end: int) -> np.ndarray:
    # Avoid rebuilding prompt + output for every decode step. Past the known tokens: the drafts.
    n_prompt, n_known = req.num_prompt_tokens, req.num_tokens
    if end > n_known:
        known = _token_slice(req, start, n_known) if start < n_known else np.empty(0, dtype=np.int64)
        drafts = req.spec_token_ids[max(0, start - n_known):end - n_known]
        return np.concatenate([known, np.asarray(drafts, dtype=np.int64)])
    if start >= n_prompt:
        toks = req.output_token_ids[start - n_prompt:end - n_prompt]
    elif end <= n_prompt:
        toks = req.prompt_token_ids[start:end]
    else:
        toks = req.prompt_token_ids[start:] + req.output_token_ids[: end - n_prompt]
    return np.asarray(toks, dtype=np.int64)
