"""Typed response models (pydantic v2): what each endpoint answers, whole and per streamed event;
the source of the 200 responses in ``/openapi.json`` (openapi.py), which schemathesis and
tests/unit/test_facade_openapi.py check real answers against. Requests: ``api_models``.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from sluice.http_facade.api_models import Document, ToolCallFunction


class _Out(BaseModel):
    """The fields sluice sends (a client must accept more in a later version)."""
    model_config = ConfigDict(extra="allow")


class ErrorBody(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    error: ErrorBody


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    capabilities: list[str]


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class PromptTokensDetails(_Out):
    cached_tokens: int


class CompletionTokensDetails(_Out):
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob] | None
    refusal: Any = None


class ToolCallOut(_Out):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class ChunkDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChunkChoice(_Out):
    index: int
    delta: ChunkDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(_Out):
    """One ``data:`` event of a streamed chat completion (then ``data: [DONE]``)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(_Out):
    """A whole completion, and also one ``data:`` event of a streamed one."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class EmbeddingUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingItem(_Out):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingList(_Out):
    object: Literal["list"]
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage


class RerankResult(_Out):
    index: int
    relevance_score: float
    document: Document | None = None


class RerankResponse(_Out):
    id: str
    model: str
    results: list[RerankResult]
    usage: EmbeddingUsage


class ScoreItem(_Out):
    index: int
    object: Literal["score"]
    score: float


class ScoreUsage(EmbeddingUsage):
    completion_tokens: int


class ScoreResponse(_Out):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreItem]
    usage: ScoreUsage


class TokenPiece(_Out):
    id: int
    piece: str | list[int] = Field(description="the token's text, or its byte values when they are "
                                               "not valid UTF-8 on their own")


class TokenizeResponse(_Out):
    tokens: list[int] | list[TokenPiece] = Field(description="ids; {id, piece} objects with with_pieces")
    count: int
    max_model_len: int
    prompt: str | None = Field(None, description="the rendered chat prompt (messages input only)")
    token_strs: list[str] | None = Field(None, description="each token's spelling (with return_token_strs)")


class DetokenizeResponse(_Out):
    prompt: str
    content: str


class OutputText(_Out):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any] | None = None


class OutputMessage(_Out):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(_Out):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(_Out):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed", "queued", "cancelled"]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    model: str
    instructions: str | None
    max_output_tokens: int | None
    previous_response_id: str | None
    output: list[Annotated[Union[OutputMessage, OutputFunctionCall], Field(discriminator="type")]]
    usage: ResponseUsage | None
    tools: list[Any]
    tool_choice: Any
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    metadata: dict[str, str]
    store: bool
    background: bool


class ResponseStreamEvent(_Out):
    """One event of a streamed response (``event: <type>``, then this object as ``data:``)."""
    type: Literal["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                  "response.content_part.done", "response.function_call_arguments.delta",
                  "response.function_call_arguments.done", "response.output_item.done", "response.completed",
                  "response.incomplete", "response.failed", "error"]
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item_id: str | None = None
    content_index: int | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None


class ResponseDeleted(_Out):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


# ---------------------------------------------------------------------- AFS (/models/...)
class AfsError(_Out):
    status_code: int
    error: str
    detail: str
    param: str | None


class AfsRecord(_Out):
    """An AFS generation answer, and every record of its stream (null / 0 until the last one)."""
    generated_text: str | None
    function_call: dict[str, Any] | None = None
    details: Any = None
    total_time_taken: str | None
    prompt_tokens: int | None
    generated_tokens: int | None
    total_tokens: int | None
    finish_reason: Literal["eos_token", "stop_sequence", "length", "function_call"] | None


class AfsUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class AfsEmbedding(_Out):
    embedding: list[float] | str
    index: int
    object: Literal["embedding"]


class AfsEmbeddings(_Out):
    data: list[AfsEmbedding]
    total_time_taken: str
    usage: AfsUsage


class AfsRerankResult(_Out):
    score: float
    index: int


class AfsRerank(_Out):
    """``scores`` (input order) for ``inputs`` pairs; ``results`` (best first) for query + documents."""
    scores: list[float] | None = None
    results: list[AfsRerankResult] | None = None
    total_time_taken: str
    usage: AfsUsage
