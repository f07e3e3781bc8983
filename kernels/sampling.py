"""Fused sampling: temperature, top-k, top-p and min-p without sorting the vocabulary.

Semantics (the reference ``sampling_probs_ref`` defines them; they are those of the torch
sampler ``engine.sampler``, i.e. Hugging Face / vLLM order): a row with temperature 0 is greedy
(argmax, the lowest index on ties). Otherwise ``w = softmax(logits / T)`` and the filters apply
one after the other, each on what the previous one kept:
  top-k: keep ``S_k``, the tokens with fewer than ``k`` strictly heavier ones (``k <= 0`` or
         ``k >= V`` disables);
  top-p: on ``w`` renormalised over ``S_k``, keep the tokens whose strictly heavier tokens hold
         less than ``p`` of that mass: ``mass_gt(i) < p * mass(S_k)`` (p = 1 disables). As
         ``S_k`` is an upper set, the heavier tokens of a survivor all lie in ``S_k``;
  min-p: ``w_i >= min_p * max(w)``; the earlier filters always keep the argmax, so the maximum
         is the same before and after them.
The survivors form an upper set of the weights, and the sample is drawn from ``w`` restricted
to them. Ties at a threshold are kept together.

``mass(S_k)`` is needed only when top-k and top-p are both on, and then only for a drawn token
whose top-p verdict its bounds leave open (see ``_survives``). It is found without sorting:
bisection on the fp32 bit pattern of the k-th largest weight (weights are >= 0, so bit order is
value order), one counting pass per step, at most 31 passes and usually fewer (it stops as soon
as exactly ``k`` tokens lie above the bracket's floor).

The kernel draws by rejection instead of sorting: sample a token from ``w`` over the tokens
heavier than a pivot (inverse CDF, one pass), count the tokens heavier than it and their mass
(one pass); accept it if it survives, else raise the pivot to its weight and draw again. Each
candidate set contains the survivors, so the accepted token is distributed exactly as ``w``
restricted to them; the argmax always survives, so the loop ends, typically within a few rounds.

Randomness: Philox keyed by the row's ``seed``; counter ``(offset << 32) + round``, where the
caller advances ``offset`` every step, so a seeded request repeats exactly.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluice.kernels._checks import FLOAT_DTYPES, FP_FUSION, check_shape, check_tensor

# Tuning: one program per row streams the vocabulary in 4096-wide tiles (16 KiB of fp32).
_BLOCK_V = 4096
_NUM_WARPS = 8


@triton.jit
def _sample_kernel(
    logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, offsets_ptr, out_ptr,
    stride_logits_row, vocab_size,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_logits_row
    temp = tl.load(temperature_ptr + row)
    inv_t = 1.0 / tl.where(temp > 0, temp, 1.0)
    cols0 = tl.arange(0, BLOCK_V)

    # Pass 1: running max, argmax and the softmax denominator (online rescaling).
    m = tl.full([], float("-inf"), tl.float32)
    best = tl.full([], 0, tl.int32)
    total = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + cols0
        x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        tile_max = tl.max(x, 0)
        tile_arg = tl.min(tl.where(x == tile_max, cols, vocab_size), 0)
        best = tl.where(tile_max > m, tile_arg, best)
        m_new = tl.maximum(m, tile_max)
        total = total * tl.exp((m - m_new) * inv_t) + tl.sum(tl.exp((x - m_new) * inv_t), 0)
        m = m_new
    if temp <= 0:
        tl.store(out_ptr + row, best.to(tl.int64))
        return

    top_k = tl.load(top_k_ptr + row)
    top_k = tl.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)
    top_p = tl.load(top_p_ptr + row)
    min_w = tl.load(min_p_ptr + row)          # max(w) is 1 in these unnormalised weights
    # Mass of the top-k survivors, which top-p renormalises by; -1 until needed (see _survives).
    mass_k = tl.where(top_k < vocab_size, -1.0, total)
    seed = tl.load(seeds_ptr + row)
    counter = tl.load(offsets_ptr + row).to(tl.int64) << 32

    pivot = tl.full([], -1.0, tl.float32)     # candidates: weights > pivot
    cand_mass = total
    token = best
    searching = tl.full([], 1, tl.int1)
    while searching:
        u = tl.rand(seed, counter)
        counter += 1
        token, w_tok = _draw_above(row_ptr, vocab_size, m, inv_t, pivot, u * cand_mass, best, BLOCK_V)
        count_gt, mass_gt = _mass_above(row_ptr, vocab_size, m, inv_t, w_tok, False, BLOCK_V)
        keep, mass_k = _survives(row_ptr, vocab_size, m, inv_t, top_k, top_p, min_w, total, mass_k,
                                 w_tok, count_gt, mass_gt, BLOCK_V)
        searching = ~keep
        pivot = w_tok
        cand_mass = mass_gt
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _survives(row_ptr, vocab_size, m, inv_t, top_k, top_p, min_w, total, mass_k, w_tok, count_gt, mass_gt,
              BLOCK_V: tl.constexpr):
    """(token passes all three filters, mass_k); mass_k (< 0: not yet known) is found at most once.

    For a token inside the top-k, mass(S_k) lies in [mass_gt + w_tok, total]. Top-p needs it
    exactly only when that interval straddles ``mass_gt / top_p``; most accepted draws sit in
    the head of the distribution and skip the search.
    """
    keep = (count_gt < top_k) & (w_tok >= min_w)
    if keep & (top_p < 1.0):
        if (mass_k < 0) & (mass_gt >= top_p * (mass_gt + w_tok)) & (mass_gt < top_p * total):
            mass_k = _top_k_mass(row_ptr, vocab_size, m, inv_t, top_k, total, BLOCK_V)
        keep = mass_gt < top_p * tl.where(mass_k < 0, mass_gt + w_tok, mass_k)
    return keep, mass_k


@triton.jit
def _draw_above(row_ptr, vocab_size, m, inv_t, pivot, target, fallback, BLOCK_V: tl.constexpr):
    """The first token whose running mass (over weights > pivot) exceeds target, and its weight."""
    cols0 = tl.arange(0, BLOCK_V)
    running = tl.full([], 0.0, tl.float32)
    chosen = tl.full([], 0, tl.int32) + vocab_size
    last = tl.full([], -1, tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + cols0
        x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        w = tl.exp((x - m) * inv_t)
        w = tl.where(w > pivot, w, 0.0)
        c = tl.cumsum(w, 0) + running
        hit = tl.min(tl.where((c > target) & (w > 0), cols, vocab_size), 0)
        chosen = tl.where(chosen == vocab_size, hit, chosen)
        last = tl.maximum(last, tl.max(tl.where(w > 0, cols, -1), 0))
        running += tl.sum(w, 0)
    # Rounding can leave target just above the summed mass: take the last candidate then.
    chosen = tl.where(chosen == vocab_size, last, chosen)
    chosen = tl.where(chosen < 0, fallback, chosen)
    x_tok = tl.load(row_ptr + chosen).to(tl.float32)
    return chosen, tl.exp((x_tok - m) * inv_t)


@triton.jit
def _mass_above(row_ptr, vocab_size, m, inv_t, threshold, INCLUSIVE: tl.constexpr, BLOCK_V: tl.constexpr):
    """How many tokens weigh more than threshold (or as much, when INCLUSIVE), and their weight."""
    cols0 = tl.arange(0, BLOCK_V)
    count = tl.full([], 0, tl.int32)
    mass = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + cols0
        x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        w = tl.exp((x - m) * inv_t)
        if INCLUSIVE:
            above = w >= threshold
        else:
            above = w > threshold
        count += tl.sum(above.to(tl.int32), 0)
        mass += tl.sum(tl.where(above, w, 0.0), 0)
    return count, mass


@triton.jit
def _top_k_mass(row_ptr, vocab_size, m, inv_t, top_k, total, BLOCK_V: tl.constexpr):
    """Weight of {w >= k-th largest w}, for 0 < top_k < vocab_size; no sort.

    Bisects the threshold's fp32 bit pattern. Invariant: count(w >= lo) >= k > count(w >= hi).
    When hi = lo + 1 ulp, lo is the k-th largest weight itself; when exactly k tokens weigh
    >= lo, they are the top-k and no tie lies below them. Padding lanes weigh 0 and are never
    counted (every threshold tried is > 0).
    """
    lo = tl.full([], 0, tl.int32)              # weight 0.0: every token is >= it
    hi = tl.full([], 0x7F800000, tl.int32)     # +inf: no finite weight reaches it
    count_lo = tl.full([], 0, tl.int32) + vocab_size
    mass_lo = total
    while (hi - lo > 1) & (count_lo != top_k):
        mid = lo + (hi - lo) // 2
        count, mass = _mass_above(row_ptr, vocab_size, m, inv_t, mid.to(tl.float32, bitcast=True), True, BLOCK_V)
        enough = count >= top_k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
        count_lo = tl.where(enough, count, count_lo)
        mass_lo = tl.where(enough, mass, mass_lo)
    return mass_lo


def _check(logits, temperature, top_k, top_p, min_p, seeds, offsets) -> None:
    check_tensor("logits", logits, 2, FLOAT_DTYPES)
    if logits.shape[1] == 0:
        raise ValueError("logits: vocabulary dimension is empty")
    if logits.stride(1) != 1:
        raise ValueError(f"logits: last dimension must be contiguous (stride 1), got stride {logits.stride(1)}")
    dev, rows = logits.device, (logits.shape[0],)
    for name, t, dtypes in (
        ("temperature", temperature, (torch.float32,)), ("top_k", top_k, (torch.int32,)),
        ("top_p", top_p, (torch.float32,)), ("min_p", min_p, (torch.float32,)),
        ("seeds", seeds, (torch.int64,)), ("offsets", offsets, (torch.int64,)),
    ):
        check_tensor(name, t, 1, dtypes, dev)
        check_shape(name, t, rows)


def sample(
    logits: torch.Tensor,        # [num_rows, vocab_size] fp32/fp16/bf16
    temperature: torch.Tensor,   # [num_rows] fp32; 0 is greedy
    top_k: torch.Tensor,         # [num_rows] int32; <= 0 disables
    top_p: torch.Tensor,         # [num_rows] fp32 in (0, 1]
    min_p: torch.Tensor,         # [num_rows] fp32 in [0, 1]
    seeds: torch.Tensor,         # [num_rows] int64
    offsets: torch.Tensor,       # [num_rows] int64; advance per step for fresh draws
) -> torch.Tensor:               # [num_rows] int64 token ids
    _check(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0] == 0:
        return out
    block_v = min(_BLOCK_V, triton.next_power_of_2(logits.shape[1]))
    _sample_kernel[(logits.shape[0],)](
        logits, temperature, top_k, top_p, min_p, seeds, offsets, out,
        logits.stride(0), logits.shape[1], BLOCK_V=block_v, num_warps=_NUM_WARPS, **FP_FUSION,
    )
    return out


def sampling_probs_ref(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """The distribution ``sample`` draws from, per row: [num_rows, vocab_size] fp32 (one-hot when greedy)."""
    x = logits.float()
    num_rows, vocab = x.shape
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    w = torch.softmax(x / t[:, None], dim=-1)                         # [num_rows, vocab]
    asc, _ = w.sort(dim=-1)
    cum = asc.cumsum(-1)                                              # [num_rows, vocab]
    n_le = torch.searchsorted(asc, w, right=True)                     # tokens weighing <= w_i
    count_gt = vocab - n_le
    mass_gt = cum[:, -1:] - cum.gather(-1, n_le - 1)                  # weight strictly above w_i
    k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
    keep = count_gt < k[:, None]                                      # S_k, an upper set
    mass_k = torch.where(keep, w, torch.zeros_like(w)).sum(-1, keepdim=True)  # [num_rows, 1]
    keep &= (top_p[:, None] >= 1.0) | (mass_gt < top_p[:, None] * mass_k)
    keep &= w >= min_p[:, None] * w.max(-1, keepdim=True).values
    probs = torch.where(keep, w, torch.zeros_like(w))
    probs = probs / probs.sum(-1, keepdim=True)
    one_hot = torch.nn.functional.one_hot(x.argmax(-1), vocab).float()
    return torch.where(greedy[:, None], one_hot, probs)


def sample_ref(logits, temperature, top_k, top_p, min_p, seeds, offsets) -> torch.Tensor:
    """Plain-torch ``sample``: same distribution, drawn with a torch generator per row."""
    probs = sampling_probs_ref(logits, temperature, top_k, top_p, min_p)
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for i, (seed, offset) in enumerate(zip(seeds.tolist(), offsets.tolist())):
        gen = torch.Generator(device=logits.device).manual_seed((seed * 1_000_003 + offset) & ((1 << 63) - 1))
        out[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
    return out
