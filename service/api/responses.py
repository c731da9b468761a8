"""The Responses API's reply: the `response` object and its stream of events, built from one choice's engine
outputs read exactly as the chat path reads them (reasoning.split_output, then tool_parsers.stream_deltas).

A reply's output items come in the order they are generated: a `reasoning` item (with --reasoning-parser),
a `message` with one `output_text` part (the content; always there when the reply made no call), then a
`function_call` item per call. Streamed, each item is opened (`response.output_item.added`), filled by deltas
and closed (`response.output_item.done`) before the next opens; a non-streamed reply is the same reading with
the events dropped, so the two always agree. A call cut by max_output_tokens ends `incomplete` in the stream
and is left out of the final response, as the chat path drops it from a finished reply.

The response object echoes the request's settings, never its input items. Streamed, the opening snapshots
(`response.created`, `response.in_progress`) leave out the echoes a client can make large (instructions, tools,
user): only the final response carries them, so no reply holds its request more than once.
"""

from __future__ import annotations

import time
import uuid

from sluice.scheduling.outcomes import FinishReason
from sluice.service.api.errors import RequestError
from sluice.service.api.formatting import Choice, record
from sluice.service.api.reasoning import split_output
from sluice.service.api.responses_models import ResponsesRequest
from sluice.service.api.tool_parsers import stream_deltas

_NO_REASONING = {"effort": None, "summary": None}


def _item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def head(m: ResponsesRequest, response_id: str, model: str) -> dict:
    """The response object's fields that echo the request."""
    fmt = m.text.format if m.text is not None else None
    text_format = {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)
    choice = m.tool_choice
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "incomplete_details": None, "error": None, "model": model, "output": [], "usage": None,
        "instructions": m.instructions,
        "tools": [t.model_dump(exclude_none=True) for t in m.tools or ()],
        "tool_choice": (choice or "auto") if choice is None or isinstance(choice, str) else choice.model_dump(),
        "parallel_tool_calls": m.get("parallel_tool_calls"), "temperature": m.get("temperature"),
        "top_p": m.get("top_p"), "max_output_tokens": m.max_output_tokens, "text": {"format": text_format},
        "reasoning": _reasoning_echo(m), "metadata": m.metadata or {}, "user": m.user,
        "store": False, "previous_response_id": None, "truncation": "disabled",
    }


def _opening(response: dict) -> dict:
    """A snapshot of the stream's opening events: without the echoed fields whose size the client chooses
    (instructions up to the context, tools up to the body limit, user), which only the final response (the terminal
    event, or the non-streamed body) carries. A reply then holds its request at most once; the other echoed fields
    are a few bytes (text.format's schema: bounded by its own limit)."""
    return {**response, "instructions": None, "tools": [], "user": None}


def _reasoning_echo(m: ResponsesRequest) -> dict:
    r = m.reasoning
    if r is None:
        return _NO_REASONING
    return {"effort": r.effort, "summary": r.summary if r.summary is not None else r.generate_summary}


def response_usage(choice: Choice) -> dict:
    """The Responses API's usage block."""
    return {"input_tokens": choice.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": choice.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": choice.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": choice.num_reasoning_tokens},
            "total_tokens": choice.num_prompt_tokens + choice.num_output_tokens}


class ResponseBuilder:
    """One reply's output items and events: `start()`, `feed(out)` per engine output, `finish()`."""

    __slots__ = ("head", "choice", "seq", "items", "open", "parts", "cut")

    def __init__(self, head: dict, choice: Choice):
        self.head, self.choice = head, choice
        self.seq = 0
        self.items: list[dict] = []  # output items, closed ones final
        self.open: dict | None = None  # the item being generated
        self.parts: list[str] = []  # its text (or arguments) so far
        self.cut = False  # a call was cut by the token limit

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _response(self, status: str) -> dict:
        return {**self.head, "status": status, "output": list(self.items)}

    def start(self) -> list[dict]:
        """The stream's first events (their snapshots without the fields only the final response echoes)."""
        return [self._event("response.created", response=_opening(self._response("in_progress"))),
                self._event("response.in_progress", response=_opening(self._response("in_progress")))]

    def feed(self, out) -> list[dict]:
        """One engine output of the reply: the events it completes."""
        choice = self.choice
        record(choice, out)
        reasoning, out = split_output(choice, out)
        events = self._delta("reasoning", reasoning) if reasoning else []
        for text, calls, _, _ in stream_deltas(choice.tools, out):
            if text:
                events += self._delta("message", text)
            for call in calls or ():
                if "id" in call:  # a call starts: its name is known, its arguments follow in pieces
                    events += self._open_item({
                        "id": _item_id("fc"), "type": "function_call", "call_id": call["id"],
                        "name": call["function"]["name"], "arguments": "", "status": "in_progress"})
                else:
                    events += self._delta("function_call", call["function"]["arguments"])
        return events

    def finish(self) -> list[dict]:
        """The last events: the open item closed, then response.completed or response.incomplete."""
        tools = self.choice.tools
        self.cut = tools is not None and tools.reply.cut is not None
        events = self._close(final=True)
        if not any(i["type"] in ("message", "function_call") for i in self.items):  # a reply always has one
            events += self._open_item(_message()) + self._close(final=True)
        final = self.response()
        return events + [self._event(f"response.{final['status']}", response=final)]

    def response(self) -> dict:
        """The final response object (after finish())."""
        length = self.choice.finish_reason == FinishReason.LENGTH
        out = {**self._response("incomplete" if length else "completed"), "usage": response_usage(self.choice)}
        out["output"] = [i for i in self.items if i["status"] != "incomplete" or i["type"] != "function_call"]
        if length:
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def error(self, err: RequestError) -> list[dict]:
        """A stream that failed after its headers ends with the spec's error event."""
        return [self._event("error", code=err.code.wire, message=err.message, param=err.param)]

    # ---- items ------------------------------------------------------------------------------------------

    def _delta(self, kind: str, text: str) -> list[dict]:
        item = self.open
        events = [] if item is not None and item["type"] == kind else self._open_item(
            _reasoning() if kind == "reasoning" else _message())
        item = self.open
        self.parts.append(text)
        where = {"item_id": item["id"], "output_index": len(self.items)}
        if kind == "function_call":
            return events + [self._event("response.function_call_arguments.delta", delta=text, **where)]
        if kind == "reasoning":
            return events + [self._event("response.reasoning_text.delta", content_index=0, delta=text, **where)]
        return events + [self._event("response.output_text.delta", content_index=0, delta=text, logprobs=[],
                                     **where)]

    def _open_item(self, item: dict) -> list[dict]:
        events = self._close()
        self.open, self.parts = item, []
        events.append(self._event("response.output_item.added", output_index=len(self.items), item=dict(item)))
        part = _part(item, "")
        if part is not None:
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.items), content_index=0, part=part))
        return events

    def _close(self, final: bool = False) -> list[dict]:
        """Close the open item; `final`: the reply has ended in it."""
        item = self.open
        if item is None:
            return []
        text = "".join(self.parts)
        where = {"item_id": item["id"], "output_index": len(self.items)}
        cut = final and self.choice.finish_reason == FinishReason.LENGTH
        events = []
        if item["type"] == "function_call":
            item = {**item, "arguments": text, "status": "incomplete" if cut and self.cut else "completed"}
            events.append(self._event("response.function_call_arguments.done", arguments=text, **where))
        else:
            part = _part(item, text)
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            events.append(self._event(done, content_index=0, text=text, **extra, **where))
            events.append(self._event("response.content_part.done", content_index=0, part=part, **where))
            item = {**item, "content": [part], "status": "incomplete" if cut else "completed"}
        events.append(self._event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        self.open, self.parts = None, []
        return events


def _message() -> dict:
    return {"id": _item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}


def _reasoning() -> dict:
    return {"id": _item_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}


def _part(item: dict, text: str) -> dict | None:
    if item["type"] == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    if item["type"] == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return None
