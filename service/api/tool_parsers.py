"""Tool calling on /v1/chat/completions: the reply side. A reply is read by tool_reply.ReplyParser as it is
generated (the formats and the rules for malformed or cut replies are in tool_stream); here it becomes OpenAI's
shapes: a finished reply's `content` and `tool_calls`, or a stream's content and tool-call deltas.

Streaming, a call's first delta carries `index`, `id`, `type: "function"`, `function.name` and
`function.arguments: ""`; later deltas carry `index` and pieces of `function.arguments`, whose concatenation is
the call's arguments JSON (as json.dumps writes it). When max_tokens cuts a reply, the calls completed before
the limit are `tool_calls` with `finish_reason: "length"`; the call it cut is dropped from a finished reply,
and in a stream its pieces have already gone out (its arguments do not parse: OpenAI does the same, and the
OpenAI and LangChain clients keep the complete calls and mark or skip the cut one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.service.api.tool_reply import ReplyParser
from sluice.service.api.tool_stream import MARKERS, new_call_id

__all__ = ["MARKERS", "Parsed", "ToolOutput", "finish_collected", "finish_reason", "new_call_id", "parse",
           "stream_deltas"]


@dataclass(slots=True)
class Parsed:
    content: str  # the text that is not a call ("" when none)
    calls: list[dict] = field(default_factory=list)


def parse(text: str, parser: str, reason: str | None = "stop") -> Parsed:
    """Split a finished reply (ended by `reason`) into content and its complete tool calls."""
    reply = ReplyParser(parser)
    events = reply.feed(text) + reply.finish(reason)
    content = "".join(e[1] for e in events if e[0] == "content")
    calls: dict[int, dict] = {}
    for e in events:
        if e[0] == "call":
            calls[e[1]] = {"id": e[2], "type": "function", "function": {"name": e[3], "arguments": ""}}
        elif e[0] == "args":
            calls[e[1]]["function"]["arguments"] += e[2]
    calls.pop(reply.cut, None)
    return Parsed(content.strip() if reply.out.started or reply.dropped else content, list(calls.values()))


class ToolOutput:
    """One streamed choice's reply under tools, and the logprobs of text not yet sent."""

    __slots__ = ("parser", "reply", "logprobs")

    def __init__(self, parser: str):
        self.parser = parser
        self.reply = ReplyParser(parser)
        self.logprobs: list = []


def finish_reason(num_calls: int, reason: str | None) -> str | None:
    """OpenAI's "tool_calls" when a reply that ended normally made calls."""
    return "tool_calls" if num_calls and reason == "stop" else reason


def stream_deltas(tools: ToolOutput | None, out) -> list[tuple[str, list | None, str | None, list]]:
    """The chunks one engine output becomes: (content, tool_calls or None, finish_reason, logprobs)."""
    reason = out.finish_reason if out.finished else None
    if tools is None:
        return [(out.text, None, reason, out.logprobs)] if out.text or out.logprobs or out.finished else []
    events = tools.reply.feed(out.text)
    if out.finished:
        events += tools.reply.finish(reason)
    tools.logprobs.extend(out.logprobs)
    chunks = []
    for e in events:
        if e[0] == "content":
            chunks.append((e[1], None, None, tools.logprobs))
        elif e[0] == "call":
            chunks.append(("", [{"index": e[1], "id": e[2], "type": "function",
                                 "function": {"name": e[3], "arguments": ""}}], None, tools.logprobs))
        else:
            chunks.append(("", [{"index": e[1], "function": {"arguments": e[2]}}], None, tools.logprobs))
        tools.logprobs = []
    if out.finished:
        chunks.append(("", None, finish_reason(tools.reply.out.completed, reason), tools.logprobs))
        tools.logprobs = []
    return chunks


def finish_collected(choice) -> None:
    """A non-streamed choice's text parsed into content and tool calls (formatting.Choice)."""
    if choice.tools is None:
        return
    parsed = parse("".join(choice.text), choice.tools.parser, choice.finish_reason)
    choice.text = [parsed.content]
    choice.tool_calls = parsed.calls or None
    choice.finish_reason = finish_reason(len(parsed.calls), choice.finish_reason)
