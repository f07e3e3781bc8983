"""Fused sampling: temperature, top-k, top-p and min-p without sorting the vocabulary.

Semantics (the reference ``sampling_probs_ref`` defines them): a row with temperature 0 is
greedy (argmax, the lowest index on ties). Otherwise ``w = softmax(logits / T)``; token ``i``
survives when all three filters keep it, each judged on ``w`` itself (not renormalised by the
others, FlashInfer's "joint" order):
  top-k: fewer than ``k`` tokens have a strictly larger weight (``k <= 0`` disables);
  top-p: the tokens strictly heavier than ``i`` hold less than ``p`` of the mass (p = 1 disables);
  min-p: ``w_i >= min_p * max(w)``.
The survivors form an upper set of the weights, and the sample is drawn from ``w`` restricted
to them. Ties at a threshold are kept together.

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

from kernels._checks import FLOAT_DTYPES, check_shape, check_tensor

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
        count_gt, mass_gt = _heavier_than(row_ptr, vocab_size, m, inv_t, w_tok, BLOCK_V)
        keep = (count_gt < top_k) & ((top_p >= 1.0) | (mass_gt < top_p * total)) & (w_tok >= min_w)
        searching = ~keep
        pivot = w_tok
        cand_mass = mass_gt
    tl.store(out_ptr + row, token.to(tl.int64))


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
def _heavier_than(row_ptr, vocab_size, m, inv_t, w_tok, BLOCK_V: tl.constexpr):
    """How many tokens weigh strictly more than w_tok, and their total weight."""
    cols0 = tl.arange(0, BLOCK_V)
    count = tl.full([], 0, tl.int32)
    mass = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + cols0
        x = tl.load(row_ptr + cols, mask=cols < vocab_size, other=float("-inf")).to(tl.float32)
        w = tl.exp((x - m) * inv_t)
        heavier = w > w_tok
        count += tl.sum(heavier.to(tl.int32), 0)
        mass += tl.sum(tl.where(heavier, w, 0.0), 0)
    return count, mass


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
        logits.stride(0), logits.shape[1], BLOCK_V=block_v, num_warps=_NUM_WARPS,
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
    cum = asc.cumsum(-1)
    n_le = torch.searchsorted(asc, w, right=True)                     # tokens weighing <= w_i
    count_gt = vocab - n_le
    mass_gt = cum[:, -1:] - cum.gather(-1, n_le - 1)
    k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
    keep = count_gt < k[:, None]
    keep &= (top_p[:, None] >= 1.0) | (mass_gt < top_p[:, None] * cum[:, -1:])
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
