"""``medusa``: K heads over the target's hidden state propose K drafts in one pass.

The runner returns, for each request that sampled this step, the hidden row that produced its
last token (``RunnerOutput.hidden_states``, which ``observe`` receives: position ``N - 2`` for a
request of ``N`` known tokens, the row of the last accepted draft after a verification). Head
``k`` on that row proposes token ``N + k``. The heads do not see each other's drafts, so the drafts are drawn one position at a
time only for the request's own penalties and min_tokens mask, which count the drafts before a
position (``rows``). Greedy drafts are argmaxes; sampled ones come with their distribution for
the rejection sampler (``proposer.draw``). A draft vocabulary (``t2d``) works as for EAGLE
(``heads.DraftLMHead``). With ``tree_width`` > 1 (``spec_tree_width``) a request without a
grammar gets a draft tree of the heads' likeliest tokens instead (``_propose_trees``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.engine.request import Request
from sluice.engine.sampler import GeneratorCache, SampleRow, SamplingBatch, penalize
from sluice.engine.spec_decode import tree
from sluice.engine.spec_decode.heads import DraftLMHead, MedusaHeads
from sluice.engine.spec_decode.proposer import Draft, draft_prob, draft_room, draw


class MedusaProposer:
    name = "medusa"

    def __init__(self, heads: MedusaHeads, target, vocab_size: int, device, seed: int = 0,
                 min_prob: float = 0.0, head_format: str = "float32", tree_width: int = 1,
                 tree_nodes: int | None = None) -> None:
        self.heads = heads
        self.min_prob = min_prob            # a draft ends before a token its head gives less
        self.tree_width = tree_width        # > 1: draft trees, for requests without a grammar
        self.tree_nodes = tree_nodes        # a tree's nodes verified freely (tree.select); None: all
        self.target = target
        self._hidden: dict = {}            # the last step's: request id -> (position, hidden [H])
        self.vocab_size = vocab_size
        self.device = device
        self.generators = GeneratorCache(seed=seed, device=device)
        weight = next(heads.parameters())
        self._lm = DraftLMHead(target, heads.draft_vocab, vocab_size, weight.dtype, device, head_format)
        self.head_format = self._lm.format   # the draft LM head's: "w8a8", "float32" or "target"

    def observe(self, requests, hidden_states: dict) -> None:
        self._hidden = hidden_states

    def drop(self, request_id: str) -> None:
        self.generators.drop(request_id)

    def propose(self, requests: Sequence[Request], k: int) -> dict[str, Draft]:
        work, hidden = [], []
        for req in requests:
            got = self._hidden.get(req.request_id)
            room = min(draft_room(req, k), self.heads.num_heads)
            if got is None or got[0] != req.num_tokens - 2 or room <= 0:
                continue
            work.append((req, room))
            hidden.append(got[1])
        if not work:
            return {}
        with torch.inference_mode():
            logits = self.heads.logits(torch.stack(hidden), self._lm)   # [B, heads, V]
            out: dict[str, Draft] = {}
            if self.tree_width > 1:
                # Requests without a grammar get trees; the others chains.
                tree_ok = [req.sampling_params.structured is None for req, _r in work]
                if any(tree_ok):
                    idx = [i for i, t in enumerate(tree_ok) if t]
                    out = self._propose_trees([work[i] for i in idx], logits[idx])
                    keep = [i for i, t in enumerate(tree_ok) if not t]
                    if not keep:
                        return out
                    work, logits = [work[i] for i in keep], logits[keep]
            drafts = {req.request_id: [] for req, _ in work}
            probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, _ in work}
            ended: set[int] = set()      # requests whose draft ended at a low-probability token
            for j in range(max(room for _, room in work)):
                live = [i for i, (_, room) in enumerate(work) if room > j and i not in ended]
                if not live:
                    break
                rows = [SampleRow(work[i][0], tuple(drafts[work[i][0].request_id])) for i in live]
                tokens, dists = draw(logits[live, j], rows, self.generators, self.vocab_size, self.device)
                for i, tok, q in zip(live, tokens, dists):
                    if draft_prob(logits[i, j], tok, q) < self.min_prob:
                        ended.add(i)
                        continue
                    rid = work[i][0].request_id
                    drafts[rid].append(tok)
                    if q is not None:
                        probs[rid].append(q)
        out.update({rid: Draft(d, torch.stack(probs[rid]) if probs[rid] else None) for rid, d in drafts.items() if d})
        return out

    def _propose_trees(self, work: list, logits: torch.Tensor) -> dict[str, Draft]:
        """Draft trees (``spec_decode.tree``), as Medusa's own: the children of a node at depth j
        are head j's ``tree_width`` likeliest tokens (after the penalties of the node's path),
        kept while the product of the heads' probabilities along the path is at least
        ``min_prob``, the best-scoring first, at most K * width nodes, of which the step verifies
        those ``tree.select`` keeps; point masses, as EAGLE's."""
        width = self.tree_width
        tokens: list[list[int]] = [[] for _ in work]
        parents: list[list[int]] = [[] for _ in work]
        scores: list[list[float]] = [[] for _ in work]
        frontier = [(i, -1, 1.0) for i in range(len(work))]     # (request index, node, score)
        for depth in range(max(room for _req, room in work)):
            frontier = [f for f in frontier if depth < work[f[0]][1]]
            if not frontier:
                break
            rows = [SampleRow(work[i][0], tree.path_tokens(tokens[i], parents[i], node))
                    for i, node, _s in frontier]
            sb = SamplingBatch.from_rows(rows, self.vocab_size, self.device, self.generators)
            probs = torch.softmax(penalize(logits[[i for i, _n, _s in frontier], depth], sb), dim=-1)
            top = probs.topk(min(width, probs.shape[-1]), dim=-1)
            budget = {i: work[i][1] * width - len(tokens[i]) for i, _n, _s in frontier}
            grown = []
            for f, tok, score in tree.children([(i, sc) for i, _n, sc in frontier], top.indices.tolist(),
                                               top.values.tolist(), self.min_prob, budget):
                i = frontier[f][0]
                parents[i].append(frontier[f][1])
                tokens[i].append(tok)
                scores[i].append(score)
                grown.append((i, len(tokens[i]) - 1, score))
            frontier = grown
        out = {}
        for (req, _r), t, p, sc in zip(work, tokens, parents, scores):
            if t:
                t, p = tree.select(t, p, sc, self.tree_nodes)
                out[req.request_id] = Draft(t, None, p)
        return out
