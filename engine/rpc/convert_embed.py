"""Protobuf <-> embedding engine, at the edge only: ``Embed`` / ``Rerank`` requests become plain
arguments (checked here so that every message names the request's own field: ``texts[2]``,
``token_ids[0]``, ``pairs[1].document``), results become responses.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.engine.rpc import engine_pb2 as pb

if TYPE_CHECKING:
    from sluice.engine.embedding import EmbeddingEngine, EmbedResult
    from sluice.engine.loaders.bert_loader import EmbeddingModel


@dataclass(frozen=True)
class EmbedArgs:
    inputs: list[str] | list[list[int]]
    field: str                     # "texts" or "token_ids": names inputs in error messages
    normalize: bool | None
    dimensions: int | None         # None: the full vector
    prefix: str | None
    truncate: bool


@dataclass(frozen=True)
class RerankArgs:
    pairs: list[tuple[str, str]] | None     # the pairs form: scored in input order
    query: str
    documents: list[str]
    top_n: int | None
    return_documents: bool


def prefixes(model: EmbeddingModel) -> tuple[str, str]:
    """(query prefix, document prefix) from the model's sentence-transformers prompts."""
    prompts = model.sentence.prompts
    return prompts.get("query", ""), prompts.get("document", prompts.get("passage", ""))


def embed_from_proto(msg: pb.EmbedRequest, model: EmbeddingModel) -> EmbedArgs:
    if msg.texts and msg.token_ids:
        raise ValueError("texts: give texts or token_ids, not both")
    if not msg.texts and not msg.token_ids:
        raise ValueError("texts: at least one text (or token_ids list) is required")
    if msg.texts:
        field, inputs = "texts", list(msg.texts)
        bad = next((i for i, t in enumerate(inputs) if not t), None)
        if bad is not None:
            raise ValueError(f"texts[{bad}]: must be a non-empty string")
    else:
        field, inputs = "token_ids", [_checked_ids(i, t.ids, model.config.vocab_size)
                                      for i, t in enumerate(msg.token_ids)]
    if not 0 <= msg.dimensions <= model.hidden_size:
        raise ValueError(f"dimensions: must be 0 (full) or in [1, {model.hidden_size}], got {msg.dimensions}")
    prefix = _prefix(msg, model)
    if prefix and field == "token_ids":
        name = "prefix" if msg.HasField("prefix") else "input_type"
        raise ValueError(f"{name}: the prefix {prefix!r} cannot be applied to token-id inputs; add its ids yourself")
    return EmbedArgs(inputs, field, msg.normalize if msg.HasField("normalize") else None,
                     msg.dimensions or None, prefix or None, msg.truncate if msg.HasField("truncate") else True)


def _checked_ids(i: int, ids, vocab: int) -> list[int]:
    if not ids:
        raise ValueError(f"token_ids[{i}]: must hold at least one token id")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"token_ids[{i}]: token id {bad} is outside the vocabulary [0, {vocab})")
    return list(ids)


def _prefix(msg: pb.EmbedRequest, model: EmbeddingModel) -> str:
    if msg.HasField("prefix"):
        return msg.prefix
    query, document = prefixes(model)
    kinds = {pb.EMBED_INPUT_TYPE_UNSPECIFIED: "", pb.EMBED_INPUT_TYPE_QUERY: query,
             pb.EMBED_INPUT_TYPE_DOCUMENT: document}
    if msg.input_type not in kinds:
        raise ValueError(f"input_type: {msg.input_type} is not one of UNSPECIFIED, DOCUMENT, QUERY")
    return kinds[msg.input_type]


def check_truncation(args: EmbedArgs, result: EmbedResult, max_length: int) -> None:
    if args.truncate:
        return
    cut = next((i for i, t in enumerate(result.truncated) if t), None)
    if cut is not None:
        raise ValueError(f"{args.field}[{cut}]: longer than the embedding model's max length of {max_length} "
                         "tokens (truncate is false)")


def embed_to_proto(result: EmbedResult, model_name: str) -> pb.EmbedResponse:
    msg = pb.EmbedResponse(model=model_name)
    for i, (vec, n, cut) in enumerate(zip(result.vectors, result.token_counts, result.truncated)):
        msg.embeddings.add(values=vec, index=i, num_tokens=n, truncated=cut)
    msg.usage.prompt_tokens = result.total_tokens
    return msg


def rerank_from_proto(msg: pb.RerankRequest) -> RerankArgs:
    top_n = msg.top_n if msg.HasField("top_n") else None
    if msg.pairs:
        if msg.query or msg.documents:
            raise ValueError("pairs: cannot be combined with query or documents")
        if top_n is not None:
            raise ValueError("top_n: applies to query + documents only; pairs are scored in input order")
        pairs = []
        for i, p in enumerate(msg.pairs):
            for name in ("query", "document"):
                if not getattr(p, name):
                    raise ValueError(f"pairs[{i}].{name}: must be a non-empty string")
            pairs.append((p.query, p.document))
        return RerankArgs(pairs, "", [], None, msg.return_documents)
    if not msg.query:
        raise ValueError("query: must be a non-empty string (or give pairs)")
    if not msg.documents:
        raise ValueError("documents: must hold at least one document")
    bad = next((i for i, d in enumerate(msg.documents) if not d), None)
    if bad is not None:
        raise ValueError(f"documents[{bad}]: must be a non-empty string")
    if top_n is not None and top_n < 1:
        raise ValueError(f"top_n: must be >= 1, got {top_n}")
    return RerankArgs(None, msg.query, list(msg.documents), top_n, msg.return_documents)


def run_rerank(emb: EmbeddingEngine, args: RerankArgs) -> pb.RerankResponse:
    """Score on the embedding worker thread and build the response (all scores in request order;
    results sorted and cut at top_n for query + documents, in input order for pairs)."""
    if args.pairs is not None:
        scored = emb.score_pairs(args.pairs)
        ranked, docs, total = list(enumerate(scored.scores)), [d for _, d in args.pairs], scored.total_tokens
    else:
        res = emb.rerank(args.query, args.documents)          # every document, best first
        ranked, docs, total = res.results, args.documents, res.total_tokens
    scores = [0.0] * len(ranked)
    for i, score in ranked:
        scores[i] = score
    model = emb.rerank_model if emb.rerank_model is not None else emb.model
    msg = pb.RerankResponse(scores=scores, method=emb.rerank_method, model=model.name if model else "")
    for i, score in ranked[:args.top_n]:
        msg.results.add(index=i, score=score, document=docs[i] if args.return_documents else "")
    msg.usage.prompt_tokens = total
    return msg


def embedding_info(emb: EmbeddingEngine | None) -> tuple[set[str], dict]:
    """(capabilities, ModelInfo fields) of the embedding side."""
    if emb is None:
        return set(), {}
    caps, fields = {"rerank"}, {"rerank_method": emb.rerank_method}
    if emb.rerank_model is not None:
        fields["rerank_model"] = emb.rerank_model.name
    if emb.model is not None:
        m = emb.model
        query, document = prefixes(m)
        caps.add("embeddings")
        fields |= dict(embedding_model=m.name, embedding_dimension=m.hidden_size, embedding_max_length=m.max_length,
                       embedding_normalize=m.sentence.normalize, embedding_query_prefix=query,
                       embedding_document_prefix=document)
    return caps, fields
