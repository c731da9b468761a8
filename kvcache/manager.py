"""KVCacheManager: per-request block tables on top of the BlockPool, prefix lookup and swap bookkeeping."""

from __future__ import annotations

from typing import Protocol

from sluice.kvcache.block import KVCacheBlock
from sluice.kvcache.block_pool import BlockPool
from sluice.kvcache.events import (
    MEDIUM_DEVICE,
    BlockStored,
    KVEventSink,
    block_extra_keys,
    external_hash,
    request_event_keys,
)
from sluice.kvcache.hashing import BlockHash
from sluice.kvcache.swap_space import SwapSpace


class CacheableRequest(Protocol):
    """What the manager needs to know about a request (scheduling.Request satisfies it)."""

    request_id: str
    num_computed_tokens: int
    block_hashes: list[BlockHash]
    all_token_ids: list[int]  # read only for KV events (BlockStored carries the tokens)

    @property
    def num_tokens(self) -> int: ...


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class KVCacheManager:
    """Allocates and frees a request's blocks; lookup always precedes allocation, block tables only grow."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_host_blocks: int = 0,
        events: KVEventSink | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events  # KV events (kvcache/events.py) go here; None: off, and nothing is built for them
        self.pool = BlockPool(num_blocks, enable_prefix_caching, events)
        self.swap_space = SwapSpace(num_host_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_num_cached: dict[str, int] = {}  # leading blocks already registered in the prefix cache
        self.req_host_blocks: dict[str, list[int]] = {}
        # Host slots read by this step's swap-ins. They are released only by commit_swaps(), once the step's
        # copies are known done: until then they hold the only good copy of the KV (a failed copy falls back on
        # them), and no swap-out of the same step can be handed them.
        self.swapping_in: dict[str, list[int]] = {}
        self._host_release_after_step: list[int] = []  # slots of requests freed while their swap-in was pending
        # Cumulative prefix-cache counters, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        """Device blocks in the pool."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Device blocks no request references (cached prefixes included)."""
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of device blocks in use, 0..1."""
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: CacheableRequest) -> list[KVCacheBlock]:
        """Longest run of cached blocks matching the request's prefix; the last token is never a hit."""
        if not self.enable_prefix_caching:
            return []
        # The last known token must be recomputed: its logits give the next token.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self,
        request: CacheableRequest,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Reserve slots for `num_new_tokens` after the computed prefix; None (and no change) if they don't fit."""
        computed = new_computed_blocks or []
        blocks = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(num_required - len(blocks) - len(computed), 0)
        # Hits on free cached blocks leave the free queue too, so they count against what is free.
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks:
            return None

        if request.num_computed_tokens == 0:  # first admission (or after recompute preemption)
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed) * self.block_size
        self.pool.touch(computed)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks = self.req_blocks.setdefault(request.request_id, blocks)
        blocks.extend(computed)
        blocks.extend(new_blocks)
        if request.request_id not in self.req_num_cached:
            self.req_num_cached[request.request_id] = len(computed)
        # Registered now, before the forward fills them, so requests batched in the same step can share them;
        # the scheduler never preempts a request scheduled in the current step, so they will be filled.
        self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: CacheableRequest, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks[rid]
        start = self.req_num_cached.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        if self.events is None:
            for i in range(start, end):
                self.pool.cache_block(blocks[i], request.block_hashes[i])
        else:
            stored = [i for i in range(start, end) if self.pool.cache_block(blocks[i], request.block_hashes[i])]
            if stored:
                self._report_stored(request, stored)
        self.req_num_cached[rid] = max(start, end)

    def _report_stored(self, request: CacheableRequest, stored: list[int]) -> None:
        """One BlockStored per run of consecutive blocks that became findable (a block whose hash another block
        already held breaks the run: the next run names it as its parent)."""
        lora_id, lora_name, salt = request_event_keys(request)
        hashes, size = request.block_hashes, self.block_size
        run_start = 0
        for k in range(1, len(stored) + 1):
            if k < len(stored) and stored[k] == stored[k - 1] + 1:
                continue
            first, last = stored[run_start], stored[k - 1]
            self.events.append(BlockStored(
                [external_hash(h) for h in hashes[first:last + 1]],
                external_hash(hashes[first - 1]) if first else None,
                request.all_token_ids[first * size:(last + 1) * size], size, lora_id, MEDIUM_DEVICE, lora_name,
                block_extra_keys(first, last - first + 1, lora_name, salt),
            ))
            run_start = k

    def free(self, request: CacheableRequest, uncache_from_block: int | None = None) -> None:
        """Release the request's device blocks (tail first, so its prefix stays cached longest) and host slots.

        `uncache_from_block` forgets the hashes of the blocks from that index on: for a failed step, whose
        blocks were registered before the forward that was to fill them.
        """
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, [])
        self.req_num_cached.pop(rid, None)
        if uncache_from_block is not None:
            for block in blocks[uncache_from_block:]:
                self.pool.uncache_block(block)
        self.pool.free_blocks(reversed(blocks))
        host = self.req_host_blocks.pop(rid, None)
        if host:
            self.swap_space.free(host)
        pending = self.swapping_in.pop(rid, None)
        if pending:  # its swap-in copy may still be reading them
            self._host_release_after_step.extend(pending)

    def num_held_blocks(self, request_id: str) -> int:
        """Device blocks in the request's block table."""
        return len(self.req_blocks.get(request_id, ()))

    def trim(self, request: CacheableRequest, num_tokens: int) -> None:
        """Free the request's blocks past those holding its first `num_tokens` tokens: slots reserved for draft
        tokens that were rejected. Such blocks were never registered in the prefix cache (only blocks of known
        tokens are), so they go back to the free queue without a hash."""
        blocks = self.req_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        assert self.req_num_cached.get(request.request_id, 0) <= keep, "a hashed block holds unverified tokens"
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free_blocks(reversed(tail))

    def uncache_block_ids(self, block_ids: list[int]) -> None:
        """Forget the prefix hashes of these blocks: a failed step left their contents unknown."""
        for block_id in block_ids:
            self.pool.uncache_block(self.pool.blocks[block_id])

    # --- swap ---------------------------------------------------------------------------------

    def num_blocks_to_swap(self, request: CacheableRequest) -> int:
        """Blocks holding the request's computed tokens."""
        return cdiv(request.num_computed_tokens, self.block_size)

    def can_swap_out(self, request: CacheableRequest) -> bool:
        """Whether the host pool can take the request's computed blocks."""
        return self.num_blocks_to_swap(request) <= self.swap_space.num_free_blocks

    def swap_out(self, request: CacheableRequest) -> list[tuple[int, int]]:
        """Move the request's computed blocks to host slots; returns (device_block, host_block) copies to do."""
        rid = request.request_id
        n = self.num_blocks_to_swap(request)
        blocks = self.req_blocks[rid]
        host = self.swap_space.allocate(n)
        copies = [(blocks[i].block_id, host[i]) for i in range(n)]
        self.req_host_blocks[rid] = host
        self.req_blocks.pop(rid)
        self.req_num_cached.pop(rid, None)
        self.pool.free_blocks(reversed(blocks))
        return copies

    def can_swap_in(self, request: CacheableRequest, num_extra_tokens: int = 0) -> bool:
        """Whether the device has room for the request's swapped blocks plus `num_extra_tokens` more."""
        need = cdiv(request.num_computed_tokens + num_extra_tokens, self.block_size)
        return need <= self.pool.num_free_blocks

    def swap_in(self, request: CacheableRequest) -> list[tuple[int, int]]:
        """Bring the request's blocks back into fresh device blocks; returns (host_block, device_block) copies.

        The host slots stay taken until commit_swaps() (the copy succeeded) or undo_swap_in() (it failed).
        """
        rid = request.request_id
        host = self.req_host_blocks.pop(rid)
        blocks = self.pool.get_new_blocks(len(host))
        self.req_blocks[rid] = blocks
        self.req_num_cached[rid] = 0
        self._cache_full_blocks(request, request.num_computed_tokens)
        self.swapping_in[rid] = host
        return [(h, b.block_id) for h, b in zip(host, blocks, strict=True)]

    def commit_swaps(self) -> None:
        """The step's copies are done: release the host slots its swap-ins read."""
        for host in self.swapping_in.values():
            self.swap_space.free(host)
        self.swapping_in.clear()
        if self._host_release_after_step:
            self.swap_space.free(self._host_release_after_step)
            self._host_release_after_step = []

    def undo_swap_in(self, request: CacheableRequest) -> None:
        """The step's copies failed: drop the device blocks (contents unknown) and keep the KV in its host slots.

        A request swapped out again in the same step drops that newer, unfinished host copy too.
        """
        host = self.swapping_in.pop(request.request_id)  # out of the way: free() would defer releasing it
        self.free(request, uncache_from_block=0)  # device blocks, and any newer host copy
        self.req_host_blocks[request.request_id] = host

    def drop_host_blocks(self, request: CacheableRequest) -> None:
        """Forget a swapped-out request's host copy (its copy failed): it must be recomputed."""
        host = self.req_host_blocks.pop(request.request_id)
        self.swap_space.free(host)

    def reset_prefix_cache(self) -> None:
        """Forget all cached prefixes (only when idle)."""
        self.pool.reset_prefix_cache()
