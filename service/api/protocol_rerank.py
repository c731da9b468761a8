"""The /v1/rerank and /v1/score requests and replies as pydantic models (vLLM's shapes: Jina's and Cohere's rerank,
vLLM's score)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from sluice.service.api.protocol_models import (
    INT32,
    CacheSalt,
    SamplingRequest,
    Strict,
    Text,
    _kind,
    list_of,
    one_of,
)

MAX_INSTRUCTION = 4096  # characters of a request's `instruction`

Texts = one_of(_kind, "must be a string or a non-empty list of strings", str=str, list=list_of(str, min_length=1))


class _ScoringRequest(Strict):
    """What both routes share."""

    model: str | None = Field(None, description="The served model name, or a LoRA adapter's (see /v1/models); "
                              "optional.")
    instruction: str | None = Field(None, min_length=1, max_length=MAX_INSTRUCTION, description=(
        "Qwen3-Reranker's <Instruct> line (default: 'Given a web search query, retrieve relevant passages that "
        "answer the query')."))
    priority: int | None = Field(0, ge=-INT32, le=INT32 - 1, description="Scheduling priority under "
                                 "--scheduling-policy priority: lower is served first.")
    cache_salt: CacheSalt | None = SamplingRequest.model_fields["cache_salt"]  # as completions declare it
    user: str | None = Field(None, description="End-user id (accepted, not used).")


class RerankRequest(_ScoringRequest):
    """A /v1/rerank (/rerank, /v2/rerank) body."""

    query: Text = Field(description="What the documents are ranked against.")
    documents: list_of(str, min_length=1) = Field(description=(
        "The texts to rank; each is one prompt-only engine request (the query's prefix is shared through the prefix "
        "cache); at most the server's --max-embedding-inputs (128 by default)."))
    top_n: int | None = Field(None, ge=0, lt=INT32, description="Return only the best this many (0 or absent: all).")
    return_documents: bool | None = Field(True, description="Echo each result's text as `document.text`.")


class ScoreRequest(_ScoringRequest):
    """A /v1/score body: text_1 against text_2, 1:1, 1:N or N:N (pairs in order)."""

    text_1: Texts | None = Field(None, description="The query, or one query per text_2 item (N:N).")
    text_2: Texts | None = Field(None, description="The document(s) scored against text_1.")
    queries: Texts | None = Field(None, description="Newer vLLM's name for text_1.")
    documents: Texts | None = Field(None, description="Newer vLLM's name for text_2.")


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int = Field(description="The document's place in the request's `documents`.")
    relevance_score: float = Field(description="Between 0 and 1: softmax of the yes/no logits, P(yes).")
    document: RerankDocument | None = None


class ScoringUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult] = Field(description="Best first.")
    usage: ScoringUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoringUsage
