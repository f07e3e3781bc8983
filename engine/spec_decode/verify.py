"""Verification: which draft tokens the target accepts, and the token it adds.

Input: the target's logits for every row of the requests that carried drafts (K + 1 rows for K
drafts; see ``rows``), already sampled-from in ``SamplingBatch`` form, and the drafts.

* Greedy requests: accept the longest prefix of drafts equal to the target's argmax (after
  penalties, bias and the min_tokens mask, per row), then add the argmax at the first mismatch,
  or the bonus row's argmax when all K are accepted. The output is what K + 1 greedy steps
  without drafts would give. A draft tree (``spec_decode.tree``) is walked the same way: from
  each accepted node to its child equal to that node's row's argmax.
* Sampling requests: rejection sampling (Leviathan et al. 2023; Chen et al. 2023). With target
  distributions ``p_j`` (every sampling stage applied, the same distribution a plain step
  draws from) and draft distributions ``q_j``: accept ``d_j`` with probability
  ``min(1, p_j[d_j] / q_j[d_j])``; at the first rejection draw from ``norm(max(0, p_j - q_j))``;
  after K acceptances draw the bonus from ``p_K``. Each emitted token is then distributed as
  the target alone would sample it. A draft tree's children are point masses tried one after
  another (``_tree_rejection``). A proposer without probabilities (n-gram, greedy draft
  model) is a point mass: ``q_j = onehot(d_j)``, so ``d_j`` is accepted with probability
  ``p_j[d_j]`` and the residual is ``p_j`` with ``d_j`` removed.

On CUDA the sampling path runs ``kernels.rejection`` (Philox keyed by the request's seed, or a
fresh key from the shared generator, and its output count); elsewhere the torch code below,
drawing from the request's own generator as plain steps do.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from sluice.engine.outputs import TokenLogprob
from sluice.engine.sampler import GeneratorCache, SamplingBatch, greedy_ids, penalize, processed_probs, request_seed
from sluice.engine.spec_decode import tree


@dataclass(frozen=True)
class DraftedSeq:
    request: object                    # the Request
    first_row: int                     # its K + 1 rows are first_row .. first_row + K
    draft_ids: list[int]               # K >= 1 drafts
    draft_probs: torch.Tensor | None   # [K, V] or None (point mass)
    parents: list[int] | None = None   # a draft tree's (spec_decode.tree); None: a chain


@dataclass(frozen=True)
class Verified:
    token_ids: list[int]               # accepted drafts, then the added token
    num_rejected: int                  # K - accepted
    logprobs: list[TokenLogprob] | None
    accepted_nodes: list[int] | None = None   # a tree's accepted path (draft indices); None: a chain


def verify(logits: torch.Tensor, batch: SamplingBatch, seqs: list[DraftedSeq],
           generators: GeneratorCache, use_kernel: bool = False, prepenalised: bool = False) -> list[Verified]:
    """logits: [R, V], the rows of ``seqs`` (``batch`` built from the same rows); ``prepenalised``:
    they already went through the shared stages (``Sampler.penalize``), and verification is the
    last stage (the runner's step), else it runs them here."""
    penalised = logits if prepenalised else penalize(logits.float(), batch)   # [R, V]
    argmax = greedy_ids(penalised).tolist()
    greedy = batch.greedy.tolist()
    emitted: list[list[int]] = [None] * len(seqs)
    nodes: list[list[int] | None] = [None] * len(seqs)
    random_seqs, random_trees = [], []
    for i, s in enumerate(seqs):
        rows = argmax[s.first_row:s.first_row + len(s.draft_ids) + 1]
        if not greedy[s.first_row]:
            (random_seqs if s.parents is None else random_trees).append(i)
        elif s.parents is not None:
            nodes[i], last = tree.accept_greedy(rows, s.draft_ids, s.parents)
            emitted[i] = [s.draft_ids[a] for a in nodes[i]] + [last]
        else:
            emitted[i] = _greedy(rows, s.draft_ids)
    if random_seqs or random_trees:
        probs = processed_probs(penalised, batch, penalised=True)     # [R, V]
    if random_seqs:
        draw = _rejection_kernel if use_kernel else _rejection_torch
        for i, toks in zip(random_seqs, draw(probs, [seqs[i] for i in random_seqs], generators)):
            emitted[i] = toks
    for i in random_trees:
        nodes[i], emitted[i] = _tree_rejection(probs, seqs[i], generators)
    logprobs = _logprobs(penalised, batch, seqs, emitted, nodes)
    return [Verified(e, len(s.draft_ids) + 1 - len(e), lp, a) for s, e, lp, a in zip(seqs, emitted, logprobs, nodes)]


def _greedy(argmax: list[int], drafts: list[int]) -> list[int]:
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax[accepted]:
        accepted += 1
    return argmax[:accepted + 1]


def _draft_q(s: DraftedSeq, vocab: int, device) -> torch.Tensor:
    """[K, V] the draft distributions; a point mass per token when the proposer gave none."""
    if s.draft_probs is not None:
        return s.draft_probs[:len(s.draft_ids)].to(device=device, dtype=torch.float32)
    ids = torch.tensor(s.draft_ids, dtype=torch.int64, device=device)
    return torch.zeros(len(s.draft_ids), vocab, device=device).scatter_(1, ids.unsqueeze(1), 1.0)


def _rejection_torch(probs: torch.Tensor, seqs: list[DraftedSeq], generators: GeneratorCache) -> list[list[int]]:
    out = []
    for s in seqs:
        k = len(s.draft_ids)
        p = probs[s.first_row:s.first_row + k + 1]                    # [K + 1, V]
        q = _draft_q(s, p.shape[-1], p.device)                        # [K, V]
        gen = generators.get(s.request)
        ids = torch.tensor(s.draft_ids, dtype=torch.int64, device=p.device)
        p_d = p[:k].gather(1, ids.unsqueeze(1)).squeeze(1)            # [K]
        q_d = q.gather(1, ids.unsqueeze(1)).squeeze(1)                # [K]
        u = torch.rand(k, generator=gen, device=p.device)             # [K]
        ok = (u * q_d < p_d).tolist()                                 # u < p / q without dividing
        accepted = ok.index(False) if False in ok else k
        if accepted < k:
            dist = (p[accepted] - q[accepted]).clamp_min(0.0)
            if float(dist.sum()) <= 0.0:   # p == q leaves no residual (and cannot reject)
                dist = p[accepted]
        else:
            dist = p[k]
        last = int(torch.multinomial(dist, 1, generator=gen)[0])
        out.append(s.draft_ids[:accepted] + [last])
    return out


def _tree_rejection(probs: torch.Tensor, s: DraftedSeq, generators: GeneratorCache) -> tuple[list[int], list[int]]:
    """A sampling request's draft tree: from the last known token's row, try the node's children
    in draft order, each a point mass. Child c is accepted with probability p(c) / (the mass p
    has left); a rejected child's token leaves p (its probability set to 0). An accepted child
    moves the walk to its row; when every child is rejected, or a node has none, the added token
    is drawn from what is left of p. Each token is then distributed as p: with one child this is
    the chain's rule for a point mass, and with several it is p sampled by elimination.
    Returns the accepted nodes and the emitted tokens."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(s.parents):
        children.setdefault(parent, []).append(i)
    gen = generators.get(s.request)
    accepted: list[int] = []
    node = -1
    while True:
        p = probs[s.first_row + (0 if node < 0 else 1 + node)].clone()
        for child in children.get(node, ()):
            tok = s.draft_ids[child]
            u = torch.rand((), generator=gen, device=p.device)
            if float(u * p.sum()) < float(p[tok]):
                accepted.append(child)
                node = child
                break
            p[tok] = 0.0
        else:
            if float(p.sum()) <= 0.0:   # only by rounding: a child that held all of p was rejected
                p = probs[s.first_row + (0 if node < 0 else 1 + node)]
            last = int(torch.multinomial(p, 1, generator=gen)[0])
            return accepted, [s.draft_ids[a] for a in accepted] + [last]


def _rejection_kernel(probs: torch.Tensor, seqs: list[DraftedSeq], generators: GeneratorCache) -> list[list[int]]:
    """``kernels.rejection`` over groups of equal K (it takes one K per launch)."""
    rejection = importlib.import_module("sluice.kernels.rejection")
    dev, vocab = probs.device, probs.shape[-1]
    by_k: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        by_k.setdefault(len(s.draft_ids), []).append(i)
    out: list[list[int]] = [None] * len(seqs)
    for k, members in by_k.items():
        group = [seqs[i] for i in members]
        target = torch.stack([probs[s.first_row:s.first_row + k + 1] for s in group])   # [G, K + 1, V]
        draft = torch.stack([_draft_q(s, vocab, dev) for s in group])                   # [G, K, V]
        ids = torch.tensor([s.draft_ids for s in group], dtype=torch.int64, device=dev)  # [G, K]
        seeds = [_philox_seed(s.request, generators) for s in group]
        offsets = [s.request.num_output_tokens for s in group]
        toks, emitted = rejection.rejection_sample(
            ids, draft, target, torch.tensor(seeds, dtype=torch.int64, device=dev),
            torch.tensor(offsets, dtype=torch.int64, device=dev))
        for i, row, n in zip(members, toks.tolist(), emitted.tolist()):
            out[i] = row[:n]
    return out


def _philox_seed(req, generators: GeneratorCache) -> int:
    seed = request_seed(req)
    if seed is None:
        return int(torch.randint(0, (1 << 63) - 1, (), generator=generators.shared, device=generators.device))
    return ((seed + (1 << 63)) % (1 << 64)) - (1 << 63)


def _logprobs(penalised: torch.Tensor, batch: SamplingBatch, seqs: list[DraftedSeq],
              emitted: list[list[int]], nodes: list[list[int] | None]) -> list[list[TokenLogprob] | None]:
    """OpenAI semantics, as plain steps: the processed distribution before temperature, per row."""
    if batch.max_num_logprobs is None:
        return [None] * len(seqs)
    lsm = penalised.log_softmax(dim=-1)                               # [R, V]
    top = lsm.topk(batch.max_num_logprobs, dim=-1) if batch.max_num_logprobs else None
    out = []
    for s, toks, accepted in zip(seqs, emitted, nodes):
        k = batch.num_logprobs[s.first_row]
        if k is None:
            out.append(None)
            continue
        rows = (range(s.first_row, s.first_row + len(toks)) if accepted is None
                else [s.first_row] + [s.first_row + 1 + a for a in accepted])
        lps = []
        for r, t in zip(rows, toks):
            alts = () if top is None or k == 0 else tuple(
                zip(top.indices[r, :k].tolist(), top.values[r, :k].tolist()))
            lps.append(TokenLogprob(t, float(lsm[r, t]), alts))
        out.append(lps)
    return out
