"""The Responses API (`POST /v1/responses`) as pydantic models: the request body that validates and describes
it, and the response object and stream events /openapi.json describes (the server writes dicts, responses.py).

The request follows protocol_models.py's rules: strict JSON types, unknown fields ignored, bounds as field
constraints. vLLM's sampling extras that make sense here (top_k, seed, stop, ...) are declared by taking the
chat body's own fields, so their bounds have one source.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, create_model

from sluice.service.api.protocol_models import (
    INT32,
    MAX_MESSAGES,
    ChatCompletionRequest,
    FunctionName,
    JsonSchema,
    Strict,
    _kind,
    list_of,
    one_of,
    whole,
)
from sluice.service.api.tools import MAX_TOOLS

MAX_METADATA = 16  # OpenAI's: key/value pairs
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
# vLLM's extras the Responses body takes too, declared as the chat body declares them
EXTRAS = ("top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "priority", "cache_salt", "chat_template_kwargs")


class InputText(Strict):
    """A text content part: input_text (from the user), output_text (an earlier reply), refusal."""

    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    @property
    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


Content = one_of(_kind, "must be a string or a list of content parts", str=str, list=list_of(InputText))


class MessageItem(Strict):
    """A message of the conversation; `type` may be left out."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(Strict):
    """A call the model made earlier (an item of an earlier response's output)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="The arguments as JSON text.")


class FunctionCallOutputItem(Strict):
    """The result of an earlier call."""

    type: Literal["function_call_output"]
    call_id: str
    output: Content


class ReasoningContent(Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Strict):
    """An earlier reply's thinking: accepted and left out of the prompt, as chat templates drop past thinking."""

    type: Literal["reasoning"]
    content: list_of(ReasoningContent) | None = None


class UnknownItem(Strict):
    """Any other item type: refused by its `type` (item_reference would need stored responses)."""

    type: Literal[ITEM_TYPES]


def _item_kind(v) -> str | None:
    if not isinstance(v, dict):
        return None
    kind = v.get("type", "message")
    return ITEM_TAGS.get(kind, "unknown")


ITEM_TAGS = {"message": "msg", "function_call": "function_call", "function_call_output": "function_call_output",
             "reasoning": "reasoning"}  # one_of's own argument is named `message`
Item = one_of(_item_kind, "must be an input item object", msg=MessageItem, function_call=FunctionCallItem,
              function_call_output=FunctionCallOutputItem, reasoning=ReasoningItem, unknown=UnknownItem)
Input = one_of(_kind, "must be a string or a list of input items", str=str,
               list=list_of(Item, max_length=MAX_MESSAGES))


class FunctionTool(Strict):
    """A function the model may call (flat: no `function` object, unlike chat)."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: JsonSchema | None = Field(None, description="JSON schema of the arguments (an object).")
    strict: bool | None = None


class NamedTool(Strict):
    type: Literal["function"]
    name: FunctionName


ToolChoice = one_of(_kind, "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                    str=Literal["none", "auto", "required"], dict=NamedTool)


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: JsonSchema | None = Field(None, alias="schema", description="json_schema: the reply's JSON schema.")
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = Field(None, description="text; json_object; json_schema {name, schema, strict}.")


Setting = Annotated[str, Field(max_length=32)]


class ReasoningConfig(Strict):
    """OpenAI's reasoning options: accepted and echoed, not used. Values are short strings (new ones keep coming:
    they are not checked against a list); other keys are dropped, so the echo is a few bytes whatever is sent."""

    effort: Setting | None = Field(None, description="none, minimal, low, medium, high, ...")
    summary: Setting | None = Field(None, description="auto, concise, detailed")
    generate_summary: Setting | None = Field(None, description="Older spelling of summary.")


Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     whole(f"maps at most {MAX_METADATA} keys of up to 64 characters to strings of up to 512",
                           MAX_METADATA)]


class _ResponsesBase(Strict):
    model: str | None = Field(None, description="The served model name (see /v1/models); optional.")
    input: Input = Field(description="A string (one user message) or a list of items: messages, function_call "
                                     "and function_call_output items of earlier turns, reasoning items (ignored).")
    instructions: str | None = Field(None, description="A system message put before the input.")
    tools: list_of(FunctionTool, max_length=MAX_TOOLS) | None = Field(None, description="Function tools.")
    tool_choice: ToolChoice | None = Field(None, description=(
        "none, auto (the default with tools), required (grammar-enforced) or {type: function, name}."))
    parallel_tool_calls: bool | None = Field(True, description="Allow several calls in one reply.")
    text: TextConfig | None = Field(None, description="`format`: structured outputs for the reply.")
    max_output_tokens: int | None = Field(None, ge=1, le=INT32, description=(
        "Most tokens to generate, thinking included (default: what the context leaves)."))
    temperature: float | None = ChatCompletionRequest.model_fields["temperature"]
    top_p: float | None = ChatCompletionRequest.model_fields["top_p"]
    stream: bool | None = Field(False, description="Stream the spec's Server-Sent Events.")
    store: bool | None = Field(None, description="Accepted; nothing is stored (the endpoint is stateless).")
    previous_response_id: str | None = Field(None, description="Not supported (nothing is stored): a 400.")
    conversation: Any = Field(None, description="Not supported (nothing is stored): a 400.")
    background: bool | None = Field(None, description="Only false: a background response would need storing.")
    reasoning: ReasoningConfig | None = Field(None, description="Accepted (effort, summary), echoed, not used.")
    include: list_of(str, max_length=32) | None = Field(None, description="Accepted, not used.")
    truncation: Literal["auto", "disabled"] | None = Field(None, description="Accepted; prompts are never cut.")
    metadata: Metadata | None = Field(None, description="Echoed in the response.")
    user: str | None = Field(None, description="End-user id (accepted, not used).")


ResponsesRequest = create_model(
    "ResponsesRequest", __base__=_ResponsesBase, __doc__="A /v1/responses body.",
    **{name: (ChatCompletionRequest.model_fields[name].annotation, ChatCompletionRequest.model_fields[name])
       for name in EXTRAS})


# ---- what the server answers (responses.py writes these as dicts) ---------------------------------------

class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list = Field(description="Always empty.")
    logprobs: list = Field(description="Always empty.")


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCall(BaseModel):
    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class Reasoning(BaseModel):
    """With --reasoning-parser: the reply's thinking."""

    id: str
    type: Literal["reasoning"]
    summary: list = Field(description="Always empty.")
    content: list[ReasoningContent]
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")
    cache_write_tokens: int = Field(description="Always 0: no prompt cache is billed.")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    """A /v1/responses reply; streamed, the `response.*` events carry it (status in_progress, then final)."""

    id: str = Field(description="resp_...")
    object: Literal["response"]
    created_at: int = Field(description="Unix seconds.")
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: IncompleteDetails | None
    error: None
    model: str
    output: list[Reasoning | OutputMessage | FunctionCall]
    usage: ResponseUsage | None
    instructions: str | None
    tools: list[dict]
    tool_choice: str | dict
    parallel_tool_calls: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None
    text: dict
    reasoning: dict | None
    metadata: dict
    user: str | None
    store: bool
    previous_response_id: None
    truncation: str


class StreamEvent(BaseModel):
    """One Server-Sent Event of a streamed reply (`event:` is its type): response.created, response.in_progress,
    response.output_item.added/.done, response.content_part.added/.done, response.output_text.delta/.done,
    response.reasoning_text.delta/.done, response.function_call_arguments.delta/.done, then
    response.completed or response.incomplete; or `error`."""

    type: str
    sequence_number: int
