"""A /v1/messages body translated into the chat request the chat completions path builds.

The body is validated as Anthropic declares it (anthropic_models.py), then rewritten as a chat body: `system` a
system message, each message's blocks chat messages (text blocks content parts, `tool_use` blocks the assistant's
`tool_calls`, each `tool_result` block a tool message, `thinking` blocks dropped as chat templates drop earlier
thinking), `tools` chat's function tools, `tool_choice` chat's (auto -> auto, any -> required, tool -> the named
function, none -> none; `disable_parallel_tool_use` -> parallel_tool_calls false), `stop_sequences` `stop`,
`thinking` the template's `enable_thinking`. parse_chat and prepare_request then apply every rule and limit of the
chat path; their errors name chat parameters and are renamed to Anthropic's here.

What the chat path has no word for is refused here, naming the block: images and documents (the models served
take text), Anthropic's server tools, a last assistant message (a prefill: the reply would not continue it).
Claude Code's `x-anthropic-billing-header` system block, which changes on every request and carries no
instructions, is left out of the prompt so that it does not end the prompt's cached prefix.
"""

from __future__ import annotations

import json
import re
import uuid

from pydantic import ValidationError

from sluice.service.api.anthropic_models import (
    BILLING_HEADER,
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from sluice.service.api.errors import RequestError
from sluice.service.api.preprocess import Prepared, load_body, prepare_request
from sluice.service.api.protocol import DEFAULT_CAPS, GenerateRequest, RequestCaps, invalid, parse_chat
from sluice.service.engine.async_engine import ModelInfo

_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}
_THINKING = {"enabled": True, "adaptive": True, "disabled": False}
_TOOL_PARAM = re.compile(r"^tools\[(\d+)\]\.function(\.parameters)?")
_RENAMES = (("tool_choice.function.", "tool_choice."), ("chat_template_kwargs", "thinking"),
            ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"))


def prepare_messages(raw: bytes, model: ModelInfo, tool_call_parser: str, reasoning_parser: str = "none",
                     caps: RequestCaps = DEFAULT_CAPS) -> Prepared:
    """Body bytes to engine requests (runs in the Preprocessor's pool)."""
    return _prepare(parse_body(load_body(raw)), model, tool_call_parser, reasoning_parser, caps)


def count_tokens(raw: bytes, model: ModelInfo, tool_call_parser: str, reasoning_parser: str = "none",
                 caps: RequestCaps = DEFAULT_CAPS) -> int:
    """The prompt's tokens, as /v1/messages would render and count them (runs in the Preprocessor's pool)."""
    prep = _prepare(parse_body(load_body(raw), CountTokensRequest), model, tool_call_parser, reasoning_parser, caps)
    return len(prep.batch[0][1])


def _prepare(m: MessagesRequest | CountTokensRequest, model: ModelInfo, tool_call_parser: str,
             reasoning_parser: str, caps: RequestCaps) -> Prepared:
    req = to_chat_request(m, caps)
    try:
        return prepare_request(req, model, tool_call_parser, reasoning_parser, prefix="msg_" + uuid.uuid4().hex)
    except RequestError as e:
        raise renamed(e) from None


def parse_body(body: dict, kind: type = MessagesRequest) -> MessagesRequest | CountTokensRequest:
    """The validated body; RequestError (naming the field) otherwise."""
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        raise invalid(e) from None


def to_chat_request(m: MessagesRequest | CountTokensRequest, caps: RequestCaps = DEFAULT_CAPS) -> GenerateRequest:
    """The chat completions request the Messages body stands for (RequestErrors name the Messages fields)."""
    body: dict = {"model": m.model, "messages": messages(m)}
    if isinstance(m, MessagesRequest):
        body.update(max_tokens=m.max_tokens, stream=bool(m.stream))
    for name in ("temperature", "top_p", "top_k"):
        if getattr(m, name) is not None:
            body[name] = getattr(m, name)
    if m.stop_sequences is not None:
        body["stop"] = m.stop_sequences
    choice = m.tool_choice
    if m.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(m.tools)]
    if choice is not None and (m.tools or choice.type not in ("auto", "none")):
        if choice.type == "tool":
            if choice.name is None:
                raise RequestError("'tool_choice.name' is required when its type is 'tool'", "tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = _TOOL_CHOICE[choice.type]
        if choice.disable_parallel_tool_use is not None:
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if m.thinking is not None and m.thinking.type in _THINKING:
        body["chat_template_kwargs"] = {"enable_thinking": _THINKING[m.thinking.type]}
    try:
        return parse_chat(body, caps)
    except RequestError as e:
        raise renamed(e) from None


def _tool(tool, i: int) -> dict:
    if tool.type not in (None, "custom"):
        raise RequestError(f"'tools[{i}]' is a server tool ('{tool.type}'), which this server does not run; declare "
                           "client tools (name, description, input_schema)", f"tools[{i}].type")
    fn = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        fn["description"] = tool.description
    return {"type": "function", "function": fn}


def messages(m: MessagesRequest | CountTokensRequest) -> list[dict]:
    """The conversation as chat messages: the system prompt first, then each message's blocks in order."""
    out: list[dict] = []
    system = _system(m.system)
    if system is not None:
        out.append({"role": "system", "content": system})
    last = len(m.messages) - 1
    if m.messages[last].role == "assistant":
        raise RequestError(f"'messages[{last}]': a last assistant message (a prefill) is not supported: the reply "
                           "would not continue it; end the conversation with a user message", f"messages[{last}]")
    for i, msg in enumerate(m.messages):
        where = f"messages[{i}]"
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
        elif msg.role == "assistant":
            out.append(_assistant(msg.content, where))
        else:
            out += _user(msg.content, where)
    return out


def _system(system) -> str | list[dict] | None:
    """The system prompt as content parts, without Claude Code's billing header block (None: no system message)."""
    if system is None or isinstance(system, str):
        return system
    parts = [_part(b.text) for b in system if not b.text.lstrip().startswith(BILLING_HEADER)]
    return parts or None


def _part(text: str) -> dict:
    return {"type": "text", "text": text}


def _assistant(blocks: list, where: str) -> dict:
    """An assistant turn: its text blocks as content, its tool_use blocks as tool_calls."""
    parts, calls = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            parts.append(_part(block.text))
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif not isinstance(block, ThinkingBlock):  # earlier thinking stays out of the prompt
            raise _refused(block, f"{where}.content[{j}]", "assistant")
    item: dict = {"role": "assistant", "content": parts if parts or not calls else None}
    if calls:
        item["tool_calls"] = calls
    return item


def _user(blocks: list, where: str) -> list[dict]:
    """A user turn: each tool_result a tool message, the text blocks around them user messages, in order."""
    out, parts = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            parts.append(_part(block.text))
        elif isinstance(block, ToolResultBlock):
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _result(block, f"{where}.content[{j}]")})
        elif not isinstance(block, ThinkingBlock):
            raise _refused(block, f"{where}.content[{j}]", "user")
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _result(block: ToolResultBlock, where: str) -> list[dict]:
    """A tool result's content as text parts; an error's text follows `Error: `."""
    content = block.content
    if content is None or isinstance(content, str):
        parts = [_part(content or "")]
    else:
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, TextBlock):
                raise _refused(part, f"{where}.content[{k}]", "tool_result")
            parts.append(_part(part.text))
    return [_part("Error: "), *parts] if block.is_error else parts


def _refused(block, where: str, container: str) -> RequestError:
    kind = block.type
    if kind in ("image", "document"):
        why = f"'{kind}' content blocks are not supported: the served model takes text only"
    elif kind in ("tool_use", "tool_result"):
        why = f"'{kind}' blocks are not allowed in {'an' if container == 'assistant' else 'a'} {container} message"
    else:
        why = f"'{kind}' content blocks are not supported here"
    return RequestError(f"'{where}': {why}", f"{where}.type")


def renamed(e: RequestError) -> RequestError:
    """A chat path's error with its parameter (and the message's mention of it) as the Messages body names it."""
    param = e.param
    if param is None:
        return e
    if param.startswith("messages"):  # chat messages do not map one to one onto Anthropic's
        new = "messages"
    elif param == "stop" or param.startswith("stop["):
        new = "stop_sequences" + param[4:]
    else:
        new = _TOOL_PARAM.sub(lambda m: f"tools[{m[1]}]" + (".input_schema" if m[2] else ""), param)
        for old, repl in _RENAMES:
            new = new.replace(old, repl)
    if new == param:
        return e
    message = e.message.replace(param, new)
    return RequestError(message, new, e.code, e.headers)
