"""Tool calling on /v1/chat/completions: the reply side. Parsers of the models' call formats, OpenAI's
`tool_calls` shape, and the per-choice state that turns a streamed reply into content and tool-call deltas.

Formats (`--tool-call-parser`, or detected from the chat template):
- `hermes` (Hermes, Qwen 2/2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated;
- `llama3_json` (Llama 3.1+): `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
  several separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the v11 `[TOOL_CALLS]name[ARGS]{...}`;
- `json`: the first JSON object or array in the reply that is a call (or `{"tool_calls": [...]}`);
- `constrained`: the whole reply is the JSON a tool grammar allowed: a call, an array of calls or
  `{"content": "..."}` (a text answer, unwrapped).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

# strict=False: raw control characters inside strings are read (xgrammar 0.2.9 lets them into strings with a
# maxLength); the arguments sent on are re-serialized, so clients always get valid JSON.
_DECODER = json.JSONDecoder(strict=False)
# Where a call starts, per parser: text before it is content and streams at once.
MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3_json": ("<|python_tag|>",),
           "json": ("{", "[")}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_call(name: str, arguments) -> dict:
    """OpenAI's tool call: arguments as JSON text."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _as_call(obj) -> dict | None:
    """{"name", "arguments"|"parameters"} (or OpenAI's own {"function": {...}}) as a tool call, else None."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):
        try:
            args = _DECODER.decode(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return tool_call(name, args)


def _calls(value) -> list[dict] | None:
    """A call, a list of calls or {"tool_calls": [...]}; None unless every item is a call."""
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        value = value["tool_calls"]
    items = value if isinstance(value, list) else [value]
    calls = [_as_call(v) for v in items]
    return calls if calls and all(calls) else None


@dataclass(slots=True)
class Parsed:
    content: str  # the text that is not a call ("" when none)
    calls: list[dict] = field(default_factory=list)


def parse(text: str, parser: str) -> Parsed:
    """Split a finished reply into content and tool calls."""
    return _PARSERS[parser](text)


def parse_constrained(text: str) -> Parsed:
    try:
        value = _DECODER.decode(text)
    except ValueError:  # cut by max_tokens: salvage a text answer, keep anything else as it is
        m = re.match(r'\s*\{\s*"content"\s*:\s*"', text)
        return Parsed(_unescape_partial(text[m.end():]) if m else text)
    if isinstance(value, dict) and set(value) == {"content"} and isinstance(value["content"], str):
        return Parsed(value["content"])
    calls = _calls(value)
    return Parsed("", calls) if calls else Parsed(text)


def _unescape_partial(s: str) -> str:
    """The text of an unterminated JSON string."""
    for cut in range(len(s), max(len(s) - 8, -1), -1):  # drop a half escape sequence at the end
        try:
            return _DECODER.decode('"' + s[:cut] + '"')
        except ValueError:
            continue
    return s


def parse_hermes(text: str) -> Parsed:
    start = text.find("<tool_call>")
    if start < 0:
        return Parsed(text)
    calls = []
    for body in re.findall(r"<tool_call>(.*?)(?:</tool_call>|$)", text[start:], re.S):
        try:
            found = _calls(_DECODER.decode(body.strip()))
        except ValueError:
            found = None
        if not found:
            return Parsed(text)  # a malformed call: the reply stays text, nothing is invented
        calls += found
    return Parsed(text[:start].strip(), calls)


def parse_llama3(text: str) -> Parsed:
    tag = text.find("<|python_tag|>")
    content, rest = (text[:tag], text[tag + len("<|python_tag|>"):]) if tag >= 0 else ("", text)
    calls, pos, rest = [], 0, rest.strip()
    while pos < len(rest):
        try:
            value, end = _DECODER.raw_decode(rest, pos)
        except ValueError:
            return Parsed(text)
        found = _calls(value)
        if not found:
            return Parsed(text)
        calls += found
        pos = end
        while pos < len(rest) and rest[pos] in "; \n\t":
            pos += 1
    return Parsed(content.strip(), calls) if calls else Parsed(text)


def parse_mistral(text: str) -> Parsed:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return Parsed(text)
    rest = text[start + len("[TOOL_CALLS]"):].strip()
    try:
        calls = _calls(_DECODER.raw_decode(rest)[0]) if rest[:1] in "[{" else None
    except ValueError:
        calls = None
    if calls is None:  # v11+: name[ARGS]{...}, possibly repeated, or name[CALL_ID]id[ARGS]{...}
        calls = []
        for m in re.finditer(r"([A-Za-z0-9_.-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]", rest):
            try:
                args = _DECODER.raw_decode(rest, m.end())[0]
            except ValueError:
                return Parsed(text)
            calls.append(tool_call(m.group(1), args))
    return Parsed(text[:start].strip(), calls) if calls else Parsed(text)


def parse_json(text: str) -> Parsed:
    for m in re.finditer(r"[\[{]", text):
        try:
            value, end = _DECODER.raw_decode(text, m.start())
        except ValueError:
            continue
        calls = _calls(value)
        if calls:
            return Parsed(text[:m.start()].strip(), calls)
    return Parsed(text)


_PARSERS = {"constrained": parse_constrained, "hermes": parse_hermes, "llama3_json": parse_llama3,
            "mistral": parse_mistral, "json": parse_json}


_ANSWER = re.compile(r'\s*\{\s*"content"\s*:\s*"')


class ToolOutput:
    """One choice's reply under tools: text streams until a call may have started, then it is held and parsed
    when the reply ends. A constrained reply is JSON from its first character: a call is held whole, a text
    answer `{"content": "..."}` streams its string as it is decoded."""

    __slots__ = ("parser", "pending", "held", "holding", "logprobs", "streamed", "answer_at", "answer_sent")

    def __init__(self, parser: str):
        self.parser = parser
        self.pending = ""  # text that may be the start of a marker
        self.held = ""  # text from the first marker on
        self.holding = parser == "constrained"
        self.logprobs: list = []  # of held text: sent with the next chunk
        self.streamed = False  # some non-blank content went out
        self.answer_at: int | None = None  # constrained text answer: where in `held` its undecoded rest starts
        self.answer_sent = 0  # characters of the answer streamed so far

    def feed(self, text: str) -> str:
        """Take new text; return what may be streamed as content now."""
        if self.holding:
            self.held += text
            return self._answer() if self.parser == "constrained" else ""
        text = self.pending + text
        markers = MARKERS[self.parser]
        hits = [i for i in (text.find(m) for m in markers) if i >= 0]
        if self.parser == "llama3_json" and not self.streamed and text.lstrip().startswith("{"):  # opens the reply
            hits.append(len(text) - len(text.lstrip()))
        if hits:
            cut = min(hits)
            self.holding, self.held, self.pending = True, text[cut:], ""
            return text[:cut]
        keep = max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
        if self.parser == "llama3_json" and not self.streamed and not text.strip():
            keep = len(text)  # only whitespace so far: a JSON call may still open the reply
        self.pending = text[len(text) - keep:] if keep else ""
        out = text[:len(text) - keep] if keep else text
        self.streamed = self.streamed or bool(out.strip())
        return out

    def _answer(self) -> str:
        """The newly decodable part of a constrained text answer's JSON string."""
        if self.answer_at is None:
            m = _ANSWER.match(self.held)
            if m is None:
                return ""
            self.answer_at = m.end()
        held, start = self.held, self.answer_at
        i = start
        while i < len(held) and held[i] != '"':
            if held[i] == "\\":
                size = 6 if held[i + 1:i + 2] == "u" else 2
                if size == 6 and "d800" <= held[i + 2:i + 6].lower() <= "dbff":
                    size = 12  # a surrogate pair: decode both halves together
                if i + size > len(held):
                    break
                i += size
            else:
                i += 1
        if i == start:
            return ""
        try:
            out = _DECODER.decode('"' + held[start:i] + '"')
        except ValueError:  # not what the grammar allows: leave it to finish()
            return ""
        self.answer_at, self.answer_sent = i, self.answer_sent + len(out)
        return out

    def finish(self) -> Parsed:
        """The rest of the reply: content not yet streamed, and the calls."""
        rest = self.pending + self.held
        self.pending = self.held = ""
        if not rest:
            return Parsed("")
        parsed = parse(rest, self.parser)
        if self.answer_sent:  # the streamed part of a text answer
            parsed.content = parsed.content[self.answer_sent:]
        return parsed


def finish_reason(calls: list, reason: str | None) -> str | None:
    """OpenAI's "tool_calls" when a reply that ended normally made calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def stream_deltas(tools: ToolOutput | None, out) -> list[tuple[str, list | None, str | None, list]]:
    """The chunks one engine output becomes: (content, tool_calls or None, finish_reason, logprobs)."""
    reason = out.finish_reason if out.finished else None
    if tools is None:
        return [(out.text, None, reason, out.logprobs)] if out.text or out.logprobs or out.finished else []
    text = tools.feed(out.text)
    tools.logprobs.extend(out.logprobs)
    chunks = []
    if text:
        chunks.append((text, None, None, tools.logprobs))
        tools.logprobs = []
    if out.finished:
        parsed = tools.finish()
        if parsed.content:
            chunks.append((parsed.content, None, None, tools.logprobs))
            tools.logprobs = []
        calls = [{"index": i, **c} for i, c in enumerate(parsed.calls)]
        if calls:
            chunks.append(("", calls, None, tools.logprobs))
            tools.logprobs = []
        chunks.append(("", None, finish_reason(calls, reason), tools.logprobs))
    return chunks


def finish_collected(choice) -> None:
    """A non-streamed choice's text parsed into content and tool calls (formatting.Choice)."""
    if choice.tools is None:
        return
    parsed = parse("".join(choice.text), choice.tools.parser)
    choice.text = [parsed.content]
    choice.tool_calls = parsed.calls or None
    choice.finish_reason = finish_reason(parsed.calls, choice.finish_reason)
