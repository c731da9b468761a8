"""Tool calls read from a reply as it is generated: one state machine per call format, over JsonScan, that emits
content text, each call's start (id and name) as soon as its arguments open, and the arguments in canonical JSON
pieces as they are scanned. A finished reply is parsed by feeding it whole (tool_parsers.parse), so a streamed and
a non-streamed reply always agree.

Formats (`--tool-call-parser`, or detected from the chat template):
- `hermes` (Hermes, Qwen 2/2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated;
- `llama3_json` (Llama 3.1+): `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
  several separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the v11 `[TOOL_CALLS]name[ARGS]{...}`;
- `json`: the first JSON object or array in the reply that is a call (or `{"tool_calls": [...]}`);
- `constrained`: the whole reply is the JSON a tool grammar allowed: a call, an array of calls or
  `{"content": "..."}` (a text answer, streamed as its string decodes).
A call `{"name": "f", "arguments": {...}}` streams: its start when the arguments open, then their pieces. Other
shapes (arguments first, arguments as a JSON string, `{"function": {...}}`, `{"tool_calls": [...]}`) are read
when their value is complete and sent whole.

Malformed output: before any call has started, the reply falls back to text (the `json` parser moves on to the
next candidate); once a call has started, what follows the last good call is dropped. A call still open when the
reply ends (max_tokens) is marked cut: a finished reply drops it, a stream has already sent its pieces.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from sluice.service.api.json_scan import Refused, canonical_number, escape, printable

MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3_json": ("<|python_tag|>",),
           "json": ("{", "[")}
MAX_CANDIDATES = 256  # json parser: JSON-looking values tried before the rest of a reply is taken as text
_ARGS_KEYS = ("arguments", "parameters")
_DECODER = json.JSONDecoder(strict=False)
_SURROGATE = re.compile("[\ud800-\udfff]")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _dump_json(value) -> str:
    """JSON text as json.dumps(ensure_ascii=False) writes it, lone surrogates escaped."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))


def loads(text: str):
    """Decoded JSON, or None when malformed or too deep for the decoder."""
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError):
        return None


def as_call(obj) -> tuple[str, str] | None:
    """{"name", "arguments"|"parameters"} (or OpenAI's own {"function": {...}}) as (name, arguments JSON)."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):
        args = loads(args)
    if not isinstance(args, dict):
        return None
    return printable(name), _dump_json(args)


def calls_of(value) -> list[tuple[str, str]] | None:
    """A call, a list of calls or {"tool_calls": [...]}; None unless every item is a call."""
    if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
        value = value["tool_calls"]
    items = value if isinstance(value, list) else [value]
    calls = [as_call(v) for v in items]
    return calls if calls and all(calls) else None


@dataclass(slots=True)
class Emitter:
    """The events a reply has produced and not yet been taken: ("content", text), ("call", index, id, name),
    ("args", index, text)."""

    events: list = field(default_factory=list)
    started: int = 0  # calls started
    completed: int = 0  # calls whose arguments are complete

    def content(self, text: str) -> None:
        if text:
            if self.events and self.events[-1][0] == "content":
                self.events[-1] = ("content", self.events[-1][1] + text)
            else:
                self.events.append(("content", text))

    def start(self, name: str) -> int:
        index, self.started = self.started, self.started + 1
        self.events.append(("call", index, new_call_id(), name))
        return index

    def args(self, index: int, text: str) -> None:
        last = self.events[-1] if self.events else None
        if last is not None and last[0] == "args" and last[1] == index:
            self.events[-1] = ("args", index, last[2] + text)
        else:
            self.events.append(("args", index, text))

    def whole(self, name: str, arguments: str) -> None:
        self.args(self.start(name), arguments)
        self.completed += 1

    def take(self) -> list:
        events, self.events = self.events, []
        return events


class CallSink:
    """JsonScan's sink for one value that should be tool calls: a call object, an array of them, `{"content":
    "..."}` where `answer` is allowed, or (with `name`, mistral v11) the arguments object alone."""

    __slots__ = ("out", "answer_ok", "preset", "depth", "top", "call_depth", "cur_key", "first_key", "name",
                 "name_parts", "held", "index", "in_args", "answering", "answered", "found")

    def __init__(self, out: Emitter, answer_ok: bool = False, name: str | None = None):
        self.out, self.answer_ok, self.preset = out, answer_ok, name
        self.depth = 0
        self.top = ""
        self.call_depth = 0  # depth of the call object being read (1: the value itself, 2: an array item)
        self.cur_key: str | None = None  # the call object's current key
        self.first_key: str | None = None
        self.name: str | None = None
        self.name_parts: list[str] | None = None
        self.held: list[str] | None = None  # the call object in canonical JSON, until its start is sent
        self.index: int | None = None  # the call whose arguments stream
        self.in_args = False
        self.answering = False
        self.answered = False
        self.found = 0  # complete calls

    @property
    def committed(self) -> bool:
        return self.index is not None

    def _write(self, text: str) -> None:
        if self.held is not None:
            self.held.append(text)
        if self.in_args:
            self.out.args(self.index, text)

    def open(self, kind: str) -> None:
        self.depth += 1
        d = self.depth
        if d == 1:
            self.top = kind
            if self.preset is not None:  # mistral v11: this object is the arguments
                if kind != "{":
                    raise Refused
                self.call_depth, self.index, self.in_args = 0, self.out.start(self.preset), True
            elif kind == "{":
                self._begin(1)
        elif d == 2 and self.top == "[" and not self.call_depth:
            if kind != "{":
                raise Refused
            self._begin(2)
        elif (self.call_depth and d == self.call_depth + 1 and self.cur_key in _ARGS_KEYS and self.name
              and self.index is None and kind == "{"):
            self.index, self.in_args, self.held = self.out.start(self.name), True, None
        self._write(kind)

    def close(self, kind: str) -> None:
        self._write(kind)
        d = self.depth
        self.depth -= 1
        if self.in_args and d == self.call_depth + 1:
            self.in_args = False
            if self.preset is not None:
                self._done()
        if d == self.call_depth:
            self._end_call()

    def _begin(self, d: int) -> None:
        self.call_depth, self.cur_key, self.first_key, self.name, self.held, self.index = d, None, None, None, [], None

    def _done(self) -> None:
        self.out.completed += 1
        self.found += 1
        self.index = None

    def _end_call(self) -> None:
        self.call_depth = 0
        if self.index is not None:
            self._done()
        elif self.answered:
            pass
        else:
            calls = calls_of(loads("".join(self.held)))
            if not calls:
                raise Refused
            for name, arguments in calls:
                self.out.whole(name, arguments)
            self.found += len(calls)
        self.held = None

    def key(self, text: str) -> None:
        self._write(f'"{escape(text)}"')
        if self.call_depth and self.depth == self.call_depth:
            self.cur_key = text
            if self.first_key is None:
                self.first_key = text

    def colon(self) -> None:
        self._write(": ")

    def comma(self) -> None:
        self._write(", ")

    def scalar(self, raw: str) -> None:
        self._value_at_top()
        self._write(canonical_number(raw) if raw[0] in "-0123456789" else raw)

    def string_start(self) -> None:
        self._value_at_top()
        if self.call_depth and self.depth == self.call_depth:
            if self.cur_key == "name" and self.name is None:
                self.name_parts = []
            elif self.answer_ok and self.depth == 1 and self.first_key == "content" and self.cur_key == "content":
                self.answering = True
        self._write('"')

    def string_piece(self, text: str) -> None:
        if self.name_parts is not None:
            self.name_parts.append(text)
        if self.answering:
            self.out.content(printable(text))
        self._write(escape(text))

    def string_end(self) -> None:
        if self.name_parts is not None:
            self.name, self.name_parts = printable("".join(self.name_parts)), None
        if self.answering:
            self.answering, self.answered = False, True
        self._write('"')

    def _value_at_top(self) -> None:
        """A scalar or string where a call must be: the value is not calls."""
        if self.depth == 0 or (self.depth == 1 and self.top == "[" and not self.call_depth):
            raise Refused
