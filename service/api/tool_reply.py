"""The reply side of tool calling, per call format: where calls start (markers), what may sit between them, and
what becomes of text that is not a call. Each character of a reply is looked at a bounded number of times, so
the work per generated token is proportional to the new text (see tool_stream for the formats and the rules).
"""

from __future__ import annotations

import re

from sluice.service.api.json_scan import JsonError, JsonScan
from sluice.service.api.tool_stream import MARKERS, MAX_CANDIDATES, CallSink, Emitter

_SPACE = " \t\n\r"
_V11 = re.compile(r"([A-Za-z0-9_.-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]{1,64})?\[ARGS\]")
_V11_WINDOW = 160  # characters a v11 `name[CALL_ID]id[ARGS]` header may take
_NAME_CHAR = re.compile(r"[A-Za-z0-9_.-]")
_SEPARATORS = "; \t\n\r"
_CLOSE = "</tool_call>"
_OPEN = "<tool_call>"

# States between values.
PROSE, TEXT, START, VALUE, AFTER, BETWEEN, SEP, V11, DONE = range(9)


class ReplyParser:
    """One choice's reply under tools, fed as it is generated: `feed` and `finish` return Emitter events."""

    __slots__ = ("parser", "out", "buf", "state", "scan", "sink", "raw", "streamed", "candidates", "cut", "dropped")

    def __init__(self, parser: str):
        self.parser = parser
        self.out = Emitter()
        self.buf = ""  # text not consumed yet: a partial marker, token or escape
        self.state = START if parser == "constrained" else PROSE
        self.scan: JsonScan | None = None
        self.sink: CallSink | None = None
        self.raw: list[str] | None = [] if parser == "constrained" else None  # text that falls back to content
        self.streamed = False  # non-blank content went out (llama3_json: a reply opening with `{` is a call)
        self.candidates = 0
        self.cut: int | None = None  # the index of a call the reply ended inside
        self.dropped = False  # the reply ended inside what was to be a call, and it was dropped

    def feed(self, text: str) -> list:
        """Take new text; the events it completes."""
        self.buf += text
        self._run(False)
        return self.out.take()

    def finish(self, reason: str | None) -> list:
        """The reply ended (`reason`: its finish reason); the last events."""
        self._run(True)
        if self.state in (VALUE, START, V11):
            sink = self.sink if self.state == VALUE else None
            if sink is not None and sink.committed:
                self.cut = sink.index  # max_tokens inside a call's arguments
            elif sink is not None and (sink.answering or sink.answered):
                pass  # a text answer: what decoded has gone out
            elif self.parser == "json" or (self.parser != "constrained" and reason != "length"
                                           and not self.out.started):
                self.out.content("".join(self.raw or ()) + self.buf)  # not a call after all: text
            else:
                self.dropped = True
            self.state = DONE
        self.buf = ""
        return self.out.take()

    # ---- the loop ----------------------------------------------------------------------------------------

    def _eat(self, text: str) -> None:
        if self.raw is not None and text:
            self.raw.append(text)

    def _run(self, final: bool) -> None:
        buf, i = self.buf, 0
        while i < len(buf):
            state = self.state
            if state == TEXT:
                self.out.content(buf[i:])
                i = len(buf)
            elif state == DONE:
                i = len(buf)
            elif state == PROSE:
                j = self._prose(buf, i, final)
                if j == i and self.state == PROSE:
                    break  # a partial marker: wait for more text
                i = j
            elif state == VALUE:
                try:
                    j = self.scan.feed(buf, i, final)
                except JsonError as e:
                    self._eat(buf[i:e.pos])
                    i = e.pos
                    self._refuse(e.kind)
                    continue
                self._eat(buf[i:j])
                i = j
                if not self.scan.done:
                    break
                self._value_done()
            else:
                j = self._between(state, buf, i, final)
                if j is None or (j == i and self.state == state):
                    break
                i = j
        self.buf = buf[i:]

    def _prose(self, buf: str, i: int, final: bool) -> int:
        """Content until a call may start."""
        text = buf[i:]
        markers = MARKERS[self.parser]
        hits = [(k, m) for k, m in ((text.find(m), m) for m in markers) if k >= 0]
        if self.parser == "llama3_json" and not self.streamed and text.lstrip().startswith("{"):
            hits.append((len(text) - len(text.lstrip()), ""))  # a call opens the reply
        if hits:
            cut, marker = min(hits)
            self.out.content(text[:cut])
            self.raw = [] if self.parser == "json" or not self.out.started else None
            self._eat(marker if self.parser != "json" else "")
            self.candidates += 1
            self.state = START
            return i + cut + (len(marker) if self.parser != "json" else 0)
        keep = 0 if final else max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
        if self.parser == "llama3_json" and not self.streamed and not text.strip() and not final:
            keep = len(text)  # only whitespace so far: a call may still open the reply
        out = text[:len(text) - keep]
        self.out.content(out)
        self.streamed = self.streamed or bool(out.strip())
        return len(buf) - keep

    def _between(self, state: int, buf: str, i: int, final: bool) -> int | None:
        """The text around values; the index reached, or None to wait for more text."""
        n = len(buf)
        if state == BETWEEN:  # hermes: whatever sits between calls is not content
            k = buf.find(_OPEN, i)
            if k < 0:
                keep = max((k for k in range(1, len(_OPEN)) if buf.endswith(_OPEN[:k])), default=0)
                return n - keep if n - keep > i else None
            self.state = START
            return k + len(_OPEN)
        skip = _SEPARATORS if state == SEP else _SPACE
        j = i
        while j < n and buf[j] in skip:
            j += 1
        self._eat(buf[i:j])
        if j == n:
            return j
        c = buf[j]
        if state == START:
            if c in "{[" or self.parser == "constrained":
                return self._start_value(j)
            if self.parser == "mistral":
                self.state = V11
                return j
            return self._refuse_at(j, "shape")
        if state == AFTER:  # hermes: the closing tag (or, leniently, the next call's opening one)
            rest = buf[j:j + len(_CLOSE)]
            if rest == _CLOSE:
                self.state = BETWEEN
                return j + len(_CLOSE)
            if buf.startswith(_OPEN, j):
                self.state = START
                return j + len(_OPEN)
            if (_CLOSE.startswith(rest) or _OPEN.startswith(rest)) and not final:
                return None if j == i else j
            self.state = DONE
            return j
        if state == SEP:  # llama3_json: `;` between calls
            if c in "{[":
                return self._start_value(j)
            self.state = DONE
            return j
        # V11: mistral's `name[ARGS]{...}`, or `name[CALL_ID]id[ARGS]{...}`
        if not _NAME_CHAR.match(c):
            self.state = DONE if self.out.started else self.state
            return j if self.out.started else self._refuse_at(j, "shape")
        k = buf.find("[ARGS]", j, j + _V11_WINDOW)
        if k < 0:
            if n - j < _V11_WINDOW and not final:
                return None if j == i else j
            return self._refuse_at(j, "shape")
        m = _V11.fullmatch(buf, j, k + len("[ARGS]"))
        if m is None:
            return self._refuse_at(j, "shape")
        self._eat(buf[j:m.end()])
        return self._start_value(m.end(), name=m.group(1))

    def _start_value(self, j: int, name: str | None = None) -> int:
        self.sink = CallSink(self.out, answer_ok=self.parser == "constrained", name=name)
        self.scan = JsonScan(self.sink)
        self.state = VALUE
        return j

    def _refuse_at(self, j: int, kind: str) -> int:
        self._refuse(kind)
        return j

    def _value_done(self) -> None:
        """A value ended: calls (or a constrained text answer) were read, unless it was an empty array."""
        if not (self.sink.found or self.sink.answered):
            self._refuse("shape")
            return
        if self.out.started:
            self.raw = None  # no way back to text now
        self.state = {"hermes": AFTER, "llama3_json": SEP}.get(self.parser, DONE)
        if self.parser == "mistral" and self.sink.preset is not None:
            self.state = V11

    def _refuse(self, kind: str) -> None:
        """What is held is not a call: text (before any call) or the end of the calls (after one)."""
        sink = self.sink if self.state == VALUE else None
        if sink is not None and sink.committed:
            self.cut = sink.index
        if self.out.started:
            self.state = DONE
        elif self.parser == "json":
            self.out.content("".join(self.raw or ()))
            self.raw = None
            self.state = TEXT if kind == "deep" or self.candidates >= MAX_CANDIDATES else PROSE
        else:
            self.out.content("".join(self.raw or ()))
            self.raw = None
            self.state = TEXT
