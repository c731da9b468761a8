"""A KV cache block and the O(1) free-block queue that threads through blocks."""

from __future__ import annotations

from collections.abc import Iterable

from sluice.kvcache.hashing import BlockHash


class KVCacheBlock:
    """Metadata of one device block; the K/V data live in the KV tensors at index `block_id`."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set once the block is full and registered for reuse
        # Intrusive links: a block is in the free queue iff ref_cnt == 0, so removal needs no search.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks: pop from the front, append at the back (or the front: reused first)."""

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels keep every operation branch-free
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Take the least recently freed block."""
        block = self._head.next_free
        # A real check, not an assert: under `python -O` handing out the sentinel would corrupt the list.
        if block is None or block is self._tail:
            raise RuntimeError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue in O(1)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the back: it is reused last."""
        if block.prev_free is not None or block.next_free is not None or block.block_id < 0:
            raise RuntimeError(f"{block} is already queued (or is a sentinel)")
        last = self._tail.prev_free
        assert last is not None  # the head sentinel at worst
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put a block at the front: it is reused first."""
        if block.prev_free is not None or block.next_free is not None or block.block_id < 0:
            raise RuntimeError(f"{block} is already queued (or is a sentinel)")
        first = self._head.next_free
        assert first is not None  # the tail sentinel at worst
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids front to back (for tests and debugging; O(n))."""
        ids, node = [], self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids
