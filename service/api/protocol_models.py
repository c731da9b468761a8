"""The OpenAI request bodies as pydantic models: the one declaration that validates them and describes them.

Strict where OpenAI is: a bool is not a number, an integer field takes no 1.0, NaN and the infinities are no
numbers. Every bound a request can push against is a field constraint here, so /openapi.json states it too.
Unknown fields are ignored, as vLLM ignores its clients' extras. Nested schemas (a tool's parameters, a
response_format schema) are typed as objects here and checked by tools.py and structured.py, which own their
depth and size bounds.

A union is tagged by the shape of its input (`one_of`), so a bad value gets one error at its own place
(`stop[2]`) instead of one error per member; the tags (`~...`) are left out when the place is rendered.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from sluice.service.api.structured import MAX_CHOICES as MAX_GUIDED_CHOICES
from sluice.service.api.tools import MAX_TOOLS

# What one request fans out to (n, the prompts of a list, embedding inputs) is bounded by the server's knobs
# (--max-n, --max-prompts-per-request, --max-embedding-inputs), checked in one place: protocol.RequestCaps.
MAX_STOP = 16  # stop strings per request
MAX_STOP_LEN = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # token ids in one logit_bias
MAX_TOKEN_LIST = 65536  # allowed_token_ids
MAX_MESSAGES = 4096
MAX_CACHE_SALT = 256
MAX_TEMPLATE_KWARGS = 32  # keys of chat_template_kwargs
INT32 = 2**31
INT64 = 2**63
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
TAGS: set[str] = set()  # the union tags one_of adds to an error's location


def one_of(choose, message: str, **members) -> Any:
    """A union whose member `choose(value)` names (None: `message`); members are given as `tag=type`."""
    TAGS.update(f"~{name}" for name in members)
    tagged = tuple(Annotated[t, Tag(f"~{name}")] for name, t in members.items())

    def pick(v):
        name = choose(v)
        return None if name is None else f"~{name}"

    return Annotated[Union[tagged], Discriminator(pick, custom_error_type="invalid_type",  # noqa: UP007
                                                   custom_error_message=message)]


def whole(message: str, max_length: int) -> WrapValidator:
    """Report any error inside a map at the map itself (its keys are data, not names); one past `max_length` is
    refused before its items are looked at, as a list's first bad item ends its validation."""
    def wrap(v, handler):
        if isinstance(v, dict) and len(v) > max_length:
            raise PydanticCustomError("invalid_value", message)
        try:
            return handler(v)
        except ValidationError:
            raise PydanticCustomError("invalid_value", message) from None
    return WrapValidator(wrap)


def _kind(v) -> str | None:
    if isinstance(v, str):
        return "str"
    if isinstance(v, list):
        return "list"
    if isinstance(v, dict):
        return "dict"
    return None


def _prompt_kind(v) -> str | None:
    """A prompt's form, from its first element: text, texts, one token list, or a batch of token lists."""
    if isinstance(v, str):
        return "text"
    if not isinstance(v, list):
        return None
    first = v[0] if v else ""
    return "batch" if isinstance(first, list) else "texts" if isinstance(first, str) else "ids"


class Strict(BaseModel):
    """OpenAI's JSON types, strictly; unknown fields are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    def get(self, name: str):
        """The field's value, or its declared default when the client sent null."""
        v = getattr(self, name)
        return type(self).model_fields[name].default if v is None else v


def list_of(item, **bounds) -> Any:
    """A list that stops at its first bad item: a body's cost on the error path is bounded by its fields, not
    by the length of a list."""
    return Annotated[list[item], Field(fail_fast=True, **bounds)]


TokenId = Annotated[int, Field(ge=0, lt=INT32)]
TokenIds = list_of(TokenId, min_length=1)
Text = Annotated[str, Field(min_length=1)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]
Stop = one_of(_kind, "must be a string or a list of strings", str=StopText,
              list=list_of(StopText, max_length=MAX_STOP))
Prompt = one_of(_prompt_kind, "must be a non-empty string, list of strings, or list of token ids",
                text=Text, texts=list_of(Text, min_length=1), ids=TokenIds, batch=list_of(TokenIds, min_length=1))
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT)]


def _token_key(key: str) -> str:
    if int(key) >= INT32:
        raise ValueError("not a token id")
    return key


TokenKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$"), AfterValidator(_token_key)]
LogitBias = Annotated[dict[TokenKey, Annotated[float, Field(ge=-100, le=100)]],
                      Field(max_length=MAX_LOGIT_BIAS),
                      whole(f"maps at most {MAX_LOGIT_BIAS} token ids (as strings) to numbers between -100 and 100",
                            MAX_LOGIT_BIAS)]
JsonSchema = dict[str, Any]  # checked by structured.py / tools.py: depth, size, keywords, the meta-schema
SchemaOrText = one_of(_kind, "must be a JSON schema object or its JSON text", dict=JsonSchema, str=str)


def _range(lo, hi, default, doc: str, **more):
    return Field(default, ge=lo, le=hi, description=doc, **more)


class StreamOptions(Strict):
    include_usage: bool | None = Field(False, description="Send a last chunk with the usage and no choices.")


class JsonSchemaFormat(Strict):
    name: str | None = None
    description: str | None = None
    schema_: JsonSchema = Field({"type": "object"}, alias="schema", description="The reply's JSON schema.")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's constraint: exactly one of its fields."""

    json_: SchemaOrText | None = Field(None, alias="json", description="A JSON schema.")
    regex: Text | None = None
    choice: list_of(Text, min_length=1, max_length=MAX_GUIDED_CHOICES) | None = None
    grammar: Text | None = Field(None, description="EBNF, in xgrammar's dialect.")
    json_object: bool | None = Field(None, description="true: any JSON object.")


class SamplingRequest(Strict):
    """The fields both endpoints share."""

    model: str | None = Field(None, description="The served model name (see /v1/models); optional.")
    n: int | None = Field(1, ge=1, description="Independent samples of the prompt (they share its KV cache blocks); "
                          "at most the server's --max-n (16 by default).")
    best_of: int | None = Field(None, ge=1, description="Must equal n when given.")
    temperature: float | None = _range(0.0, 2.0, 1.0, "Sampling temperature; 0 is greedy.")
    top_p: float | None = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass, in (0, 1].")
    top_k: int | None = _range(-1, INT32, 0, "Keep the k most likely tokens; 0 or -1 disables.")
    min_p: float | None = _range(0.0, 1.0, 0.0, "Drop tokens below min_p times the top probability.")
    seed: int | None = _range(-INT64, INT64 - 1, None, "Seed for reproducible sampling; choice i of n uses seed + i.")
    stop: Stop | None = Field(None, description="Stop strings: the output ends before the first one (not included).")
    stop_token_ids: list_of(TokenId, max_length=MAX_STOP_TOKEN_IDS) | None = Field(
        None, description="Token ids that end the output.")
    ignore_eos: bool | None = Field(False, description="Keep going past EOS.")
    min_tokens: int | None = _range(0, INT32, 0, "Tokens to generate before EOS or stop token ids may end the output.")
    include_stop_str_in_output: bool | None = False
    presence_penalty: float | None = _range(-2.0, 2.0, 0.0, "OpenAI: subtracted once from every token already "
                                            "generated.")
    frequency_penalty: float | None = _range(-2.0, 2.0, 0.0, "OpenAI: subtracted per occurrence of a token in the "
                                             "output.")
    repetition_penalty: float | None = Field(1.0, gt=0.0, le=100.0, description=(
        "vLLM/transformers: seen tokens (prompt and output) have positive logits divided, negative ones multiplied "
        "by it."))
    logit_bias: LogitBias | None = Field(None, description="Token id (as a string) to a bias added to its logit; "
                                         "-100 bans, 100 forces.")
    allowed_token_ids: list_of(TokenId, min_length=1, max_length=MAX_TOKEN_LIST) | None = Field(
        None, description="Only these token ids may be generated.")
    bad_words: list_of(StopText, max_length=MAX_STOP) | None = Field(
        None, description="Words never generated (their last token is banned after the rest of them).")
    skip_special_tokens: bool | None = True
    cache_salt: CacheSalt | None = Field(
        None, description="Prefix-cache isolation: cached blocks are shared only among requests with the same "
                          "salt (e.g. one per tenant).")
    response_format: ResponseFormat | None = Field(None, description=(
        "text; json_object (any JSON object); json_schema {name, schema, strict}: the reply is constrained to the "
        "schema (grammar-constrained decoding)."))
    structured_outputs: StructuredOutputs | None = Field(None, description=(
        "vLLM's extra: exactly one of json (a schema), regex, choice (a list of strings), grammar (EBNF, "
        "xgrammar's dialect), json_object (true)."))
    guided_json: SchemaOrText | None = Field(None, description="Older spelling of structured_outputs.json.")
    guided_regex: Text | None = Field(None, description="Older spelling of structured_outputs.regex.")
    guided_choice: list_of(Text, min_length=1, max_length=MAX_GUIDED_CHOICES) | None = Field(
        None, description="Older spelling of structured_outputs.choice.")
    guided_grammar: Text | None = Field(None, description="Older spelling of structured_outputs.grammar.")
    stream: bool | None = Field(False, description="Stream Server-Sent Events.")
    stream_options: StreamOptions | None = Field(None, description="Only with stream: true.")
    priority: int | None = _range(-INT32, INT32 - 1, 0, "Scheduling priority under --scheduling-policy priority: "
                                  "lower is served first; FCFS among equals.")
    user: str | None = Field(None, description="End-user id (accepted, not used).")


class CompletionRequest(SamplingRequest):
    """A /v1/completions body."""

    prompt: Prompt = Field(description="A string, a list of strings, a list of token ids or a list of lists of them; "
                           "prompts times n at most the server's --max-prompts-per-request (64 by default).")
    max_tokens: int | None = _range(1, INT32, 16, "Most tokens to generate; prompt + max_tokens must fit the context.")
    logprobs: int | None = _range(0, MAX_LOGPROBS, None, "Return the sampled token's logprob and this many "
                                  "alternatives.")
    echo: bool | None = Field(False, description="Start the reply with the prompt's text (not with logprobs).")
    suffix: None = Field(None, description="Not supported.")


# ---- chat ---------------------------------------------------------------------------------------------

class TextPart(Strict):
    type: Literal["text"]
    text: str


Content = one_of(_kind, "must be a string or a list of content parts", str=str, list=list_of(TextPart))


Arguments = one_of(_kind, "must be a JSON string", str=str, dict=dict[str, Any])


class HistoryFunction(Strict):
    name: str
    arguments: Arguments = Field("{}", description="The arguments as JSON text.")


class HistoryCall(Strict):
    """A call the assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: HistoryFunction


class Message(Strict):
    """One chat message: content is required except from the assistant; a tool message answers tool_call_id."""

    role: Literal[CHAT_ROLES]
    content: Content | None = None
    name: str | None = None
    tool_calls: list_of(HistoryCall) | None = Field(
        None, description="assistant: the calls it made (content may be null)."
    )
    tool_call_id: str | None = Field(None, description="tool: the call this result answers (required).")


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDef(Strict):
    name: FunctionName
    description: str | None = None
    parameters: JsonSchema | None = Field(None, description="JSON schema of the arguments (an object).")
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Strict):
    name: FunctionName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = one_of(_kind, "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                    "{\"name\": ...}}", str=Literal["none", "auto", "required"], dict=NamedToolChoice)


class ChatCompletionRequest(SamplingRequest):
    """A /v1/chat/completions body."""

    messages: list_of(Message, min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = _range(1, INT32, None, "Most tokens to generate (default: what the context leaves).")
    max_completion_tokens: int | None = _range(1, INT32, None, "Same as max_tokens; takes precedence.")
    logprobs: bool | None = False
    top_logprobs: int | None = _range(0, MAX_LOGPROBS, None, "Alternatives per token; needs logprobs: true.")
    tools: list_of(Tool, max_length=MAX_TOOLS) | None = Field(
        None, description="Functions the model may call.")
    tool_choice: ToolChoice | None = Field(None, description=(
        "none, auto (the default with tools), required (at least one call, grammar-enforced) or a named function "
        "(exactly that call). Only with tools."))
    parallel_tool_calls: bool | None = Field(True, description="Allow several calls in one reply.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS, description=(
        'Variables for the chat template, e.g. {"enable_thinking": false}; not messages, tools or '
        "add_generation_prompt."))
