"""A strict, incremental parser for text/event-stream bodies and OpenAI's streaming-completion contract."""

from __future__ import annotations

import codecs
from dataclasses import dataclass

import orjson


class SSEError(ValueError):
    """The body breaks the event-stream format or OpenAI's streaming contract."""


@dataclass(slots=True)
class SSEEvent:
    """One dispatched event: its data lines joined by newlines."""

    data: str
    event: str = "message"
    id: str | None = None


class SSEParser:
    """Feed bytes as they arrive, get complete events back (WHATWG HTML, 'Parsing an event stream').

    Lines end in CRLF, LF or CR; a CR at the end of a chunk may be half of a CRLF, so it waits for the next
    chunk. Unlike a browser, `close()` refuses a body that ends inside an event or inside a UTF-8 sequence:
    for a benchmark a truncated stream is a failed request, not something to paper over.
    """

    __slots__ = ("_decoder", "_buf", "_data", "_event", "_id", "_started")

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self._buf = ""
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._started = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Consume a chunk of the body; returns the events it completed."""
        try:
            text = self._decoder.decode(chunk)
        except UnicodeDecodeError as e:
            raise SSEError(f"stream is not valid UTF-8: {e}") from None
        if not self._started and text:
            self._started = True
            text = text.removeprefix("\ufeff")
        buf = self._buf + text
        events: list[SSEEvent] = []
        pos = 0
        while True:
            lf, cr = buf.find("\n", pos), buf.find("\r", pos)
            if cr != -1 and (lf == -1 or cr < lf):
                if cr + 1 == len(buf):
                    break  # maybe the first half of CRLF: decide when more arrives
                end, nxt = cr, cr + 2 if buf[cr + 1] == "\n" else cr + 1
            elif lf != -1:
                end, nxt = lf, lf + 1
            else:
                break
            event = self._line(buf[pos:end])
            if event is not None:
                events.append(event)
            pos = nxt
        self._buf = buf[pos:]
        return events

    def close(self) -> list[SSEEvent]:
        """End of body: a final bare CR ends its line; anything still pending is an error."""
        try:
            self._decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise SSEError(f"stream ends inside a UTF-8 sequence: {e}") from None
        events = []
        if self._buf == "\r":
            self._buf = ""
            event = self._line("")
            events = [event] if event is not None else []
        if self._buf or self._data:
            raise SSEError("stream ends inside an event (no blank line after the last field)")
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if not line:  # blank line: dispatch
            if not self._data:
                self._event = ""
                return None
            event = SSEEvent("\n".join(self._data), self._event or "message", self._id)
            self._data, self._event = [], ""
            return event
        if line.startswith(":"):
            return None  # comment (keep-alive)
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None  # "retry" and unknown fields are ignored, as the spec says


@dataclass(slots=True)
class StreamChunk:
    """What one OpenAI streaming event carried."""

    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None  # from a usage object, when the server sent one
    done: bool = False  # the [DONE] sentinel


class CompletionStream:
    """Checks the OpenAI streaming contract event by event: JSON chunks with choices or usage, then [DONE]."""

    __slots__ = ("chat", "done", "finish_reason", "completion_tokens", "timings")

    def __init__(self, chat: bool = False) -> None:
        self.chat = chat
        self.done = False
        self.finish_reason: str | None = None
        self.completion_tokens: int | None = None
        self.timings: dict | None = None  # llama.cpp's own per-request figures (draft_n, draft_n_accepted, ...)

    def on_event(self, event: SSEEvent) -> StreamChunk:
        """Interpret one event; raises SSEError on anything the contract does not allow."""
        if self.done:
            raise SSEError("event after data: [DONE]")
        if event.event not in ("message", "error"):
            raise SSEError(f"unexpected event type {event.event!r}")
        if event.data == "[DONE]":
            self.done = True
            return StreamChunk(done=True)
        try:
            body = orjson.loads(event.data)
        except orjson.JSONDecodeError:
            raise SSEError(f"event data is not JSON: {event.data[:120]!r}") from None
        if not isinstance(body, dict):
            raise SSEError("event data is not a JSON object")
        if "error" in body or event.event == "error":
            error = body.get("error")
            message = error.get("message") if isinstance(error, dict) else error
            raise SSEError(f"server error in stream: {message}")
        chunk = StreamChunk()
        if isinstance(body.get("timings"), dict):
            self.timings = body["timings"]
        usage = body.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            chunk.completion_tokens = self.completion_tokens = usage["completion_tokens"]
        choices = body.get("choices")
        if not isinstance(choices, list):
            raise SSEError("chunk has no 'choices' list")
        if not choices and chunk.completion_tokens is None:
            raise SSEError("chunk has neither choices nor usage")
        for choice in choices:
            if not isinstance(choice, dict):
                raise SSEError("a choice is not an object")
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if text is not None and not isinstance(text, str):
                raise SSEError("choice text is not a string")
            chunk.text += text or ""
            if choice.get("finish_reason"):
                chunk.finish_reason = self.finish_reason = choice["finish_reason"]
        return chunk

    def finish(self) -> None:
        """The body ended: it must have ended with [DONE]."""
        if not self.done:
            raise SSEError("stream ended without data: [DONE]")
