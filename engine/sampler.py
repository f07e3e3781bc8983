"""Token sampling in torch: penalties, logit bias, temperature, top-k / top-p / min-p, seeded draws.

CPU → device flow of one step:
  1. host: ``SamplingBatch.from_rows`` takes the logit rows (a ``SampleRow``: the request and
     the draft tokens before the row's position; a request without drafts is one row,
     ``from_requests``) and their fixed parameters as arrays (``RowParams``: gathered from the
     runner's row batch, ``engine.row_batch``, or read off the requests) and builds one device
     tensor per stage. A stage that no row needs stays ``None`` and is skipped, so an all-greedy
     batch without penalties is a single ``argmax``. Penalties read each row's distinct tokens
     (``engine.penalty_rows``), which the runner keeps across steps.
  2. device: ``Sampler(backend, device)(logits, batch)`` — ``penalize`` (penalties, logit bias,
     the min_tokens and grammar masks: the stages a verified row shares), then ``draw``: (for
     logprobs) a ``log_softmax`` of those processed logits, temperature, the top-k / top-p /
     min-p filters, and the draw. Speculative verification takes ``penalize``'s output in
     place of ``draw`` (``spec_decode.verify``). On the triton backend nothing in it waits on the host;
     the torch draw reads each row's count of kept tokens back once.
  3. host: the caller copies ``SamplerOutput`` back once.

Two backends compute the same thing. ``torch`` (the reference; runs anywhere) masks the logits
stage by stage and draws as below. ``triton`` (the CUDA default) applies penalties and bias
with ``kernels.penalties`` and draws with ``kernels.sampling``, whose top-k → top-p → min-p
order is the same as the masks here; greedy rows and logprobs are computed as in ``torch``.

The torch draw (``draw_rows``, which speculative drafts use too) takes one of two exact routes per
row, chosen by that row alone. A row that truncation left with at most 1/8 of the vocabulary runs
an exponential race over the tokens it kept: with ``q ~ Exp(1)`` i.i.d. per kept token,
``argmax(probs / q)`` picks token ``i`` with probability ``probs[i]`` (the minimum of ``q_i / p_i``
is token ``i`` with probability ``p_i``). A wider row inverts its float64 cumulative distribution
at one uniform draw. A full-vocabulary race cost ~50k exponentials per row and step, which was most
of a 32-row CPU step. Each seeded request draws from its own ``torch.Generator``, and how many
numbers it draws depends only on its own row, so a seed reproduces its tokens in any batch.
Unseeded rows share one generator seeded from the engine seed, so whole runs are reproducible too;
they draw together, one batched race and one batched inversion per step.

The triton draw keeps no generator state: a seeded row keys Philox with its seed and counts
steps with its number of output tokens, so the same seed, prompt and parameters give the same
tokens in any batch (and after a preemption). Unseeded rows get fresh keys drawn each step from
the shared generator.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np
import torch

from sluice.engine import envs
from sluice.engine.devices import triton_unavailable_reason
from sluice.engine.outputs import TokenLogprob
from sluice.engine.penalty_rows import PenaltyRows, penalty_tensors
from sluice.engine.request import Request
from sluice.engine.structured.bitmask import apply_bitmask

_NEG_INF = float("-inf")
SAMPLER_BACKENDS = ("auto", "torch", "triton")


# ---- generators ---------------------------------------------------------------------------------
class GeneratorCache:
    """Per-request ``torch.Generator``s, kept by the runner across steps.

    A request with a seed gets its own generator on first use (seeded with ``request.seed``, or
    ``sampling_params.seed`` when the request carries none); ``drop`` forgets it when the request
    finishes. Requests without a seed share one generator seeded with the engine seed.
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed: must be an integer, got {seed!r}")
        self.device = torch.device(device)
        self.shared = torch.Generator(device=self.device)
        self.shared.manual_seed(seed)
        self._by_request: dict[str, torch.Generator] = {}

    def get(self, request: Request) -> torch.Generator:
        seed = request_seed(request)
        if seed is None:
            return self.shared
        gen = self._by_request.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            # manual_seed wants a non-negative 64-bit value; fold negative seeds into that range.
            gen.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
            self._by_request[request.request_id] = gen
        return gen

    def drop(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_request

    def __len__(self) -> int:
        return len(self._by_request)


def request_seed(request: Request) -> int | None:
    return request.seed if request.seed is not None else request.sampling_params.seed


@dataclass(frozen=True)
class SampleRow:
    """One logit row: its request, and the draft tokens before the row's position (none for a
    request's only row; ``spec_decode.rows`` gives a request with K drafts K + 1 rows). Every
    stage reads the row's history as the request's tokens followed by ``drafts``: penalties
    count them, ``min_tokens`` counts them as output, a seeded draw keys on the position."""
    request: Request
    drafts: tuple[int, ...] = ()

    @property
    def num_output_tokens(self) -> int:
        """Output tokens before the row's position: the request's, then its drafts."""
        return self.request.num_output_tokens + len(self.drafts)


# ---- the batch ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling tensors for one step. ``None`` means no row needs that stage."""
    vocab_size: int
    greedy: torch.Tensor                        # [B] bool: temperature 0 or top_k 1
    all_greedy: bool
    temperature: torch.Tensor | None            # [B] float32; 1.0 on greedy rows
    top_k: torch.Tensor | None                  # [B] int64; 0 = off
    max_top_k: int                              # largest enabled top_k (0 when none)
    top_p: torch.Tensor | None                  # [B] float32; 1.0 = off
    min_p: torch.Tensor | None                  # [B] float32; 0.0 = off
    presence_penalty: torch.Tensor | None       # [B] float32
    frequency_penalty: torch.Tensor | None      # [B] float32
    repetition_penalty: torch.Tensor | None     # [B] float32; 1.0 = off
    # The tokens each row holds (engine.penalty_rows), set when any row has a penalty:
    penalty_ids: torch.Tensor | None            # [B, U] int64: distinct tokens (padded by repeats)
    penalty_counts: torch.Tensor | None         # [B, U] float32: occurrences in the row's output
    penalty_seen: torch.Tensor | None           # [B, U] bool: in the prompt (repetition rows) or output
    bias_ids: torch.Tensor | None               # [B, max_bias] int32; padding (0, +0.0) is a no-op
    bias_values: torch.Tensor | None            # [B, max_bias] float32
    forbidden: torch.Tensor | None              # [B, V] bool: EOS/stop ids before min_tokens
    seeded_rows: tuple[tuple[int, torch.Generator], ...]  # random rows with their own generator
    unseeded_rows: torch.Tensor | None          # [U] int64: random rows drawing from `shared`
    shared_generator: torch.Generator | None
    philox_seeds: torch.Tensor | None           # [B] int64: seeded rows' seed, else 0 (triton draw)
    philox_offsets: torch.Tensor | None         # [B] int64: each row's number of output tokens
    num_logprobs: tuple[int | None, ...]        # per row: None, or k top alternatives wanted
    max_num_logprobs: int | None                # None: no row wants logprobs
    # [B, ceil(V / 32)] int32 from engine.structured; all ones on unconstrained rows.
    grammar_bitmask: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.num_logprobs)

    @property
    def changes_logits(self) -> bool:
        """Whether ``penalize`` changes any logit of this batch (a penalty, bias, min_tokens mask or
        grammar); when not, callers may skip it, or work on a subset of the vocabulary."""
        return not (self.penalty_ids is None and self.bias_ids is None and self.forbidden is None
                    and self.grammar_bitmask is None)

    @property
    def output_counts(self) -> torch.Tensor | None:
        """[B, V] int32: occurrences in each row's output (the triton kernel's dense input)."""
        if self.penalty_ids is None:
            return None
        dense = torch.zeros(self.batch_size, self.vocab_size, dtype=torch.int32, device=self.penalty_ids.device)
        return dense.scatter_(1, self.penalty_ids, self.penalty_counts.to(torch.int32))

    @property
    def seen_mask(self) -> torch.Tensor | None:
        """[B, V] bool: token in the prompt or the output, when a row has a repetition penalty."""
        if self.repetition_penalty is None:
            return None
        dense = torch.zeros(self.batch_size, self.vocab_size, dtype=torch.bool, device=self.penalty_ids.device)
        return dense.scatter_(1, self.penalty_ids, self.penalty_seen)

    @classmethod
    def from_requests(
        cls,
        requests: list[Request],
        vocab_size: int,
        device: torch.device | str,
        generators: GeneratorCache | None = None,
        grammar_bitmask: torch.Tensor | None = None,
        penalty_rows: PenaltyRows | None = None,
    ) -> SamplingBatch:
        """The batch of requests without drafts, one row each."""
        return cls.from_rows([SampleRow(r) for r in requests], vocab_size, device, generators,
                             grammar_bitmask, penalty_rows)

    @classmethod
    def from_rows(
        cls,
        rows: list[SampleRow],
        vocab_size: int,
        device: torch.device | str,
        generators: GeneratorCache | None = None,
        grammar_bitmask: torch.Tensor | None = None,
        penalty_rows: PenaltyRows | None = None,
        params: RowParams | None = None,
    ) -> SamplingBatch:
        """``params``: the rows' parameters as kept across steps (``engine.row_batch``); without
        them they are read off the rows' requests."""
        if not rows:
            raise ValueError("requests: a sampling batch needs at least one request")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size: must be a positive integer, got {vocab_size!r}")
        device = torch.device(device)
        if params is None:
            params = RowParams.of([r.request for r in rows], vocab_size)
        random_rows = np.flatnonzero(~params.greedy).tolist()
        if random_rows and generators is None:
            raise ValueError("generators: a GeneratorCache is needed when a request samples at random")
        lp = params.num_logprobs
        wanted = [k for k in lp if k is not None]
        seeded, unseeded, shared = _generator_rows(rows, random_rows, generators, device)
        bias_ids, bias_values = (_logit_bias([r.request.sampling_params for r in rows], device)
                                 if params.any_bias else (None, None))
        return cls(
            vocab_size=vocab_size,
            greedy=torch.from_numpy(params.greedy).to(device),
            all_greedy=not random_rows,
            **_random_row_tensors(params, bool(random_rows), device),
            **_penalty_tensors(rows, params, vocab_size, device, penalty_rows),
            bias_ids=bias_ids,
            bias_values=bias_values,
            forbidden=_forbidden(rows, params, vocab_size, device),
            seeded_rows=seeded,
            unseeded_rows=unseeded,
            shared_generator=shared,
            **_philox_rows(rows, params, bool(random_rows), device),
            num_logprobs=lp,
            max_num_logprobs=max(wanted) if wanted else None,
            grammar_bitmask=grammar_bitmask,
        )

    def select(self, rows: list[int]) -> SamplingBatch:
        """The batch of rows ``rows`` (indices into this one, in that order): what the last stage
        (a draw, or verification) of a subset reads after the shared stages ran on the whole."""
        if rows == list(range(self.batch_size)):
            return self
        pos = {r: i for i, r in enumerate(rows)}
        dev = self.greedy.device
        index = torch.tensor(rows, dtype=torch.int64, device=dev)
        pick = lambda t: None if t is None else t.index_select(0, index)
        greedy = pick(self.greedy)
        seeded = tuple((pos[r], g) for r, g in self.seeded_rows if r in pos)
        unseeded = [] if self.unseeded_rows is None else [pos[r] for r in self.unseeded_rows.tolist() if r in pos]
        top_k = pick(self.top_k)
        lp = tuple(self.num_logprobs[r] for r in rows)
        wanted = [k for k in lp if k is not None]
        return SamplingBatch(
            vocab_size=self.vocab_size, greedy=greedy, all_greedy=not (seeded or unseeded),
            temperature=pick(self.temperature), top_k=top_k,
            max_top_k=self.max_top_k if top_k is not None else 0,
            top_p=pick(self.top_p), min_p=pick(self.min_p),
            presence_penalty=pick(self.presence_penalty), frequency_penalty=pick(self.frequency_penalty),
            repetition_penalty=pick(self.repetition_penalty), penalty_ids=pick(self.penalty_ids),
            penalty_counts=pick(self.penalty_counts), penalty_seen=pick(self.penalty_seen),
            bias_ids=pick(self.bias_ids), bias_values=pick(self.bias_values), forbidden=pick(self.forbidden),
            seeded_rows=seeded,
            unseeded_rows=torch.tensor(unseeded, dtype=torch.int64, device=dev) if unseeded else None,
            shared_generator=self.shared_generator if unseeded else None,
            philox_seeds=pick(self.philox_seeds), philox_offsets=pick(self.philox_offsets),
            num_logprobs=lp, max_num_logprobs=max(wanted) if wanted else None,
            grammar_bitmask=pick(self.grammar_bitmask),
        )


@dataclass(frozen=True)
class RowParams:
    """The parameters of a batch's rows that stay fixed while their request runs, as arrays
    ([B] each): what ``SamplingBatch.from_rows`` turns into tensors. ``engine.row_batch`` keeps one
    entry per running request across steps and gathers a step's rows from it; ``of`` reads them
    off the requests. Greedy rows hold neutral values (temperature 1, filters off)."""
    greedy: np.ndarray                 # bool
    temperature: np.ndarray            # float32
    top_k: np.ndarray                  # int64; 0 = off (and for k >= V)
    top_p: np.ndarray                  # float32; 1 = off
    min_p: np.ndarray                  # float32; 0 = off
    presence: np.ndarray               # float32
    frequency: np.ndarray              # float32
    repetition: np.ndarray             # float32; 1 = off
    seed: np.ndarray                   # int64: the request's seed folded into int64, 0 without one
    min_tokens: np.ndarray             # int64
    num_logprobs: tuple[int | None, ...]
    any_bias: bool

    FIELDS = ("greedy", "temperature", "top_k", "top_p", "min_p", "presence", "frequency", "repetition",
              "seed", "min_tokens")
    DTYPES = (np.bool_, np.float32, np.int64, np.float32, np.float32, np.float32, np.float32, np.float32,
              np.int64, np.int64)

    @staticmethod
    def entry(request: Request, vocab_size: int) -> tuple:
        """One row's values in ``FIELDS`` order, then its logprobs and whether it has a logit bias;
        checks the request's token ids against the vocabulary."""
        sp = request.sampling_params
        sp.check_vocab(vocab_size)
        greedy = sp.greedy
        seed = request_seed(request)
        return (greedy,
                1.0 if greedy else sp.temperature,
                sp.top_k if not greedy and 0 < sp.top_k < vocab_size else 0,
                1.0 if greedy else sp.top_p,
                0.0 if greedy else sp.min_p,
                sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty,
                # Fold any Python int into the signed 64-bit range that an int64 tensor holds.
                0 if seed is None else ((seed + (1 << 63)) % (1 << 64)) - (1 << 63),
                sp.min_tokens,
                sp.logprobs, bool(sp.logit_bias))

    @classmethod
    def of(cls, requests: list[Request], vocab_size: int) -> RowParams:
        entries = [cls.entry(r, vocab_size) for r in requests]
        cols = list(zip(*entries))
        arrays = {f: np.array(c, dtype=t) for f, c, t in zip(cls.FIELDS, cols, cls.DTYPES)}
        return cls(**arrays, num_logprobs=cols[-2], any_bias=any(cols[-1]))


def _random_row_tensors(params: RowParams, any_random: bool, device) -> dict:
    """Temperature and the three masks; greedy rows hold neutral values (they take the argmax)."""
    out = {"temperature": None, "top_k": None, "max_top_k": 0, "top_p": None, "min_p": None}
    if not any_random:
        return out
    out["temperature"] = torch.from_numpy(params.temperature).to(device)
    if params.top_k.any():
        out["top_k"] = torch.from_numpy(params.top_k).to(device)
        out["max_top_k"] = int(params.top_k.max())
    if (params.top_p < 1.0).any():
        out["top_p"] = torch.from_numpy(params.top_p).to(device)
    if (params.min_p > 0.0).any():
        out["min_p"] = torch.from_numpy(params.min_p).to(device)
    return out


def _penalty_tensors(rows: list[SampleRow], params: RowParams, vocab_size: int, device,
                     state: PenaltyRows | None) -> dict:
    """The penalty fields: None where no row needs them; the rows' tokens from ``state`` (kept
    across steps) or, without one, tallied from the requests' token lists."""
    additive = (params.presence != 0.0) | (params.frequency != 0.0)
    repeat = params.repetition != 1.0
    out = dict.fromkeys(("presence_penalty", "frequency_penalty", "repetition_penalty", "penalty_ids",
                         "penalty_counts", "penalty_seen"))
    any_additive, any_repeat = bool(additive.any()), bool(repeat.any())
    if not any_additive and not any_repeat:
        return out
    # Only rows that need penalties hold tokens; the prompt only for a repetition penalty.
    ids, counts, seen = penalty_tensors(rows, (additive | repeat).tolist(), repeat.tolist(), vocab_size,
                                        device, state)
    out.update(penalty_ids=ids, penalty_counts=counts, penalty_seen=seen)
    if any_additive:
        out["presence_penalty"] = torch.from_numpy(params.presence).to(device)
        out["frequency_penalty"] = torch.from_numpy(params.frequency).to(device)
    if any_repeat:
        out["repetition_penalty"] = torch.from_numpy(params.repetition).to(device)
    return out


def _logit_bias(params, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Padded (ids, values) [B, max_bias] lists, or (None, None) when no row has a bias.

    Padding is token 0 with bias +0.0, which leaves any logit unchanged, so both backends can
    add every entry without a mask (no device sync to drop the padding).
    """
    width = max(len(sp.logit_bias) for sp in params)
    if width == 0:
        return None, None
    ids = [[*sp.logit_bias] + [0] * (width - len(sp.logit_bias)) for sp in params]
    vals = [[float(v) for v in sp.logit_bias.values()] + [0.0] * (width - len(sp.logit_bias)) for sp in params]
    return (torch.tensor(ids, dtype=torch.int32, device=device),
            torch.tensor(vals, dtype=torch.float32, device=device))


def _forbidden(sample_rows: list[SampleRow], params: RowParams, vocab_size: int, device) -> torch.Tensor | None:
    """EOS (unless ignore_eos) and stop token ids, for rows still short of min_tokens."""
    rows, cols = [], []
    for i in np.flatnonzero(params.min_tokens > 0).tolist():
        row = sample_rows[i]
        sp = row.request.sampling_params
        if row.num_output_tokens >= sp.min_tokens:
            continue
        ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(row.request.eos_token_ids))
        for tok in sorted(ids):
            if not 0 <= tok < vocab_size:
                raise ValueError(f"eos_token_ids: token id {tok} is outside the vocabulary (size {vocab_size})")
            rows.append(i)
            cols.append(tok)
    if not rows:
        return None
    mask = torch.zeros(len(sample_rows), vocab_size, dtype=torch.bool, device=device)  # [B, V]
    mask[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = True
    return mask


def _generator_rows(rows: list[SampleRow], random_rows: list[int], generators: GeneratorCache | None, device):
    if not random_rows:
        return (), None, None
    if generators.device.type != device.type:
        raise ValueError(f"generators: cache is on {generators.device}, the batch on {device}")
    seeded, unseeded = [], []
    for i in random_rows:
        gen = generators.get(rows[i].request)
        if gen is generators.shared:
            unseeded.append(i)
        else:
            seeded.append((i, gen))
    index = torch.tensor(unseeded, dtype=torch.int64, device=device) if unseeded else None
    return tuple(seeded), index, generators.shared if unseeded else None


def _philox_rows(rows: list[SampleRow], params: RowParams, any_random: bool, device) -> dict:
    """Per-row Philox key and step counter for the triton draw; None when every row is greedy."""
    if not any_random:
        return {"philox_seeds": None, "philox_offsets": None}
    return {
        "philox_seeds": torch.from_numpy(params.seed).to(device),
        "philox_offsets": torch.tensor([r.num_output_tokens for r in rows], dtype=torch.int64, device=device),
    }


# ---- mask functions -----------------------------------------------------------------------------
def apply_top_k(logits: torch.Tensor, k: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """Keep each row's ``k`` largest logits; tokens tied with the k-th value are all kept.

    logits: [B, V]; k: [B] int64, where ``k <= 0`` or ``k >= V`` leaves the row unchanged.
    ``max_k`` (the largest enabled k, known on the host) avoids a device sync; it must not be
    smaller than any enabled row's k.
    """
    vocab = logits.shape[-1]
    off = (k <= 0) | (k >= vocab)                                    # [B]
    if max_k is None:
        max_k = int(torch.where(off, 0, k).max())
    if max_k <= 0:
        return logits
    top = logits.topk(min(max_k, vocab), dim=-1).values              # [B, max_k], descending
    kth = top.gather(-1, (k.clamp(1, max_k) - 1).unsqueeze(-1))      # [B, 1]
    kth = kth.masked_fill(off.unsqueeze(-1), _NEG_INF)
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass is >= ``p``.

    logits: [B, V]; p: [B] in (0, 1], where 1 leaves the row unchanged. The most likely token is
    always kept; tokens tied with the least likely kept one are kept too, so the result does
    not depend on how a sort orders ties.

    Only the ``TOP_P_CANDIDATES`` most likely tokens are sorted (``topk``); a row whose nucleus
    may reach past them is sorted in full. The kept set is the same either way: the candidates
    are the full sort's first values, and the running mass only grows after them. On CPU a full
    sort of 32 rows of 49k tokens takes ~10x as long as their ``topk`` of 256.
    """
    probs = logits.softmax(dim=-1)                                   # [B, V]
    vocab = probs.shape[-1]
    n = min(TOP_P_CANDIDATES, vocab)
    threshold, n_keep = _nucleus_threshold(probs.topk(n, dim=-1).values, p)   # [B, 1] each
    wider = ((n_keep == n) & (p.unsqueeze(-1) < 1.0)).squeeze(-1).nonzero().squeeze(-1)
    if n < vocab and wider.numel():
        full = probs.index_select(0, wider).sort(dim=-1, descending=True).values
        threshold[wider] = _nucleus_threshold(full, p[wider])[0]
    threshold = threshold.masked_fill(p.unsqueeze(-1) >= 1.0, 0.0)
    return logits.masked_fill(probs < threshold, _NEG_INF)


TOP_P_CANDIDATES = 256


def _nucleus_threshold(sorted_probs: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From each row's most likely probabilities in descending order [B, n]: (the least kept
    probability [B, 1], how many are kept [B, 1]); n kept means the nucleus may go on past them."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs         # [B, n], exclusive prefix sum
    n_keep = (mass_before < p.unsqueeze(-1)).sum(dim=-1, keepdim=True).clamp(min=1)  # [B, 1]
    return sorted_probs.gather(-1, n_keep - 1), n_keep


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's top probability.

    logits: [B, V]; min_p: [B] in [0, 1], where 0 leaves the row unchanged. Done in logit space:
    ``p_i >= m * p_max``  <=>  ``logit_i >= logit_max + log(m)`` (log 0 = -inf keeps everything).
    """
    top = logits.max(dim=-1, keepdim=True).values                    # [B, 1]
    threshold = top + torch.log(min_p).unsqueeze(-1)                 # [B, 1]
    return logits.masked_fill(logits < threshold, _NEG_INF)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF semantics on tokens in prompt or output: positive logits divided, negative multiplied.

    logits: [B, N]; seen: [B, N] bool; penalty: [B] > 0 (N: the vocabulary, or the tokens held).
    """
    r = penalty.unsqueeze(-1)                                        # [B, 1]
    penalised = torch.where(logits > 0, logits / r, logits * r)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI semantics on output tokens: ``logit - frequency * count - presence * (count > 0)``.

    logits, counts: [B, N] (the vocabulary, or the tokens held); presence, frequency: [B].
    """
    return logits - frequency.unsqueeze(-1) * counts - presence.unsqueeze(-1) * (counts > 0).to(logits.dtype)


# ---- the sampler --------------------------------------------------------------------------------
_argmax_rows = None      # kernels/cpu_ops.cpp's argmax_rows once looked up (False: not built)


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [B] (its first maximum; a NaN's index where the row has one). On the CPU
    the C++ kernels' pass, several times faster than torch's argmax over rows of a vocabulary
    (5 rows of 49k: ~15 against 130 us); without them max(), which finds the same index in 2/3 of
    argmax's time."""
    global _argmax_rows
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    if _argmax_rows is None:
        from sluice.kernels import cpu_ext

        _argmax_rows = cpu_ext.module().argmax_rows if cpu_ext.available() else False
    if _argmax_rows and logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1]:
        return _argmax_rows(logits.contiguous())
    return logits.max(dim=-1).indices


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor                # [B] int64
    logprobs: torch.Tensor | None          # [B] float32: logprob of each sampled token
    top_ids: torch.Tensor | None           # [B, k] int64, most likely first; k = largest request
    top_logprobs: torch.Tensor | None      # [B, k] float32

    def to_token_logprobs(self, batch: SamplingBatch) -> list[TokenLogprob | None]:
        """Host view (one copy back): per row its TokenLogprob, or None where none was asked."""
        if self.logprobs is None:
            return [None] * batch.batch_size
        ids, lps = self.token_ids.tolist(), self.logprobs.tolist()
        top_ids, top_lps = self.top_ids.tolist(), self.top_logprobs.tolist()
        out: list[TokenLogprob | None] = []
        for i, k in enumerate(batch.num_logprobs):
            top = () if k is None else tuple(zip(top_ids[i][:k], top_lps[i][:k]))
            out.append(None if k is None else TokenLogprob(ids[i], lps[i], top))
        return out


def penalize(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty, presence/frequency penalties, logit bias, the min_tokens mask, then
    the grammar mask.

    logits: [B, V] float32. Returns a new tensor; the caller's is left alone.
    """
    _check_logits(logits, batch)
    if batch.penalty_ids is not None:
        # Only the tokens a row holds change: gather them, penalise, scatter back (a row's
        # padding repeats one of its entries, so every logit is written once with one value).
        held = logits.gather(-1, batch.penalty_ids)                                 # [B, U]
        if batch.repetition_penalty is not None:
            held = apply_repetition_penalty(held, batch.penalty_seen, batch.repetition_penalty)
        if batch.presence_penalty is not None:
            held = apply_presence_frequency(held, batch.penalty_counts, batch.presence_penalty,
                                            batch.frequency_penalty)
        logits = logits.scatter(-1, batch.penalty_ids, held)
    if batch.bias_ids is not None:
        logits = logits.scatter_add(-1, batch.bias_ids.long(), batch.bias_values)
    if batch.forbidden is not None:
        logits = logits.masked_fill(batch.forbidden, _NEG_INF)
    if batch.grammar_bitmask is not None:
        logits = apply_bitmask(logits, batch.grammar_bitmask)
    return logits


def _check_logits(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if logits.dim() != 2 or logits.shape != (batch.batch_size, batch.vocab_size):
        raise ValueError(f"logits: expected shape ({batch.batch_size}, {batch.vocab_size}), "
                         f"got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits: expected a floating-point tensor, got {logits.dtype}")


def _truncate(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature then the top-k, top-p and min-p masks; logits [B, V] already penalised."""
    logits = logits / batch.temperature.unsqueeze(-1)
    if batch.top_k is not None:
        logits = apply_top_k(logits, batch.top_k, batch.max_top_k)
    if batch.top_p is not None:
        logits = apply_top_p(logits, batch.top_p)
    if batch.min_p is not None:
        logits = apply_min_p(logits, batch.min_p)
    return logits


def draw_rows(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B] int64: a token drawn from each random row's ``probs``; greedy rows' entries are left
    for the caller to replace.

    A row whose truncation (top-k, top-p, min-p) left at most 1/8 of the vocabulary races only
    the tokens it kept: argmax(p / q), q ~ Exp(1), one q per kept token. A wider row inverts its
    cumulative distribution (float64) at one uniform draw: a 49k-token row costs one cumulative
    sum instead of 49k exponentials, which were most of a 32-row CPU step. Either way a
    zero-probability token is never drawn.

    A seeded row draws from its own generator, one row at a time (its race's exponentials in
    vocabulary order), and which path it takes depends on that row alone, so it draws the same
    tokens alone and in any batch.
    The unseeded rows share one generator and promise no such thing: they draw together, one
    batched race and one batched inversion per step instead of a dozen small ops per row.
    """
    vocab = probs.shape[-1]
    out = torch.zeros(probs.shape[0], dtype=torch.int64, device=probs.device)
    seeded = sorted(batch.seeded_rows, key=lambda r: r[0])
    unseeded = [] if batch.unseeded_rows is None else batch.unseeded_rows.tolist()
    if not seeded and not unseeded:
        return out
    kept = (probs > 0).sum(dim=-1).tolist()                          # [B] on the host, one sync
    narrow = sorted(row for row, _ in seeded if kept[row] * 8 <= vocab)
    kept_ids: dict[int, torch.Tensor] = {}
    if narrow:
        # Each narrow row's nonzero tokens are its kept[row] most likely whatever the order of
        # ties among them, sorted back into vocabulary order (topk is much faster than nonzero).
        top = probs.topk(max(kept[row] for row in narrow), dim=-1).indices
        kept_ids = {row: top[row, :kept[row]].sort().values for row in narrow}
    tiny = torch.finfo(probs.dtype).tiny
    for row, gen in seeded:
        ids = kept_ids.get(row)
        if ids is not None:
            p = probs[row].index_select(0, ids)
            q = torch.empty_like(p).exponential_(generator=gen)
            # Exp(1) can return exactly 0; clamp so that a zero-probability token never wins via 0 / 0.
            out[row] = ids[(p / q.clamp_min(tiny)).argmax()]
            continue
        u = torch.rand((), dtype=torch.float64, device=probs.device, generator=gen)
        out[row] = _invert_cdf(probs[row:row + 1], u.reshape(1))[0]
    if unseeded:
        gen = batch.shared_generator
        narrow = [row for row in unseeded if kept[row] * 8 <= vocab]
        wide = [row for row in unseeded if kept[row] * 8 > vocab]
        if narrow:
            ids = torch.tensor(narrow, device=probs.device)
            # Columns past a row's kept tokens hold p = 0, so they never win the race.
            p, cand = probs.index_select(0, ids).topk(max(kept[row] for row in narrow), dim=-1)
            q = torch.empty_like(p).exponential_(generator=gen)
            out[ids] = cand.gather(1, (p / q.clamp_min(tiny)).argmax(dim=-1, keepdim=True)).squeeze(1)
        if wide:
            u = torch.rand(len(wide), dtype=torch.float64, device=probs.device, generator=gen)
            # A few rows at a time: a float64 cumulative sum of 64k entries (512 KB) stays in
            # cache, where a whole batch's (32 rows of a 49k vocabulary: 12 MB) would not.
            chunk = max(1, (1 << 16) // vocab)
            for i in range(0, len(wide), chunk):
                if chunk == 1:
                    row = wide[i]
                    out[row] = _invert_cdf(probs[row:row + 1], u[i:i + 1])[0]
                    continue
                ids = torch.tensor(wide[i:i + chunk], device=probs.device)
                out[ids] = _invert_cdf(probs.index_select(0, ids), u[i:i + chunk])
    return out


def _invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[R] int64: per row of ``probs`` [R, V], the first token whose cumulative mass (float64)
    exceeds ``u`` [R] times the row's total, so never one of mass 0; where rounding lands
    ``u * total`` on the total itself, the row's last token of nonzero mass."""
    cdf = probs.double().cumsum(-1)
    token = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    vocab = probs.shape[-1]
    past = token >= vocab
    if bool(past.any()):
        last = vocab - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        token = torch.where(past, last, token)
    return token


def processed_probs(logits: torch.Tensor, batch: SamplingBatch, penalised: bool = False) -> torch.Tensor:
    """[B, V] the distribution each row samples from, after every stage; greedy rows one-hot.
    ``penalised``: ``logits`` already went through ``penalize`` (verification's, shared with the
    rows drawn in the same step).

    For speculative decoding's rejection sampler, which compares target and draft probabilities.
    """
    logits = logits if penalised else penalize(logits.float(), batch)
    onehot = torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if batch.all_greedy:
        return onehot
    probs = _truncate(logits, batch).softmax(dim=-1)
    return torch.where(batch.greedy.unsqueeze(-1), onehot, probs)


# ---- the triton path ----------------------------------------------------------------------------
def resolve_sampler_backend(name: str, device: torch.device | str | None) -> str:
    """"torch" or "triton" for ``name`` on ``device``; a forced backend that cannot run raises.

    "auto" is triton on CUDA and torch elsewhere, including when the device is not given (None),
    which keeps a bare ``Sampler()`` the torch reference.
    """
    if name not in SAMPLER_BACKENDS:
        raise ValueError(f"sampler_backend: must be one of {SAMPLER_BACKENDS}, got {name!r}")
    device = torch.device("cpu" if device is None else device)
    reason = triton_unavailable_reason("sampler_backend=triton", device)
    if name == "auto":
        return "triton" if device.type == "cuda" and reason is None else "torch"
    if name == "triton" and reason is not None:
        raise ValueError(reason)
    return name


def _penalize_triton(penalties, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``penalize`` with the penalties kernel; logits [B, V] are copied, never changed."""
    _check_logits(logits, batch)
    out = logits.to(torch.float32, copy=True)                        # [B, V], the kernel's in-place target
    if batch.penalty_ids is not None or batch.bias_ids is not None:
        rows, vocab, dev = batch.batch_size, batch.vocab_size, out.device
        # Absent tables are stride-0 views of one zero row: no [B, V] allocation for them.
        counts, seen = batch.output_counts, batch.seen_mask
        if counts is None:
            counts = torch.zeros(1, vocab, dtype=torch.int32, device=dev).expand(rows, vocab)
        if seen is None:
            seen = torch.zeros(1, vocab, dtype=torch.bool, device=dev).expand(rows, vocab)
        zeros = torch.zeros(rows, dtype=torch.float32, device=dev)
        presence = batch.presence_penalty if batch.presence_penalty is not None else zeros
        frequency = batch.frequency_penalty if batch.frequency_penalty is not None else zeros
        repetition = batch.repetition_penalty if batch.repetition_penalty is not None else zeros + 1.0
        bias_ids = batch.bias_ids if batch.bias_ids is not None else torch.zeros(rows, 0, dtype=torch.int32, device=dev)
        bias_values = batch.bias_values if batch.bias_values is not None else torch.zeros(rows, 0, device=dev)
        # seen_mask (prompt or output) serves as the kernel's prompt mask: it adds the output itself.
        penalties.apply_penalties(out, counts, seen, presence, frequency, repetition, bias_ids, bias_values)
    if batch.forbidden is not None:
        out.masked_fill_(batch.forbidden, _NEG_INF)
    if batch.grammar_bitmask is not None:
        importlib.import_module("sluice.kernels.bitmask").apply_token_bitmask(out, batch.grammar_bitmask)
    return out


def _draw_triton(sampling, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B] int64 from the sampling kernel; greedy rows get temperature 0 (its argmax, no draw)."""
    rows, dev = batch.batch_size, logits.device
    temperature = torch.where(batch.greedy, torch.zeros_like(batch.temperature), batch.temperature)
    top_k = batch.top_k.to(torch.int32) if batch.top_k is not None else torch.zeros(rows, dtype=torch.int32, device=dev)
    top_p = batch.top_p if batch.top_p is not None else torch.ones(rows, dtype=torch.float32, device=dev)
    min_p = batch.min_p if batch.min_p is not None else torch.zeros(rows, dtype=torch.float32, device=dev)
    seeds = batch.philox_seeds
    if batch.unseeded_rows is not None:
        fresh = torch.randint(0, (1 << 63) - 1, (batch.unseeded_rows.numel(),), dtype=torch.int64,
                              device=dev, generator=batch.shared_generator)   # [U]
        seeds = seeds.index_copy(0, batch.unseeded_rows, fresh)
    return sampling.sample(logits, temperature, top_k, top_p, min_p, seeds, batch.philox_offsets)


def _check_triton_device(logits: torch.Tensor) -> None:
    if logits.device.type != "cuda" and not envs.triton_interpret():
        raise ValueError(f"logits: the triton sampler needs them on a CUDA device (or TRITON_INTERPRET=1), "
                         f"got {logits.device}")


class Sampler:
    """Stateless: per-request state (the generators) lives in the caller's ``GeneratorCache``.

    ``backend``: "auto" (triton on a CUDA ``device``, else torch), "torch" or "triton"; a forced
    triton on a device where it cannot run raises ``ValueError`` here, at engine start.
    ``device``: where the logits will live; None keeps "auto" on torch.
    """

    def __init__(self, backend: str = "auto", device: torch.device | str | None = None) -> None:
        self.backend = resolve_sampler_backend(backend, device)
        self._kernels = None
        if self.backend == "triton":   # imported here: CPU-only installs never load triton
            self._kernels = (importlib.import_module("sluice.kernels.penalties"), importlib.import_module("sluice.kernels.sampling"))

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.draw(self.penalize(logits, batch), batch)

    def penalize(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The stages every row goes through, whether it is then drawn from or verified:
        penalties, logit bias, the min_tokens mask and the grammar mask ([B, V] float32, new)."""
        if self._kernels is None:
            return penalize(logits.float(), batch)
        _check_triton_device(logits)
        return _penalize_triton(self._kernels[0], logits, batch)

    def draw(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """The last stage of a plain row: temperature, the filters and the draw (greedy rows take
        the argmax), and logprobs; ``logits`` [B, V] are ``penalize``'s."""
        argmax = greedy_ids(logits)                                  # [B]
        if batch.all_greedy:
            token_ids = argmax
        elif self._kernels is None:
            probs = _truncate(logits, batch).softmax(dim=-1)         # [B, V]
            token_ids = torch.where(batch.greedy, argmax, draw_rows(probs, batch))
        else:
            token_ids = torch.where(batch.greedy, argmax, _draw_triton(self._kernels[1], logits, batch))
        if batch.max_num_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        # OpenAI semantics: logprobs of the processed distribution before temperature.
        logprobs = logits.log_softmax(dim=-1)                        # [B, V]
        sampled = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # [B]
        top = logprobs.topk(batch.max_num_logprobs, dim=-1)          # [B, k], sorted
        return SamplerOutput(token_ids, sampled, top.indices, top.values)
