"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as pydantic models: the request
bodies, validated as Anthropic declares them before anthropic_request.py rewrites them as the chat request.

protocol_models.py's rules hold: strict JSON types, unknown fields ignored (as Anthropic's API ignores them:
`metadata`, `cache_control`, `citations`, `service_tier`, ...). The sampling fields take the chat body's own
declarations, so their bounds have one source. Content blocks are told apart by their `type`; a type the server
cannot serve (`image`, `document`, server tools' blocks) validates as UnsupportedBlock and is refused, naming the
block, when the request is translated.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from sluice.service.api.protocol_models import (
    INT32,
    MAX_MESSAGES,
    ChatCompletionRequest,
    JsonSchema,
    Strict,
    _kind,
    list_of,
    one_of,
)
from sluice.service.api.tools import MAX_TOOLS

BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request system block: no instructions in it


class TextBlock(Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(Strict):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict, description="The call's arguments.")


class UnsupportedBlock(Strict):
    """Any block type the server cannot read (image, document, search_result, server tools' blocks)."""

    type: str


def _result_part_kind(v) -> str | None:
    if not isinstance(v, dict):
        return None
    return "text" if v.get("type") == "text" else "other"


ResultPart = one_of(_result_part_kind, "must be a content block object", text=TextBlock, other=UnsupportedBlock)
ResultContent = one_of(_kind, "must be a string or a list of content blocks", str=str, list=list_of(ResultPart))


class ToolResultBlock(Strict):
    """The result of an earlier call (in a user message)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: ResultContent | None = None
    is_error: bool | None = Field(None, description="The call failed: its content is the error.")


class ThinkingBlock(Strict):
    """An earlier reply's thinking, echoed back by clients: accepted, left out of the prompt."""

    type: Literal["thinking", "redacted_thinking"]


BLOCK_TAGS = {"text": "text", "tool_use": "tool_use", "tool_result": "tool_result", "thinking": "thinking",
              "redacted_thinking": "thinking"}


def _block_kind(v) -> str | None:
    if not isinstance(v, dict):
        return None
    return BLOCK_TAGS.get(v.get("type"), "unsupported")


Block = one_of(_block_kind, "must be a content block object", text=TextBlock, tool_use=ToolUseBlock,
               tool_result=ToolResultBlock, thinking=ThinkingBlock, unsupported=UnsupportedBlock)
Content = one_of(_kind, "must be a string or a list of content blocks", str=str, list=list_of(Block))


class Message(Strict):
    role: Literal["user", "assistant"]
    content: Content


System = one_of(_kind, "must be a string or a list of text blocks", str=str, list=list_of(TextBlock))


class Tool(Strict):
    """A client tool; Anthropic's server tools (web_search, bash, ...) have a `type` of their own: refused."""

    type: str | None = Field(None, description="Absent or 'custom'.")
    name: str
    description: str | None = None
    input_schema: JsonSchema = Field(description="JSON schema of the input (an object).")


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, description="With type 'tool': the tool to call.")
    disable_parallel_tool_use: bool | None = Field(None, description="At most one call in the reply.")


class Thinking(Strict):
    """Extended thinking: 'enabled' / 'disabled' become the chat template's enable_thinking; budgets are not kept."""

    type: str


class _MessagesBase(Strict):
    model: str = Field(description="The served model name (see /v1/models).")
    messages: list_of(Message, min_length=1, max_length=MAX_MESSAGES)
    system: System | None = Field(None, description="A system prompt: a string or text blocks.")
    stop_sequences: list[str] | None = Field(None, description="Strings that end the reply (chat's `stop`).")
    temperature: float | None = ChatCompletionRequest.model_fields["temperature"]
    top_p: float | None = ChatCompletionRequest.model_fields["top_p"]
    top_k: int | None = ChatCompletionRequest.model_fields["top_k"]
    stream: bool | None = Field(False, description="Stream Anthropic's named Server-Sent Events.")
    tools: list_of(Tool, max_length=MAX_TOOLS) | None = Field(None, description="Client tools.")
    tool_choice: ToolChoice | None = Field(None, description="auto, any (a call is required), tool + name, none.")
    thinking: Thinking | None = None
    metadata: dict[str, Any] | None = Field(None, description="Accepted, not used.")


class MessagesRequest(_MessagesBase):
    """A /v1/messages body."""

    max_tokens: int = Field(ge=1, le=INT32, description="Most tokens to generate (required).")


class CountTokensRequest(_MessagesBase):
    """A /v1/messages/count_tokens body: a messages body without max_tokens."""

    max_tokens: int | None = Field(None, ge=1, le=INT32, description="Not needed; ignored.")
