"""BlockPool: reference-counted device blocks with lazy-evicting prefix cache."""

from __future__ import annotations

from collections.abc import Iterable

from sluice.kvcache.block import FreeBlockQueue, KVCacheBlock
from sluice.kvcache.events import MEDIUM_DEVICE, AllBlocksCleared, BlockRemoved, KVEventSink, external_hash
from sluice.kvcache.hashing import BlockHash


class BlockPool:
    """Owns every device block. A block is free iff its ref_cnt is 0; free blocks may still be cached."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, events: KVEventSink | None = None) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.events = events  # where evictions and resets are reported (None: KV events off)
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        # Blocks ever handed out: never-used ones leave the queue in id order, so the used ones are ids below this,
        # and only their KV pages are resident (zeros_on_first_touch). A freed block holding no cached prefix goes
        # to the front and is reused before a never-used one: resident memory follows the most blocks held at once
        # (plus what the prefix cache keeps), not every block a long-running server ever cycled through.
        self.num_touched = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (cached or not): what allocation can draw on."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding this prefix hash, if any (free or in use)."""
        return self.cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks, evicting the cached prefixes they held."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        if blocks:
            self.num_touched = max(self.num_touched, max(b.block_id for b in blocks) + 1)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue in order: at the back where
        they hold a cached prefix (evicted least recently freed first), else at the front (reused first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full block under its prefix hash; an existing entry for the hash wins. True when the hash
        became findable through this block (the caller reports it: it knows the tokens)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached:
            return False  # an identical block is already findable; this one stays an unshared duplicate
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Make a block unfindable by its hash (its contents can no longer be trusted)."""
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.append(BlockRemoved([external_hash(block.block_hash)], MEDIUM_DEVICE))
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change); only valid when no block is in use."""
        assert self.num_free_blocks == self.num_blocks, "blocks still in use"
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.append(AllBlocksCleared())
