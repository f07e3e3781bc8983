"""Client-side types and message builders of ``Embed`` / ``Rerank`` (re-exported by
``sluice.engine.client``; no torch, no engine internals)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluice.engine.rpc import engine_pb2 as pb

_INPUT_TYPES = {None: pb.EMBED_INPUT_TYPE_UNSPECIFIED, "query": pb.EMBED_INPUT_TYPE_QUERY,
                "document": pb.EMBED_INPUT_TYPE_DOCUMENT}


@dataclass(frozen=True)
class Embeddings:
    vectors: list[list[float]]     # in input order
    token_counts: list[int]        # tokens the model saw per input
    truncated: list[bool]          # cut at the model's max length
    prompt_tokens: int             # = total tokens
    model: str


@dataclass(frozen=True)
class RerankHit:
    index: int                     # position of the document / pair in the request
    score: float
    document: str | None = None    # with return_documents


@dataclass(frozen=True)
class Reranked:
    results: list[RerankHit]       # best first (query + documents) or input order (pairs)
    scores: list[float]            # every document's score, in request order
    method: str                    # "cross-encoder" | "embedding-cosine"
    model: str
    prompt_tokens: int


def embed_request(inputs: str | Sequence[str] | Sequence[Sequence[int]], *, normalize: bool | None = None,
                  dimensions: int | None = None, input_type: str | None = None, prefix: str | None = None,
                  truncate: bool | None = None) -> pb.EmbedRequest:
    if input_type not in _INPUT_TYPES:
        raise ValueError(f"input_type: must be query, document or None, got {input_type!r}")
    req = pb.EmbedRequest(dimensions=dimensions or 0, input_type=_INPUT_TYPES[input_type])
    items = [inputs] if isinstance(inputs, str) else list(inputs)
    if items and all(isinstance(x, str) for x in items):
        req.texts.extend(items)
    else:
        for i, ids in enumerate(items):
            if isinstance(ids, str):
                raise ValueError(f"inputs[{i}]: must be all strings or all token-id lists")
            req.token_ids.add(ids=list(ids))
    for name, value in (("normalize", normalize), ("prefix", prefix), ("truncate", truncate)):
        if value is not None:
            setattr(req, name, value)
    return req


def embeddings_from_proto(msg: pb.EmbedResponse) -> Embeddings:
    items = sorted(msg.embeddings, key=lambda e: e.index)
    return Embeddings([list(e.values) for e in items], [e.num_tokens for e in items],
                      [e.truncated for e in items], msg.usage.prompt_tokens, msg.model)


def rerank_request(query: str | None, documents: Sequence[str] | None, pairs: Sequence[tuple[str, str]] | None,
                   top_n: int | None, return_documents: bool) -> pb.RerankRequest:
    req = pb.RerankRequest(query=query or "", documents=list(documents or ()), return_documents=return_documents)
    for q, d in pairs or ():
        req.pairs.add(query=q, document=d)
    if top_n is not None:
        req.top_n = top_n
    return req


def reranked_from_proto(msg: pb.RerankResponse) -> Reranked:
    hits = [RerankHit(r.index, r.score, r.document or None) for r in msg.results]
    return Reranked(hits, list(msg.scores), msg.method, msg.model, msg.usage.prompt_tokens)
