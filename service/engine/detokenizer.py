"""Incremental detokenization: token ids in, text deltas out, with stop strings cut and UTF-8 kept whole."""

from __future__ import annotations

import functools
import re

# Prompt tokens decoded as left context, so the first output token keeps the leading space or byte
# merge it would have inside the full text (SentencePiece "▁word", byte-level "Ġword").
_PROMPT_CONTEXT_TOKENS = 5
# The byte-level and byte-fallback decoders turn an incomplete UTF-8 sequence into U+FFFD.
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas, in O(new tokens) per update.

    Two things are held back: the bytes of a character not yet complete (at token level), and a
    text suffix that could still grow into a stop string. A stop string can only start inside that
    held-back suffix or in new text, so matching never looks at text already emitted.
    """

    __slots__ = (
        "tokenizer", "stop", "include_stop_str_in_output", "stop_hit",
        "_special_ids", "_tokens", "_prefix_offset", "_read_offset", "_emitted", "_pending",
    )

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_hit: str | None = None
        self._special_ids = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        # Only the prompt's tail matters as context; specials in it would decode to nothing anyway.
        tail = [t for t in prompt_token_ids[-4 * _PROMPT_CONTEXT_TOKENS:] if t not in self._special_ids]
        self._tokens: list[str] = self._to_tokens(tail[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decode window: context that is already text
        self._read_offset = len(self._tokens)  # tokens from here on are not text yet
        self._emitted: list[str] = []  # deltas returned so far
        self._pending = ""  # decoded text held back as a possible stop-string prefix

    @property
    def text(self) -> str:
        """The full output text so far (cut at the stop string once one is hit)."""
        if len(self._emitted) > 1:
            self._emitted[:] = ["".join(self._emitted)]
        return (self._emitted[0] if self._emitted else "") + self._pending

    def update(self, new_token_ids: list[int], finished: bool = False) -> str:
        """Add tokens; return the text that became final. `finished=True` releases held-back text."""
        if self.stop_hit is not None:
            return ""
        new_tokens = self._to_tokens([t for t in new_token_ids if t not in self._special_ids])
        if new_tokens:
            self._tokens.extend(new_tokens)
            window = self._pending + self._decode_window()
        else:
            window = self._pending
        end = self._cut_at_stop(window) if self.stop else -1
        if end >= 0:
            window, hold = window[:end], 0
        else:
            hold = 0 if finished else self._partial_stop_len(window)
        delta, self._pending = window[: len(window) - hold], window[len(window) - hold:]
        if delta:
            self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """Release text held back as a possible stop-string prefix (the request ended another way)."""
        return self.update([], finished=True)

    def _to_tokens(self, ids: list[int]) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(ids) if ids else []

    def _decode_window(self) -> str:
        """Decode the tokens past the read offset, with the previous few as context."""
        convert = self.tokenizer.convert_tokens_to_string
        prefix = convert(self._tokens[self._prefix_offset:self._read_offset])
        full = convert(self._tokens[self._prefix_offset:])
        # A trailing U+FFFD is a multi-byte character still missing bytes: wait for the next token.
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        return full[len(prefix):]

    def _cut_at_stop(self, window: str) -> int:
        """Record the earliest stop string in `window`; return where the output ends, or -1."""
        best, hit = -1, None
        for s in self.stop:
            i = window.find(s)
            if i >= 0 and (best < 0 or i < best):
                best, hit = i, s
        if hit is None:
            return -1
        self.stop_hit = hit
        return best + len(hit) if self.include_stop_str_in_output else best

    def _partial_stop_len(self, window: str) -> int:
        """Length of the longest suffix of `window` that is a proper prefix of some stop string."""
        held, n = 0, len(window)
        for s in self.stop:
            # Longest first; only positions holding s[0] can start a match.
            i = window.find(s[0], max(0, n - len(s) + 1))
            while 0 <= i and n - i > held:
                if s.startswith(window[i:]):
                    held = n - i
                    break
                i = window.find(s[0], i + 1)
        return held


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The raw bytes a token stands for, also when they are not valid UTF-8 on their own (OpenAI's `bytes`).

    Byte-fallback tokens (`<0xE2>`) are one byte; byte-level BPE tokens map each character back through GPT-2's
    alphabet; SentencePiece pieces use U+2581 for a space; anything else is its decoded text.
    """
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is None:
        return b""
    m = _BYTE_TOKEN.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    if token_id in getattr(tokenizer, "all_special_ids", ()):
        return piece.encode()
    decoder = _byte_decoder()
    if all(ch in decoder for ch in piece):
        return bytes(decoder[ch] for ch in piece)
    if "\u2581" in piece:
        return piece.replace("\u2581", " ").encode()
    return tokenizer.decode([token_id]).encode()
