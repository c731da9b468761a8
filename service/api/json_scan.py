"""An incremental JSON scanner for model replies: text arrives in pieces, each token is reported to a sink as soon
as it is complete (strings piece by piece, as their escapes decode). Iterative, linear in the text, bounded in
depth and in the length of a number, so no reply can make it recurse or go quadratic. Strings may hold raw control
characters (xgrammar lets them in); `escape` writes them out as valid JSON.
"""

from __future__ import annotations

import json
import math
import re

MAX_DEPTH = 128  # nesting a reply may reach: far beyond any tool's arguments, far below Python's recursion limit
MAX_SCALAR = 1024  # characters of one number (int() refuses 4,300 digits; nothing real comes close)

_WS = re.compile(r"[ \t\n\r]*")
_STOP = re.compile(r'["\\]')
_SCALAR_RUN = re.compile(r"[-+0-9.eE]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_INT = re.compile(r"-?(?:0|[1-9][0-9]*)")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_NEEDS_ESCAPE = re.compile('[\x00-\x1f"\\\\\ud800-\udfff]')
_SURROGATE = re.compile("[\ud800-\udfff]")

# What the scanner expects next.
VALUE, FIRST_ITEM, FIRST_KEY, KEY, COLON, NEXT, DONE = range(7)


class JsonError(ValueError):
    """Not JSON (kind "syntax"), nested past MAX_DEPTH ("deep"), or refused by the sink ("shape"), at `pos`."""

    def __init__(self, pos: int, kind: str = "syntax"):
        super().__init__(f"{kind} error at {pos}")
        self.pos, self.kind = pos, kind


class Refused(Exception):
    """Raised by a sink: the value is not what it is watching for; the scanner turns it into JsonError("shape")."""


def escape(s: str) -> str:
    """`s` as the body of a JSON string, as json.dumps(ensure_ascii=False) writes it; lone surrogates escaped."""
    if not _NEEDS_ESCAPE.search(s):
        return s
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(s, ensure_ascii=False)[1:-1])


def printable(s: str) -> str:
    """Text a client can be sent: a lone surrogate (from a `\\ud800` escape) becomes U+FFFD."""
    return _SURROGATE.sub("\ufffd", s)


def canonical_number(raw: str) -> str:
    """A JSON number as json.dumps(json.loads(raw)) writes it, kept raw where that would not be JSON (1e999)."""
    if _INT.fullmatch(raw):
        return str(int(raw))
    value = float(raw)
    return repr(value) if math.isfinite(value) else raw


class JsonScan:
    """One JSON value, scanned as it arrives. The sink gets open(kind), close(kind), key(text), colon(), comma(),
    string_start(), string_piece(text), string_end() and scalar(raw)."""

    __slots__ = ("sink", "stack", "expect", "string", "key_parts", "pos")

    def __init__(self, sink):
        self.sink = sink
        self.stack: list[str] = []  # the open containers, "{" or "["
        self.expect = VALUE
        self.string: str | None = None  # inside a "key" or a "value" string
        self.key_parts: list[str] = []
        self.pos = 0  # where the token being read starts: where a Refused value is reported

    @property
    def done(self) -> bool:
        return self.expect == DONE

    def feed(self, buf: str, i: int, final: bool = False) -> int:
        """Consume complete tokens of `buf` from `i` (stopping at the value's end); the first index not consumed.
        A token cut at the end of `buf` waits for more text unless `final`."""
        try:
            return self._feed(buf, i, len(buf), final)
        except Refused:
            raise JsonError(self.pos, "shape") from None

    def _feed(self, buf: str, i: int, n: int, final: bool) -> int:
        sink = self.sink
        while i < n and self.expect != DONE:
            if self.string is not None:
                i = self._string(buf, i, n)
                if self.string is not None:
                    return i  # the text ends inside the string (or inside an escape)
                continue
            c = buf[i]
            if c in " \t\n\r":
                i = _WS.match(buf, i).end()
                continue
            self.pos = i
            expect = self.expect
            if expect in (VALUE, FIRST_ITEM):
                if c == '"':
                    self.string = "value"
                    sink.string_start()
                    i += 1
                elif c == "{" or c == "[":
                    if len(self.stack) >= MAX_DEPTH:
                        raise JsonError(i, "deep")
                    self.stack.append(c)
                    self.expect = FIRST_KEY if c == "{" else FIRST_ITEM
                    sink.open(c)
                    i += 1
                elif c == "]" and expect == FIRST_ITEM:
                    i = self._close(c, i)
                elif c in _LITERALS:
                    word = _LITERALS[c]
                    seg = buf[i:i + len(word)]
                    if seg != word:
                        if word.startswith(seg) and not final:
                            return i  # "tr": wait for the rest
                        raise JsonError(i)
                    sink.scalar(word)
                    i += len(word)
                    self._after_value()
                elif c == "-" or "0" <= c <= "9":
                    end = _SCALAR_RUN.match(buf, i).end()
                    if end - i > MAX_SCALAR:
                        raise JsonError(i)
                    if end == n and not final:
                        return i  # the number may go on
                    if not _NUMBER.fullmatch(buf, i, end):
                        raise JsonError(i)
                    sink.scalar(buf[i:end])
                    i = end
                    self._after_value()
                else:
                    raise JsonError(i)
            elif expect in (FIRST_KEY, KEY):
                if c == '"':
                    self.string, self.key_parts = "key", []
                    i += 1
                elif c == "}" and expect == FIRST_KEY:
                    i = self._close(c, i)
                else:
                    raise JsonError(i)
            elif expect == COLON:
                if c != ":":
                    raise JsonError(i)
                sink.colon()
                self.expect = VALUE
                i += 1
            else:  # NEXT: a comma or the container's end
                top = self.stack[-1]
                if c == ",":
                    sink.comma()
                    self.expect = KEY if top == "{" else VALUE
                    i += 1
                elif (c == "}" and top == "{") or (c == "]" and top == "["):
                    i = self._close(c, i)
                else:
                    raise JsonError(i)
        return i

    def _close(self, c: str, i: int) -> int:
        self.stack.pop()
        self.sink.close(c)
        self._after_value()
        return i + 1

    def _after_value(self) -> None:
        self.expect = NEXT if self.stack else DONE

    def _string(self, buf: str, i: int, n: int) -> int:
        """Consume a string's characters and whole escapes; leave it (self.string None) at its closing quote."""
        while True:
            m = _STOP.search(buf, i)
            j = m.start() if m else n
            if j > i:
                self._piece(buf[i:j])
                i = j
            if j == n:
                return i
            if buf[j] == '"':
                self._end_string()
                return j + 1
            if j + 1 >= n:
                return j  # a lone backslash: wait for what it escapes
            c = buf[j + 1]
            if c != "u":
                if c not in _ESCAPES:
                    raise JsonError(j)
                self._piece(_ESCAPES[c])
                i = j + 2
                continue
            if j + 6 > n:
                if not _HEX4.match(buf[j + 2:n] + "0000"):
                    raise JsonError(j)
                return j
            if not _HEX4.fullmatch(buf, j + 2, j + 6):
                raise JsonError(j)
            code, size = int(buf[j + 2:j + 6], 16), 6
            if 0xD800 <= code < 0xDC00:  # a high surrogate: decode it with its low half when one follows
                tail = buf[j + 6:j + 12]
                if len(tail) < 6 and "\\u".startswith(tail[:2]) and _HEX4.match(tail[2:] + "0000"):
                    return j  # the low half may still arrive
                if len(tail) == 6 and tail[:2] == "\\u" and _HEX4.fullmatch(tail, 2):
                    low = int(tail[2:], 16)
                    if 0xDC00 <= low < 0xE000:
                        code, size = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00), 12
            self._piece(chr(code))
            i = j + size

    def _piece(self, text: str) -> None:
        if self.string == "key":
            self.key_parts.append(text)
        else:
            self.sink.string_piece(text)

    def _end_string(self) -> None:
        kind, self.string = self.string, None
        if kind == "key":
            self.sink.key("".join(self.key_parts))
            self.key_parts = []
            self.expect = COLON
        else:
            self.sink.string_end()
            self._after_value()
