"""Chained block hashes: h_i = H(h_{i-1}, tokens of block i, extra keys), stable across processes."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """Hash one full block, chained to its parent so equal hashes mean equal whole prefixes."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else b"\x00" * 32)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(b"\x01")
        h.update(extra_keys)
    return h.digest()
