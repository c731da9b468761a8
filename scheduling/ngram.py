"""n-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of a request's tail.

A request keeps its tokens as packed 4-byte little-endian words (`TokenBytes`, appended as tokens arrive), so a
lookup is `bytearray.rfind` over the last `window` tokens: C speed, and its cost is bounded by the window
whatever the context length. A byte match that does not start on a token boundary is skipped; each retry
searches strictly left of the last, so one lookup scans the window at most once per n-gram length.
"""

from __future__ import annotations

import struct

_WORD = struct.Struct("<I")


class TokenBytes:
    """A request's token ids as packed 4-byte words, appended one token at a time (amortized O(1))."""

    __slots__ = ("data",)

    def __init__(self, token_ids: list[int]) -> None:
        self.data = bytearray(struct.pack(f"<{len(token_ids)}I", *token_ids))

    def append(self, token_id: int) -> None:
        """Add one token at the end."""
        self.data += _WORD.pack(token_id)

    def __len__(self) -> int:
        return len(self.data) // 4


def propose(tokens: TokenBytes, k: int, n_min: int, n_max: int, window: int) -> list[int]:
    """The `k` tokens that followed the latest earlier occurrence of the last n tokens (n from n_max down to
    n_min) within the last `window` tokens, continued periodically past the end; [] when none occurs."""
    data, num = tokens.data, len(tokens)
    lo = max(0, num - window) * 4
    for n in range(min(n_max, num - 1), n_min - 1, -1):
        pattern = bytes(data[-4 * n:])
        end = len(data) - 4  # the match must start before the tail itself: it is followed by a known token
        while True:
            pos = data.rfind(pattern, lo, end)
            if pos < 0:
                break
            if pos % 4 == 0:
                start = pos // 4 + n
                stop = min(start + k, num)
                drafts = list(struct.unpack(f"<{stop - start}I", data[4 * start : 4 * stop]))
                # A match close to the end overlaps the tail: the text after it repeats with period
                # num - start, so the copy goes on into its own drafts (as LZ77 copies overlap).
                while len(drafts) < k:
                    drafts.append(drafts[len(drafts) - (num - start)])
                return drafts
            end = pos + len(pattern) - 1  # a match inside a token: look further left
    return []
