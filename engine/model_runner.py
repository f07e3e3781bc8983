"""The model runner: one scheduler output in, sampled tokens out.

CPU → device flow of one step:
  1. host: for each scheduled sequence, the slice of its tokens to compute this step
     (``num_computed_tokens .. +num_new_tokens``), their positions and cache slots, and its
     block table — built with numpy, then copied to the device once (with attention sinks a
     position is the token's position in the compacted cache: ``ScheduledSeq.num_evicted_tokens``
     less than its text position; ``shift_keys`` re-rotates the keys that moved first);
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
from sluice.engine.models.rope import rotate_keys, sink_rotation
from sluice.engine.outputs import RunnerOutput, TokenLogprob
from sluice.engine.row_batch import RowBatch
from sluice.engine.sampler import GeneratorCache, Sampler, SampleRow, SamplingBatch
from sluice.engine.spec_decode.rows import rows_of
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
        attention_sinks: int = 0,
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
        # Each running request's slot: tokens, block table, sampling parameters and penalty tally
        # kept across steps, updated from the scheduler's diff.
        self.rows = RowBatch(vocab_size)
        # engine.structured's manager (owned by the engine core): fills the grammar bitmask rows.
        self.grammar = grammar
        # Speculative decoding's runner contract (spec_decode.runner_hooks): verification, the
        # draft distributions handed over for it, and the hidden states a proposer reads.
        # build_spec_decoder replaces it with the decoder's; off, it captures nothing.
        self.spec = SpecRunnerHooks()
        # Attention sinks (tokens; kv_cache.block_manager): the keys after them are re-rotated
        # when blocks are dropped (shift_keys), with the model's RoPE frequencies.
        self.attention_sinks = attention_sinks
        self._key_inv_freq = sink_rotation(model).to(device) if attention_sinks else None
        self._move_slots = None          # CPU with the C++ kernels built: their move_slots (move_kv)
        if device.type == "cpu":
            from sluice.kernels import cpu_ext

            if cpu_ext.available():
                self._move_slots = cpu_ext.module().move_slots

    def execute(self, out) -> RunnerOutput:
        """Run one ``SchedulerOutput``; returns the tokens sampled for sequences that caught up."""
        for request_id in out.finished_ids:
            self.generators.drop(request_id)
            self.rows.drop(request_id)
            self.spec.drop(request_id)
        for request_id in out.preempted_ids:
            self.rows.release(request_id)
        self.spec.begin_step()
        if not out.scheduled:
            return RunnerOutput()
        self.shift_keys(out.scheduled)
        batch = self.prepare(out.scheduled, self.rows)
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
        per sequence, K + 1 for a sequence with K drafts (``spec_decode.rows``). One sampling
        batch holds every row; the shared stages (penalties, bias, min_tokens and grammar masks)
        run once over all of them, then the last stage: a draw for the rows without drafts,
        verification for the rest."""
        plan = sample_plan(scheduled)
        if not plan.seqs:
            return RunnerOutput()
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden[batch.sample_rows])  # [num_rows, vocab]
            res = RunnerOutput()
            rows, slots = [], []
            for (req, drafts), parents in zip(plan.seqs, plan.parents):
                seq_rows = rows_of(req, drafts, parents)
                rows.extend(seq_rows)
                slots.extend([self.rows.slot(req.request_id)] * len(seq_rows))
            sb = self.sampling_batch(rows, plan.seqs, slots)
            penalised = self.sampler.penalize(logits, sb)                  # [num_rows, vocab]
            if plan.plain:
                reqs = [plan.seqs[i][0] for i in plan.plain]
                if plan.drafted:
                    first = [plan.first_row[i] for i in plan.plain]
                    so = self.sampler.draw(penalised[torch.tensor(first, device=self.device)], sb.select(first))
                else:
                    so = self.sampler.draw(penalised, sb)
                self._to_output(reqs, so, res)
            if plan.drafted:
                self.spec.verify(plan, penalised, sb, res, batch.tree_slots, self.generators,
                                 self.sampler.backend == "triton", self.move_kv)
        return res

    def sampling_batch(self, rows: list[SampleRow], grammar_rows, slots=None) -> SamplingBatch:
        """The sampling batch of logit rows, with the grammar bitmask of ``grammar_rows``
        ((request, drafts) pairs) and the tallies kept across steps; ``slots``: each row's slot
        in ``self.rows``, whose parameters it then reads."""
        params = None if slots is None else self.rows.params(slots)
        return SamplingBatch.from_rows(rows, self.vocab_size, self.device, self.generators,
                                       self._bitmask(grammar_rows), self.rows.tallies, params)

    def shift_keys(self, scheduled) -> None:
        """Attention sinks: after a request's allocation dropped blocks after its sinks, the keys
        it keeps after the sinks sit that many cache positions earlier; re-rotated here, every
        layer, before the forward reads them (``models.rope.rotate_keys``; values carry no
        position). Whole blocks are rotated: the unwritten tail of the last one is written by this
        step's store before anything reads it. A no-op without sinks."""
        by_shift: dict[int, list[int]] = {}
        bs = self.block_size
        for s in scheduled:
            if not getattr(s, "num_shifted_tokens", 0):
                continue
            # The blocks holding cache positions sinks .. (computed tokens kept) - 1.
            kept = s.num_computed_tokens - s.num_evicted_tokens
            by_shift.setdefault(s.num_shifted_tokens, []).extend(
                s.block_ids[self.attention_sinks // bs:-(-kept // bs)])
        for shift, blocks in by_shift.items():
            index = torch.tensor(blocks, dtype=torch.long, device=self.device)
            for k_cache, _v_cache in self.kv_caches:                        # [num_blocks, bs, H, D]
                k_cache.index_copy_(0, index, rotate_keys(k_cache.index_select(0, index), -shift,
                                                          self._key_inv_freq))

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

    def prepare(self, scheduled, rows: RowBatch | None = None) -> BatchInputs:
        """The step's input tensors. ``rows``: the slots kept across steps (``execute`` passes the
        runner's): the ids and block tables are gathered from them; without, each sequence's
        tokens and table are read afresh (the draft and training runners, whose sequences are
        views made for one call)."""
        bs, n = self.block_size, len(scheduled)
        text_starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, n)
        q_lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, n)
        # Attention sinks: a token runs at its position in the cache, its text position less the
        # tokens dropped after the sinks (kv_cache.block_manager); without, the two are one.
        # (The draft and training runners' sequence views have no such field: never any drop.)
        evicted = np.fromiter((getattr(s, "num_evicted_tokens", 0) for s in scheduled), np.int64, n)
        starts = text_starts - evicted if evicted.any() else text_starts
        ends = starts + q_lens
        if rows is not None:
            seq_slots = rows.sync(scheduled)
            tables = rows.tables[seq_slots, :max(len(s.block_ids) for s in scheduled)]   # a copy, [n, W]
        else:
            tables = np.zeros((n, max(len(s.block_ids) for s in scheduled)), dtype=np.int32)
            for i, s in enumerate(scheduled):
                tables[i, :len(s.block_ids)] = s.block_ids
        single = bool((q_lens == 1).all())
        if single:    # decode only: one token per sequence
            first = np.arange(n, dtype=np.int64)
            seq_of = first
            positions = starts
        else:
            first = np.cumsum(q_lens) - q_lens                      # each sequence's first row
            seq_of = np.repeat(np.arange(n), q_lens)                 # [num_tokens] row -> sequence
            positions = np.arange(int(q_lens.sum()), dtype=np.int64) + np.repeat(starts - first, q_lens)
        slots = tables[seq_of, positions // bs].astype(np.int64) * bs + positions % bs
        if rows is not None:
            text_positions = positions + evicted[seq_of] if starts is not text_starts else positions
            ids = rows.tokens[seq_slots[seq_of], text_positions].astype(np.int64)
        elif single:
            ids = np.fromiter((_token_at(s.request, s.num_computed_tokens) for s in scheduled), np.int64, n)
        else:
            ids = np.concatenate([_token_slice(s.request, int(a), int(a + q))
                                  for s, a, q in zip(scheduled, text_starts, q_lens)])
        trees = StepTrees()
        sample_rows = []
        for i, s in enumerate(scheduled):
            if not single and s.num_new_tokens > 1:   # a draft tree's nodes get their positions here
                lo, hi = int(first[i]), int(first[i] + q_lens[i])
                trees.add(s.request, i, lo, positions[lo:hi], slots[lo:hi])
            if s.sample:   # the last known token's row, then one per draft
                end = int(first[i] + q_lens[i])
                sample_rows.extend(range(end - 1 - _num_drafts(s), end))
        dev = self.device
        positions_t = torch.from_numpy(positions)
        if single:
            qsl = torch.arange(n + 1, dtype=torch.int32)
        else:
            qsl = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(q_lens, out=qsl[1:])
            qsl = torch.from_numpy(qsl)
        q_list, end_list = q_lens.tolist(), ends.tolist()
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=qsl.to(dev),
            seq_lens=torch.from_numpy(ends.astype(np.int32)).to(dev),
            context_lens=torch.from_numpy(starts.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            block_size=bs,
            max_query_len=max(q_list),
            max_seq_len=max(end_list),
            query_lens_cpu=tuple(q_list),
            seq_lens_cpu=tuple(end_list),
            tree=trees.rows(positions_t, dev),
        )
        return BatchInputs(
            input_ids=torch.from_numpy(ids).to(dev),
            positions=positions_t.to(dev),
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
