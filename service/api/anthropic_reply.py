"""The Messages API's reply: the `message` object and its stream of named events, built from one choice's engine
outputs read exactly as the chat path reads them (reasoning.split_output, then tool_parsers.stream_deltas).

A reply's content blocks come in the order they are generated: a `thinking` block (with --reasoning-parser), a
`text` block, a `tool_use` block per call (`id` `toolu_...`, `input` the call's arguments); a reply with no block
at all gets one empty text block. Streamed, each block is opened (`content_block_start`), filled by deltas
(`thinking_delta`, `text_delta`, `input_json_delta` with the call's arguments JSON in the pieces the parser
scanned) and closed (`content_block_stop`) before the next opens; a non-streamed reply is the same reading with
the events dropped, so the two always agree. A call cut by max_tokens has streamed its pieces; the finished
message leaves it out, as the chat path does.

`stop_reason`: `end_turn`, `max_tokens`, `stop_sequence` (with `stop_sequence` the string that matched) or
`tool_use` (the reply ended normally after complete calls). `usage` is Anthropic's: `input_tokens` are the
prompt's tokens not read from the prefix cache, `cache_read_input_tokens` those that were (their sum is what
count_tokens answers), `cache_creation_input_tokens` is always 0 (caching is automatic, never billed apart).
"""

from __future__ import annotations

import json

from sluice.scheduling.outcomes import FinishReason
from sluice.service.api.formatting import Choice, record
from sluice.service.api.reasoning import split_output
from sluice.service.api.tool_parsers import stream_deltas

_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
           "tool_use": ("input_json_delta", "partial_json")}


def tool_use_id(call_id: str) -> str:
    """A tool call's id as Anthropic spells it (the chat path's `call_<hex>` as `toolu_<hex>`)."""
    return "toolu_" + call_id.removeprefix("call_")


def usage(choice: Choice) -> dict:
    """Anthropic's usage block (the prompt split into what was computed and what the prefix cache held)."""
    cached = min(choice.num_cached_tokens, choice.num_prompt_tokens)
    return {"input_tokens": choice.num_prompt_tokens - cached, "output_tokens": choice.num_output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


class MessageBuilder:
    """One reply's content blocks and events: `start()`, `feed(out)` per engine output, `finish()`, `message()`."""

    __slots__ = ("id", "model", "choice", "prompt_tokens", "blocks", "open", "parts", "dropped", "stop_string")

    def __init__(self, message_id: str, model: str, choice: Choice, prompt_tokens: int):
        self.id, self.model, self.choice, self.prompt_tokens = message_id, model, choice, prompt_tokens
        self.blocks: list[dict] = []  # content blocks, closed ones final
        self.open: dict | None = None  # the block being generated
        self.parts: list[str] = []  # its text (or input JSON) so far
        self.dropped: set[int] = set()  # blocks the finished message leaves out (a call cut by max_tokens)
        self.stop_string: str | None = None

    def _message(self, content: list, stop_reason: str | None, stop_sequence: str | None, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def start(self) -> list[dict]:
        """The stream's first event: the message without content (its input tokens known before the first output,
        the prefix cache's share once an output has said it)."""
        head = usage(self.choice)
        if not self.choice.num_prompt_tokens:
            head["input_tokens"] = self.prompt_tokens
        return [{"type": "message_start", "message": self._message([], None, None, head)}]

    def feed(self, out) -> list[dict]:
        """One engine output of the reply: the events it completes."""
        choice = self.choice
        record(choice, out)
        if out.finished and isinstance(out.stop_reason, str):
            self.stop_string = out.stop_reason
        reasoning, out = split_output(choice, out)
        events = self._delta("thinking", reasoning) if reasoning else []
        for text, calls, _, _ in stream_deltas(choice.tools, out):
            if text:
                events += self._delta("text", text)
            for call in calls or ():
                if "id" in call:  # a call starts: its name is known, its arguments follow in pieces
                    events += self._open_block({"type": "tool_use", "id": tool_use_id(call["id"]),
                                                "name": call["function"]["name"], "input": {}})
                else:
                    events += self._delta("tool_use", call["function"]["arguments"])
        return events

    def finish(self) -> list[dict]:
        """The last events: the open block closed, then message_delta (stop reason, usage) and message_stop."""
        events = self._close(final=True)
        if not self.blocks:  # a reply always has a block
            events += self._open_block({"type": "text", "text": ""}) + self._close(final=True)
        final = self.message()
        return events + [{"type": "message_delta",
                          "delta": {"stop_reason": final["stop_reason"], "stop_sequence": final["stop_sequence"]},
                          "usage": final["usage"]},
                         {"type": "message_stop"}]

    def message(self) -> dict:
        """The finished message (after finish())."""
        reason, sequence = self.stop_reason()
        content = [b for i, b in enumerate(self.blocks) if i not in self.dropped]
        return self._message(content, reason, sequence, usage(self.choice))

    def stop_reason(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the finished reply."""
        choice = self.choice
        if choice.finish_reason == FinishReason.LENGTH:
            return "max_tokens", None
        if choice.tools is not None and choice.tools.reply.out.completed:
            return "tool_use", None
        if self.stop_string is not None:
            return "stop_sequence", self.stop_string
        return "end_turn", None

    # ---- blocks -----------------------------------------------------------------------------------------

    def _delta(self, kind: str, text: str) -> list[dict]:
        block = self.open
        events = [] if block is not None and block["type"] == kind else self._open_block(
            {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text",
                                                                                            "text": ""})
        self.parts.append(text)
        name, field = _DELTAS[kind]
        return events + [{"type": "content_block_delta", "index": len(self.blocks),
                          "delta": {"type": name, field: text}}]

    def _open_block(self, block: dict) -> list[dict]:
        events = self._close()
        self.open, self.parts = block, []
        return events + [{"type": "content_block_start", "index": len(self.blocks), "content_block": dict(block)}]

    def _close(self, final: bool = False) -> list[dict]:
        """Close the open block; `final`: the reply has ended in it."""
        block = self.open
        if block is None:
            return []
        text = "".join(self.parts)
        index = len(self.blocks)
        if block["type"] == "tool_use":
            tools = self.choice.tools
            cut = final and tools is not None and tools.reply.cut is not None
            try:
                arguments = json.loads(text) if text else {}
            except ValueError:  # cut inside its arguments
                arguments, cut = None, True
            if cut:
                self.dropped.add(index)
            block = {**block, "input": arguments if isinstance(arguments, dict) else {}}
        else:
            block = {**block, block["type"]: text}
        self.blocks.append(block)
        self.open, self.parts = None, []
        return [{"type": "content_block_stop", "index": index}]
