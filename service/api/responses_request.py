"""A /v1/responses body translated into the chat request the chat completions path builds.

The body is validated as the Responses API declares it (responses_models.py), then rewritten as a chat body:
`instructions` a system message, the input items messages (function_call items an assistant turn's tool_calls,
function_call_output items tool messages), flat function tools nested as chat nests them, `text.format` as
`response_format`, `max_output_tokens` as `max_tokens`. parse_chat and prepare_request then apply every rule
and limit of the chat path: the chat template, tool grammars and parsers, structured outputs, the reasoning
parser, the context bound. Their errors name chat parameters; they are renamed to the Responses ones here.
"""

from __future__ import annotations

import re
import uuid

from pydantic import ValidationError

from sluice.service.api.errors import ApiErrorCode, RequestError
from sluice.service.api.preprocess import Prepared, load_body, prepare_request
from sluice.service.api.protocol import GenerateRequest, invalid, parse_chat
from sluice.service.api.responses_models import (
    EXTRAS,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
)
from sluice.service.engine.async_engine import ModelInfo

_PASSED = ("model", "temperature", "top_p", "stream", "user", "parallel_tool_calls", *EXTRAS)
_STATEFUL = ("previous_response_id", "conversation")
_TOOL_PARAM = re.compile(r"^tools\[(\d+)\]\.function")
_RENAMES = (("response_format.json_schema.", "text.format."), ("response_format", "text.format"),
            ("tool_choice.function.", "tool_choice."), ("max_tokens", "max_output_tokens"))


def prepare_responses(raw: bytes, model: ModelInfo, tool_call_parser: str,
                      reasoning_parser: str = "none") -> tuple[Prepared, ResponsesRequest]:
    """Body bytes to engine requests (runs in the Preprocessor's pool), and the validated body."""
    m = parse_body(load_body(raw))
    try:
        req = to_chat_request(m)
        prep = prepare_request(req, model, tool_call_parser, reasoning_parser, prefix="resp_" + uuid.uuid4().hex)
    except RequestError as e:
        raise renamed(e) from None
    return prep, m


def parse_body(body: dict) -> ResponsesRequest:
    """The validated Responses body; RequestError (naming the parameter) for what this server cannot serve."""
    try:
        m = ResponsesRequest.model_validate(body)
    except ValidationError as e:
        raise invalid(e) from None
    for name in _STATEFUL:
        if getattr(m, name) is not None:
            raise RequestError(f"'{name}' is not supported: this server stores no responses; send the whole "
                               "conversation in 'input'", name, code=ApiErrorCode.UNSUPPORTED_PARAMETER)
    if m.background:
        raise RequestError("'background' responses are not supported: this server stores no responses",
                           "background", code=ApiErrorCode.UNSUPPORTED_PARAMETER)
    return m


def to_chat_request(m: ResponsesRequest) -> GenerateRequest:
    """The chat completions request the Responses body stands for (RequestErrors name chat parameters)."""
    body = {name: getattr(m, name) for name in _PASSED if getattr(m, name) is not None}
    body["messages"] = messages(m)
    if m.max_output_tokens is not None:
        body["max_tokens"] = m.max_output_tokens
    if m.tools is not None:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in m.tools]
    if m.tool_choice is not None:
        choice = m.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = m.text.format if m.text is not None else None
    if fmt is not None:
        if fmt.type == "json_schema":
            spec = {"name": fmt.name, "strict": fmt.strict, "schema": fmt.schema_}
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {k: v for k, v in spec.items() if v is not None}}
        else:
            body["response_format"] = {"type": fmt.type}
    return parse_chat(body)


def messages(m: ResponsesRequest) -> list[dict]:
    """The conversation as chat messages: instructions first, then the input items in order."""
    out: list[dict] = [{"role": "system", "content": m.instructions}] if m.instructions is not None else []
    if isinstance(m.input, str):
        return [*out, {"role": "user", "content": m.input}]
    for item in m.input:
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the turn's text and calls are one message
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        # reasoning items: an earlier reply's thinking stays out of the prompt
    return out


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p.value for p in content)


def renamed(e: RequestError) -> RequestError:
    """A chat path's error with its parameter (and the message's mention of it) as the Responses body names it."""
    param = e.param
    if param is None:
        return e
    if param.startswith("messages"):  # chat messages do not map one to one onto input items
        new = "input"
    else:
        new = _TOOL_PARAM.sub(r"tools[\1]", param)
        for old, repl in _RENAMES:
            new = new.replace(old, repl)
    if new == param:
        return e
    message = e.message.replace(param, new).replace("'response_format'", "'text.format'")
    return RequestError(message, new, e.code, e.headers)
