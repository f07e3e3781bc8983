"""``eagle``: one extra decoder layer drafts from the target's hidden states, autoregressively.

For position ``i`` the head takes the pair (``embed(x_{i+1})``, ``h_i``) and predicts ``h_{i+1}``;
the target's LM head turns that into a token. Its keys and values live in a dense per-request
``EagleCache`` outside the paged pool (one layer of ``num_kv_heads x head_dim`` per position:
1.5 KB a token for SmolLM2).

Keeping the cache current: after every step the runner holds each scheduled request's hidden
rows (``RunnerOutput.hidden_states``: the first position and [n, H]). ``observe`` turns the valid ones
(positions whose hidden state the target kept, i.e. not a rejected draft's, and whose next token
is known) into pairs and runs the head over them, dropping first any entries from those positions
on (rejected drafts, a recomputation after preemption). A request whose prefix came from the
prefix cache has no hidden rows for it: its head attends to what it saw, which costs acceptance,
not correctness. The head's output at the last known pair is the first draft's hidden state.

``propose`` then runs the head on its own outputs: draft ``d_j`` comes from the predicted hidden
state, and the pair (``embed(d_j)``, that hidden state) at the next position gives ``d_{j+1}``.
These speculative entries are dropped at the next ``observe``. Drafts are drawn like
``small_draft``'s (``proposer.draw``). With a draft vocabulary (``t2d`` in the checkpoint) the
logits are computed for its tokens only, through their rows of the target's LM head, and every
other token gets probability 0 in the draft distribution: the rejection sampler stays exact (it
only ever sees tokens drawn from q), greedy drafts are accepted when the target's argmax is in it.

With ``tree_width`` > 1 (``spec_tree_width``) a request without a grammar gets a draft tree
instead (``_propose_trees``, ``spec_decode.tree``): the head runs on every kept node that may have
children, each branch in its own copy of the cache.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from sluice.engine.request import Request
from sluice.engine.sampler import GeneratorCache, SampleRow, SamplingBatch, penalize
from sluice.engine.spec_decode import tree
from sluice.engine.spec_decode.heads import DraftLMHead, EagleCache, EagleHead
from sluice.engine.spec_decode.proposer import Draft, draft_prob, draft_room, draw


class EagleProposer:
    name = "eagle"

    def __init__(self, head: EagleHead, target, vocab_size: int, device, seed: int = 0,
                 min_prob: float = 0.0, head_format: str = "float32", tree_width: int = 1,
                 tree_nodes: int | None = None) -> None:
        self.head = head
        self.min_prob = min_prob            # a draft ends before a token the head gives less
        self.tree_width = tree_width        # > 1: draft trees, for requests without a grammar
        self.tree_nodes = tree_nodes        # a tree's nodes verified freely (tree.select); None: all
        self.head_format = head.pack_for_serving(head_format)   # what drafting reads: "w8a8" or "float32"
        self.target = target
        self.vocab_size = vocab_size
        self.device = device
        self.generators = GeneratorCache(seed=seed, device=device)
        self._caches: dict[str, EagleCache] = {}
        self._preemptions: dict[str, int] = {}
        self._next: dict[str, tuple[int, torch.Tensor]] = {}   # request id -> (position, predicted hidden [H])
        self._lm = DraftLMHead(target, head.draft_vocab, vocab_size, head.fc.weight.dtype, device, head_format)
        self._top_probs = None      # the C++ kernels' softmax top-k, where the head's layer runs in them
        if head._cpp is not None:
            from sluice.kernels import cpu_ext

            self._top_probs = cpu_ext.module().top_probs

    def drop(self, request_id: str) -> None:
        self._caches.pop(request_id, None)
        self._preemptions.pop(request_id, None)
        self._next.pop(request_id, None)
        self.generators.drop(request_id)

    def _cache(self, req: Request) -> EagleCache:
        rid = req.request_id
        if self._preemptions.get(rid) != req.num_preemptions:   # recomputed from scratch: so is the head
            self._caches.pop(rid, None)
            self._next.pop(rid, None)
            self._preemptions[rid] = req.num_preemptions
        cache = self._caches.get(rid)
        if cache is None:
            cache = self._caches[rid] = self.head.new_cache(max(256, req.num_tokens + 64))
        return cache

    def observe(self, requests: Sequence[Request], hidden_states: dict) -> None:
        work = []     # (request id, end, (embeds, hidden, positions, cache))
        with torch.inference_mode():
            for req in requests:
                got = hidden_states.get(req.request_id)
                if got is None:
                    continue
                start, hidden = got
                end = min(start + hidden.shape[0], req.num_computed_tokens, req.num_tokens - 1)
                if end <= start:
                    continue
                cache = self._cache(req)
                cache.truncate(start)
                tokens = req.all_token_ids[start + 1:end + 1]
                embeds = self.target.embed(torch.tensor(tokens, dtype=torch.long, device=self.device))
                work.append((req.request_id, end, (embeds, hidden[:end - start], list(range(start, end)), cache)))
            if not work:
                return
            # One pass of the head over every request's new pairs (at 32 streams, one product
            # per weight instead of 32).
            outs = self.head.forward_many([item for _rid, _end, item in work])
            for (rid, end, _item), out in zip(work, outs):
                self._next[rid] = (end - 1, out[-1])

    def propose(self, requests: Sequence[Request], k: int) -> dict[str, Draft]:
        """Draft position by position over every drafting request at once: one LM-head product
        and one pass of the head's projections per position for the whole batch (attention per
        request, over its own cache), not one per request."""
        live = []       # (request, room, cache)
        hidden = []
        for req in requests:
            got = self._next.get(req.request_id)
            room = draft_room(req, k)
            n = req.num_tokens
            if got is None or got[0] != n - 2 or room <= 0:
                continue
            cache = self._caches[req.request_id]
            cache.truncate(n - 1)
            live.append((req, room, cache))
            hidden.append(got[1])
        if not live:
            return {}
        out: dict[str, Draft] = {}
        if self.tree_width > 1:
            # Requests without a grammar get trees; the others chains.
            tree_ok = [req.sampling_params.structured is None for req, _r, _c in live]
            if any(tree_ok):
                out = self._propose_trees([x for x, t in zip(live, tree_ok) if t],
                                          [h for h, t in zip(hidden, tree_ok) if t])
                hidden = [h for h, t in zip(hidden, tree_ok) if not t]
                live = [x for x, t in zip(live, tree_ok) if not t]
                if not live:
                    return out
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _r, _c in live}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, _r, _c in live}
        with torch.inference_mode():
            h = torch.stack(hidden)                                       # [B, H]
            for j in range(max(room for _req, room, _c in live)):
                logits = self._lm(h)
                rows = [SampleRow(req, tuple(drafts[req.request_id])) for req, _r, _c in live]
                tokens, dists = draw(logits, rows, self.generators, self.vocab_size, self.device)
                going = []      # rows that draft again: their token is kept and room is left
                for i, (req, room, _cache) in enumerate(live):
                    if draft_prob(logits[i], tokens[i], dists[i]) < self.min_prob:
                        continue
                    drafts[req.request_id].append(tokens[i])
                    if dists[i] is not None:
                        probs[req.request_id].append(dists[i])
                    if j + 1 < room:
                        going.append(i)
                if not going:
                    break
                e = self.target.embed(torch.tensor([tokens[i] for i in going], dtype=torch.long, device=self.device))
                h = torch.cat(self.head.forward_many([
                    (e[m:m + 1], h[i:i + 1], [live[i][0].num_tokens - 1 + j], live[i][2])
                    for m, i in enumerate(going)]))
                live = [live[i] for i in going]
        out.update({rid: Draft(d, torch.stack(probs[rid]) if probs[rid] else None) for rid, d in drafts.items() if d})
        return out

    def _propose_trees(self, live: list, hidden: list[torch.Tensor]) -> dict[str, Draft]:
        """Draft trees (``spec_decode.tree``), depth by depth over all the requests at once: each
        frontier node's ``tree_width`` likeliest children (after penalties, as a greedy chain's
        argmax), kept while the product of the head's probabilities along the path is at least
        ``min_prob`` (EAGLE-2's score), the best-scoring first, at most K * width nodes a request,
        of which the step verifies those ``tree.select`` keeps. Every node is a point mass, a
        sampled request's too (verified by elimination, ``verify._tree_rejection``). A kept child that may have children runs the head on (its
        embedding, its parent's predicted hidden state), in a copy of its parent's cache when it
        has siblings."""
        width = self.tree_width
        tokens: list[list[int]] = [[] for _ in live]
        parents: list[list[int]] = [[] for _ in live]
        scores: list[list[float]] = [[] for _ in live]
        # (request index, node (-1: the root), predicted hidden [H], cache, score)
        frontier = [(i, -1, h, cache, 1.0) for i, ((_req, _room, cache), h) in enumerate(zip(live, hidden))]
        plain = False       # no request's logits are changed: no sampling batch is needed from here on
        with torch.inference_mode():
            for depth in range(1, max(room for _req, room, _c in live) + 1):
                sb = None
                if not plain:
                    rows = [SampleRow(live[i][0], tree.path_tokens(tokens[i], parents[i], node))
                            for i, node, _h, _c, _s in frontier]
                    sb = SamplingBatch.from_rows(rows, self.vocab_size, self.device, self.generators)
                    # Penalties and biases are the requests' own; a min_tokens mask only lifts as
                    # paths grow: a batch that changes nothing at depth 1 changes nothing deeper.
                    plain = not sb.changes_logits
                    sb = None if plain else sb
                top_ids, top_probs = self._top_children(torch.stack([h for _i, _n, h, _c, _s in frontier]), sb, width)
                budget = {i: live[i][1] * width - len(tokens[i]) for i in {f[0] for f in frontier}}
                grow = []      # (frontier index, request index, new node, score)
                for f, tok, score in tree.children([(i, sc) for i, _n, _h, _c, sc in frontier], top_ids,
                                                   top_probs, self.min_prob, budget):
                    i = frontier[f][0]
                    parents[i].append(frontier[f][1])
                    tokens[i].append(tok)
                    scores[i].append(score)
                    if depth < live[i][1]:
                        grow.append((f, i, len(tokens[i]) - 1, score))
                if not grow:
                    break
                # Each parent's first growing child extends its cache in place, the others a copy.
                seen, items = set(), []
                for f, i, node, _score in grow:
                    cache = frontier[f][3]
                    if f in seen:
                        cache = cache.fork()
                    seen.add(f)
                    items.append((f, i, node, cache))
                e = self.target.embed(torch.tensor([tokens[i][node] for _f, i, node, _c in items],
                                                   dtype=torch.long, device=self.device))
                pos = [live[i][0].num_tokens - 2 + depth for _f, i, _n, _c in items]
                h = self.head.forward_many([(e[m:m + 1], frontier[f][2][None], [pos[m]], cache)
                                            for m, (f, _i, _n, cache) in enumerate(items)])
                frontier = [(i, node, h[m][0], cache, score)
                            for m, ((_f, i, node, cache), (_f2, _i2, _n2, score)) in enumerate(zip(items, grow))]
        out = {}
        for (req, _r, _c), t, p, sc in zip(live, tokens, parents, scores):
            if t:
                t, p = tree.select(t, p, sc, self.tree_nodes)
                out[req.request_id] = Draft(t, None, p)
        return out

    def _top_children(self, h: torch.Tensor, sb: SamplingBatch | None, width: int) -> tuple[list, list]:
        """Each frontier row's ``width`` likeliest next tokens and their probabilities under the
        head (after ``sb``'s penalties; None: nothing changes the logits). When nothing does and
        there is a draft vocabulary, the softmax and top-k run over that vocabulary's logits
        alone: the same probabilities (every other token's is 0), without a [rows, vocab] pass."""
        if sb is None and self._lm.vocab is None:
            logits, ids = self._lm(h), None
        elif self._lm.vocab is not None and (sb is None or not sb.changes_logits):
            logits, ids = self._lm.draft_logits(h), self._lm.vocab
        else:
            logits, ids = penalize(self._lm(h), sb), None
        width = min(width, logits.shape[-1])
        if self._top_probs is not None and logits.device.type == "cpu":
            probs, top = self._top_probs(logits.float().contiguous(), width)
        else:
            probs, top = torch.softmax(logits, dim=-1).topk(width, dim=-1)
        return (top if ids is None else ids[top]).tolist(), probs.tolist()
