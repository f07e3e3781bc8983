"""Embeddings and reranking with BERT-family encoders, outside the generation step loop.

``EmbeddingEngine.embed`` tokenizes (truncating at the model's max length), sorts the inputs by
length, cuts them into batches whose padded size ``batch × longest`` stays within a token
budget, runs the encoder, pools as the model's sentence-transformers config says (mean / cls /
max, then normalisation when listed), and returns the vectors in the caller's order.

``rerank`` / ``score_pairs`` use a cross-encoder when one is given (sigmoid of a one-label head,
softmax's positive class of a two-label head), else the cosine similarity of the embedding
model's vectors; ``rerank_method`` says which.

Calls are pure functions of their inputs: the models and tokenizers are only read (the
tokenizer's truncation is set once at load time), so a worker thread may call them while
another thread does the same.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sluice.engine.errors import UnsupportedError
from sluice.engine.loaders.bert_loader import EmbeddingModel

DEFAULT_MAX_BATCH_TOKENS = 8192
CROSS_ENCODER, EMBEDDING_COSINE = "cross-encoder", "embedding-cosine"

Inputs = str | Sequence[str] | Sequence[Sequence[int]]


@dataclass(frozen=True)
class EmbedResult:
    vectors: list[list[float]]
    token_counts: list[int]        # tokens the model saw per input, special tokens included
    truncated: list[bool]          # whether the input was cut at the model's max length

    @property
    def total_tokens(self) -> int:
        return sum(self.token_counts)


@dataclass(frozen=True)
class ScoreResult:
    scores: list[float]            # one per (query, document) pair, in input order
    total_tokens: int


@dataclass(frozen=True)
class RerankResult:
    results: list[tuple[int, float]]     # (document index, score), best first, at most top_n
    documents: list[str] | None          # the documents of ``results`` when asked for
    total_tokens: int
    method: str


@dataclass(frozen=True)
class _Encoded:
    ids: list[int]
    type_ids: list[int]
    truncated: bool


def length_batches(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices grouped longest first so that ``len(batch) × longest`` ≤ the budget (a lone input
    longer than the budget still gets a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    # hidden [B, S, H] (any dtype), mask [B, S] → [B, H] float32
    hidden = hidden.float()
    if mode == "cls":
        return hidden[:, 0]
    m = mask.unsqueeze(-1).to(hidden.dtype)                                          # [B, S, 1]
    if mode == "max":
        return hidden.masked_fill(m == 0, -1e9).max(dim=1).values
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)                   # mean


class EmbeddingEngine:
    def __init__(self, model: EmbeddingModel | None, rerank_model: EmbeddingModel | None = None,
                 max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS) -> None:
        if model is None and rerank_model is None:
            raise ValueError("model: an embedding model or a rerank model is required")
        if model is not None and model.is_cross_encoder:
            raise ValueError(f"model: {model.path} is a cross-encoder; pass it as rerank_model")
        if rerank_model is not None and rerank_model.config.num_labels not in (1, 2):
            raise ValueError(f"rerank_model: {rerank_model.path} is not a cross-encoder with a one- or "
                             f"two-label head (num_labels={rerank_model.config.num_labels})")
        if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens: must be a positive integer, got {max_batch_tokens!r}")
        self.model, self.rerank_model, self.max_batch_tokens = model, rerank_model, max_batch_tokens

    @property
    def rerank_method(self) -> str:
        return CROSS_ENCODER if self.rerank_model is not None else EMBEDDING_COSINE

    # ---- embeddings -------------------------------------------------------------------------

    def embed(self, inputs: Inputs, normalize: bool | None = None, dimensions: int | None = None,
              prefix: str | None = None) -> EmbedResult:
        model = self._embedding_model()
        if normalize is not None and not isinstance(normalize, bool):
            raise ValueError(f"normalize: must be true, false or null, got {normalize!r}")
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                       or not 1 <= dimensions <= model.hidden_size):
            raise ValueError(f"dimensions: must be an integer in [1, {model.hidden_size}], got {dimensions!r}")
        encoded = self._encode_inputs(model, inputs, prefix)
        vectors = self._pooled(model, encoded)                                      # [N, H] float32
        if dimensions is not None:
            vectors = vectors[:, :dimensions]                                       # Matryoshka cut
        if model.sentence.normalize if normalize is None else normalize:
            vectors = F.normalize(vectors, p=2, dim=-1)
        return EmbedResult(vectors=vectors.tolist(), token_counts=[len(e.ids) for e in encoded],
                           truncated=[e.truncated for e in encoded])

    def _embedding_model(self) -> EmbeddingModel:
        if self.model is None:
            raise UnsupportedError("embeddings: this engine serves no embedding model")
        return self.model

    def _encode_inputs(self, model: EmbeddingModel, inputs: Inputs, prefix: str | None) -> list[_Encoded]:
        if isinstance(inputs, str):
            inputs = [inputs]
        if not isinstance(inputs, Sequence) or len(inputs) == 0:
            raise ValueError("input: must be a non-empty list of strings or of token-id lists")
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError(f"prefix: must be a string, got {type(prefix).__name__}")
        if all(isinstance(x, str) for x in inputs):
            return self._encode_texts(model, list(inputs), prefix or "")
        if prefix:
            raise ValueError("prefix: cannot be applied to token-id inputs; add its tokens yourself")
        return [self._check_ids(model, i, ids) for i, ids in enumerate(inputs)]

    @staticmethod
    def _encode_texts(model: EmbeddingModel, texts: list[str], prefix: str) -> list[_Encoded]:
        for i, text in enumerate(texts):
            if not text:
                raise ValueError(f"input[{i}]: must be a non-empty string")
        encodings = model.tokenizer.encode_batch([prefix + t for t in texts])
        return [_Encoded(e.ids, e.type_ids, bool(e.overflowing)) for e in encodings]

    @staticmethod
    def _check_ids(model: EmbeddingModel, i: int, ids: object) -> _Encoded:
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise ValueError(f"input[{i}]: must be all strings or all token-id lists, got {type(ids).__name__}")
        if len(ids) == 0:
            raise ValueError(f"input[{i}]: must be a non-empty list of token ids")
        vocab = model.config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"input[{i}]: token id {t!r} is outside the vocabulary [0, {vocab})")
        # Token ids are the model input as given (no [CLS]/[SEP] added): `encode(text).ids` round-trips.
        kept = list(ids[: model.max_length])
        return _Encoded(kept, [0] * len(kept), len(ids) > model.max_length)

    def _pooled(self, model: EmbeddingModel, encoded: list[_Encoded]) -> torch.Tensor:
        out = torch.empty(len(encoded), model.hidden_size)                          # [N, H]
        for index, hidden, mask in self._run(model, encoded):
            out[index] = pool(hidden, mask, model.sentence.pooling).cpu()
        return out

    def _run(self, model: EmbeddingModel, encoded: list[_Encoded]):
        """Yield (indices [B], last hidden states [B, S, H], attention mask [B, S]) per batch."""
        batches = length_batches([len(e.ids) for e in encoded], self.max_batch_tokens)
        for batch in batches:
            ids, type_ids, mask = self._pad(model, [encoded[i] for i in batch])
            with torch.inference_mode():
                hidden = model.encoder(ids, mask, type_ids)                          # [B, S, H]
            yield torch.tensor(batch), hidden, mask

    @staticmethod
    def _pad(model: EmbeddingModel, items: list[_Encoded]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(e.ids) for e in items)
        pad = model.config.pad_token_id
        ids = torch.tensor([e.ids + [pad] * (width - len(e.ids)) for e in items])           # [B, S]
        type_ids = torch.tensor([e.type_ids + [0] * (width - len(e.ids)) for e in items])   # [B, S]
        mask = torch.tensor([[1] * len(e.ids) + [0] * (width - len(e.ids)) for e in items])  # [B, S]
        return ids.to(model.device), type_ids.to(model.device), mask.to(model.device)

    # ---- reranking --------------------------------------------------------------------------

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> ScoreResult:
        """Relevance of each (query, document) pair, in input order."""
        if not isinstance(pairs, Sequence) or len(pairs) == 0:
            raise ValueError("inputs: must be a non-empty list of [query, document] pairs")
        for i, pair in enumerate(pairs):
            if (isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2
                    or not all(isinstance(x, str) and x for x in pair)):
                raise ValueError(f"inputs[{i}]: must be a [query, document] pair of non-empty strings")
        if self.rerank_model is not None:
            return self._cross_scores(self.rerank_model, [(q, d) for q, d in pairs])
        return self._cosine_scores(self._embedding_model(), [(q, d) for q, d in pairs])

    def rerank(self, query: str, documents: Sequence[str], top_n: int | None = None,
               return_documents: bool = False) -> RerankResult:
        if not isinstance(query, str) or not query:
            raise ValueError("query: must be a non-empty string")
        if isinstance(documents, str) or not isinstance(documents, Sequence) or len(documents) == 0:
            raise ValueError("documents: must be a non-empty list of strings")
        for i, doc in enumerate(documents):
            if not isinstance(doc, str) or not doc:
                raise ValueError(f"documents[{i}]: must be a non-empty string")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
            raise ValueError(f"top_n: must be a positive integer, got {top_n!r}")
        scored = self.score_pairs([(query, d) for d in documents])
        ranked = sorted(enumerate(scored.scores), key=lambda p: -p[1])[:top_n]    # stable on ties
        docs = [documents[i] for i, _ in ranked] if return_documents else None
        return RerankResult(results=ranked, documents=docs, total_tokens=scored.total_tokens,
                            method=self.rerank_method)

    def _cross_scores(self, model: EmbeddingModel, pairs: list[tuple[str, str]]) -> ScoreResult:
        encodings = model.tokenizer.encode_batch(pairs)
        encoded = [_Encoded(e.ids, e.type_ids, bool(e.overflowing)) for e in encodings]
        scores = torch.empty(len(encoded))                                          # [N]
        for index, hidden, _mask in self._run(model, encoded):
            with torch.inference_mode():
                logits = model.encoder.classify(hidden).float()                    # [B, L]
            probs = torch.sigmoid(logits[:, 0]) if logits.shape[1] == 1 else logits.softmax(-1)[:, 1]
            scores[index] = probs.cpu()
        return ScoreResult(scores.tolist(), sum(len(e.ids) for e in encoded))

    def _cosine_scores(self, model: EmbeddingModel, pairs: list[tuple[str, str]]) -> ScoreResult:
        # Asymmetric models name their prompts ("query: " / "passage: "); MiniLM has none.
        prompts = model.sentence.prompts
        q_prefix = prompts.get("query", "")
        d_prefix = prompts.get("document", prompts.get("passage", ""))
        queries = list(dict.fromkeys(q for q, _ in pairs))
        docs = list(dict.fromkeys(d for _, d in pairs))
        q_res = self.embed(queries, normalize=True, prefix=q_prefix)
        d_res = self.embed(docs, normalize=True, prefix=d_prefix)
        q_vec = dict(zip(queries, torch.tensor(q_res.vectors)))
        d_vec = dict(zip(docs, torch.tensor(d_res.vectors)))
        scores = [float(q_vec[q] @ d_vec[d]) for q, d in pairs]
        return ScoreResult(scores, q_res.total_tokens + d_res.total_tokens)
