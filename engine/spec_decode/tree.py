"""Draft trees: several candidate continuations verified in one step, sharing their prefixes.

A tree is the draft tokens in an order where every node comes after its parent, with
``parents[i]`` the index of node ``i``'s parent (-1: the request's last known token). Every
prefix of that order is itself a tree, so the scheduler trims a tree as it trims a chain, and a
chain is the tree ``parents = [-1, 0, 1, ...]``.

The step runs the last known token and every node as rows: node ``i`` at depth ``d`` (a child of
the last known token has depth 1) sits at position ``n - 1 + d`` of a request with ``n`` known
tokens and attends to the known tokens, then to its ancestors and itself, by position
(``attention.base.TreeRows``). Its row is what the target computes for the sequence "known
tokens + its path", so verification is the chain's along one path: for a greedy request the
path its argmax takes, and greedy output is what steps without drafts give. The accepted
nodes' K/V are then moved to the slots of positions n, n + 1, ... (``accepted_moves``) and the
rejected ones are overwritten later, as a chain's rejected drafts are.

A sampled request's tree is verified by elimination (``verify._tree_rejection``): a node's
children are point masses tried in turn, each rejected one's token removed from the target's
distribution, so every emitted token is still distributed as the target samples it. Requests
with a grammar keep chains (the grammar's bitmask is filled along one chain of drafts). The
step's attention reads the tree as ``TreeRows``: the C++ layer stack by position, the torch
backend and the Triton kernel (CUDA) by index (``LlamaForCausalLM.supports_draft_trees``).
"""
from __future__ import annotations


def depths(parents: list[int]) -> list[int]:
    """Depth of each node (1 for the children of the last known token)."""
    out: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"draft tree: node {i}'s parent {p} does not come before it")
        out.append(1 if p < 0 else out[p] + 1)
    return out


def path(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node``, inclusive."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def visibility(parents: list[int]) -> list[list[int]]:
    """[N][N] 0/1: row i marks the nodes node i attends to among the tree's, its ancestors and
    itself (``attention.base.TreeRows.visible``)."""
    out = [[0] * len(parents) for _ in parents]
    for i in range(len(parents)):
        for a in path(parents, i):
            out[i][a] = 1
    return out


def path_tokens(tokens: list[int], parents: list[int], node: int) -> tuple[int, ...]:
    """The draft tokens from the root's child down to ``node`` (none for the root, -1)."""
    return tuple(tokens[a] for a in path(parents, node)) if node >= 0 else ()


def accept_greedy(argmax: list[int], drafts: list[int], parents: list[int]) -> tuple[list[int], int]:
    """Walk the tree along the target's argmax: ``argmax[0]`` is the last known token's row,
    ``argmax[1 + i]`` node i's. Returns the accepted nodes (a path from the root) and the token the
    target adds after them."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, p) in enumerate(zip(drafts, parents)):
        children.setdefault(p, {}).setdefault(tok, i)
    accepted: list[int] = []
    node = -1
    while True:
        tok = argmax[0 if node < 0 else 1 + node]
        nxt = children.get(node, {}).get(tok)
        if nxt is None:
            return accepted, tok
        accepted.append(nxt)
        node = nxt


def children(frontier: list[tuple[int, float]], top_ids: list[list[int]], top_probs: list[list[float]],
             min_score: float, budget: dict[int, int]) -> list[tuple[int, int, float]]:
    """One depth of a tree's growth. ``frontier``: (request index, path score) per node that may
    get children; ``top_ids`` / ``top_probs``: each one's likeliest next tokens and their
    probabilities. A child's score is its parent's times its probability; children scoring at
    least ``min_score`` are kept, per request the best first, up to ``budget[request]`` nodes.
    Returns (frontier index, token, score) per kept child, each request's best first."""
    by_request: dict[int, list[tuple[float, int, int]]] = {}
    for f, ((req, score), ids, probs) in enumerate(zip(frontier, top_ids, top_probs)):
        for tok, p in zip(ids, probs):
            if p > 0.0 and score * p >= min_score:     # p = 0: outside a draft vocabulary
                by_request.setdefault(req, []).append((score * p, f, tok))
    out = []
    for req, cands in by_request.items():
        cands.sort(key=lambda c: -c[0])
        out.extend((f, tok, score) for score, f, tok in cands[:max(0, budget.get(req, 0))])
    return out


# What rows past those a step runs at one row's cost (``select``'s free nodes) cost, in accepted
# drafts they must bring: the first extra row makes the step EXTRA_ROWS_STEP_COST larger, every
# further one EXTRA_ROW_COST. Measured on SmolLM2's float32 CPU stack (2 AVX-512 cores): 1-6 rows
# ~19 ms a step, 7 rows +15%, 12 rows +55%, with ~2 tokens a step: 0.3 of a token for the jump,
# ~0.1 a row after it.
EXTRA_ROWS_STEP_COST = 0.2
EXTRA_ROW_COST = 0.1


def select(tokens: list[int], parents: list[int], scores: list[float], free: int | None,
           step_cost: float = EXTRA_ROWS_STEP_COST, row_cost: float = EXTRA_ROW_COST) -> tuple[list[int], list[int]]:
    """The tree a step verifies (EAGLE-2's reranking, with a cost): its ``free`` nodes of highest
    path score, and as many of the others, best first, as pay for themselves: a node's score
    estimates the accepted drafts it brings (the expected accepted length is the sum of the
    path probabilities), ``step_cost`` + ``row_cost`` * extras what the larger step costs.
    ``free`` None: every node. A child's score is its parent's times a probability, so the best
    nodes (ties by index: parents first) include each one's ancestors; they keep their order.
    Returns (tokens, parents), re-indexed."""
    n = len(tokens)
    if free is None or n <= free:
        return tokens, parents
    order = sorted(range(n), key=lambda i: (-scores[i], i))
    best, extra, gain = 0, 0, -step_cost
    for j, i in enumerate(order[free:], start=1):
        gain += scores[i] - row_cost
        if gain > extra:       # more rows only for more gain; none unless it is positive
            best, extra = j, gain
    if free + best == n:
        return tokens, parents
    keep = sorted(order[:free + best])
    index = {old: new for new, old in enumerate(keep)}
    return [tokens[i] for i in keep], [-1 if parents[i] < 0 else index[parents[i]] for i in keep]


def accepted_moves(accepted: list[int]) -> list[tuple[int, int]]:
    """(from, to) draft indices that put the accepted nodes' K/V where a chain's would be: node
    ``accepted[j]`` to index j. In order: a node's index is at least its depth - 1, so no move
    reads an index an earlier one wrote."""
    return [(a, j) for j, a in enumerate(accepted) if a != j]
