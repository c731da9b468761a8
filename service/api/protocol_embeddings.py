"""The /v1/embeddings request and response as pydantic models (OpenAI's shapes, with vLLM's extras)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from sluice.service.api.protocol_models import (
    INT32,
    CacheSalt,
    SamplingRequest,
    Strict,
    Text,
    TokenIds,
    _prompt_kind,
    list_of,
    one_of,
)

EmbeddingInput = one_of(
    _prompt_kind, "must be a non-empty string, list of strings, list of token ids or list of token-id lists",
    text=Text, texts=list_of(Text, min_length=1), ids=TokenIds, batch=list_of(TokenIds, min_length=1))


class EmbeddingRequest(Strict):
    """A /v1/embeddings body."""

    input: EmbeddingInput = Field(description="A string, a list of strings, a list of token ids or a list of lists "
                                  "of them; one vector each; at most the server's --max-embedding-inputs (128 by "
                                  "default).")
    model: str | None = Field(None, description="The served model name, or a LoRA adapter's (see /v1/models): the "
                              "vectors are that adapter's; optional.")
    encoding_format: Literal["float", "base64"] | None = Field(
        "float", description="float: lists of numbers; base64: each vector's little-endian float32 bytes, base64.")
    dimensions: int | None = Field(None, ge=1, lt=INT32, description=(
        "Matryoshka models: keep the first this many components (then normalize); refused where the model does "
        "not allow it (--embedding-dimensions)."))
    truncate_prompt_tokens: int | None = Field(None, ge=-1, lt=INT32, description=(
        "vLLM's extra: keep only the last this many tokens of each input (-1: as many as the context holds); "
        "without it a longer input is refused."))
    add_special_tokens: bool | None = Field(True, description="Let the tokenizer add its special tokens to text.")
    priority: int | None = Field(0, ge=-INT32, le=INT32 - 1, description="Scheduling priority under "
                                 "--scheduling-policy priority: lower is served first.")
    cache_salt: CacheSalt | None = SamplingRequest.model_fields["cache_salt"]  # as completions declare it
    user: str | None = Field(None, description="End-user id (accepted, not used).")


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="The vector, or its float32 bytes in base64.")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
