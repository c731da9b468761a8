"""The response shapes as pydantic models: what /openapi.json describes and the tests check real replies against.

The server writes its replies as dicts with orjson (formatting.py), which is faster on the streaming path than
building models; these models are the description, and tests/api/test_protocol_models.py holds formatting.py to it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from sluice.scheduling.outcomes import FinishReason

FinishReasons = Literal[(*(str(r) for r in FinishReason), "tool_calls")]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="With --reasoning-parser: the tokens of the thinking.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """The legacy parallel arrays."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class _Head(BaseModel):
    id: str
    created: int = Field(description="Unix seconds.")
    model: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasons | None


class Completion(_Head):
    """A /v1/completions reply; streamed, its chunks have this shape with the text so far in pieces."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]
    usage: Usage | None = None


REASONING = "With --reasoning-parser: the thinking (`reasoning` is newer vLLM's name for the same text)."


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = Field(None, description=REASONING)
    reasoning: str | None = Field(None, description=REASONING)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasons | None


class ChatCompletion(_Head):
    """A /v1/chat/completions reply."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = Field(None, description=REASONING)
    reasoning: str | None = Field(None, description=REASONING)


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasons | None


class ChatCompletionChunk(_Head):
    """One `data:` event of a streamed chat reply; with include_usage, a last one has no choices and the usage."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = Field(description="The parameter at fault, as a path: messages[3].content, stop[2].")
    code: str | None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx; a stream that fails after its first event ends with one as its last `data:` event."""

    error: ErrorBody
