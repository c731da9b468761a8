import pytest

from sluice.kvcache.block import FreeBlockQueue, KVCacheBlock
from sluice.kvcache.block_pool import BlockPool
from sluice.kvcache.hashing import hash_block_tokens
from sluice.scheduling.request import Request
from sluice.scheduling.sampling_params import SamplingParams


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The hash chain over a prompt's full blocks, as the scheduler builds it (Request.update_block_hashes)."""
    request = Request("hashes", list(token_ids), SamplingParams())
    request.update_block_hashes(block_size)
    return request.block_hashes


def test_free_queue_is_fifo_with_o1_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4] and len(q) == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    assert q.block_ids() == [1, 3, 4, 0]


def test_refcount_and_lazy_eviction():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(a, h)
    pool.touch([a])  # a second request shares the prefix block
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert pool.num_free_blocks == 2  # still referenced once
    pool.free_blocks([b, a])
    assert pool.num_free_blocks == 4
    # freed but still findable until reused
    assert pool.get_cached_block(h) is a
    pool.touch([a])  # a hit on a free cached block pulls it out of the free queue
    assert pool.num_free_blocks == 3 and a.ref_cnt == 1
    pool.free_blocks([a])
    # reuse order: least recently freed first, so a (freed last) is evicted last
    taken = pool.get_new_blocks(3)
    assert a not in taken and pool.get_cached_block(h) is a
    taken += pool.get_new_blocks(1)
    assert a in taken and pool.get_cached_block(h) is None and a.block_hash is None


def test_double_free_is_caught():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a])


def test_hash_chain_is_stable_and_prefix_sensitive():
    h1 = prompt_block_hashes([1, 2, 3, 4, 5], 2)
    assert len(h1) == 2
    assert h1 == prompt_block_hashes([1, 2, 3, 4, 9], 2)  # partial tail not hashed
    assert prompt_block_hashes([9, 2, 3, 4], 2)[1] != h1[1]  # same block, different parent
    # stable across processes: a fixed digest
    assert hash_block_tokens(None, [1, 2]).hex()[:16] == "bc46af79e96bc03a"
    assert hash_block_tokens(None, [1, 2], b"lora") != hash_block_tokens(None, [1, 2])


def test_a_block_holding_no_cached_prefix_is_reused_before_a_never_used_one():
    """Resident KV memory follows the most blocks held at once: freed blocks with nothing cached are taken again
    before the pool reaches for a block it never handed out (whose pages are not resident yet); cached ones still
    wait at the back, least recently freed first, so the prefix cache keeps its reach."""
    pool = BlockPool(8)
    for _ in range(20):  # a long-running server at one request of three blocks at a time, nothing cached
        pool.free_blocks(reversed(pool.get_new_blocks(3)))
    assert pool.num_touched == 3
    held = pool.get_new_blocks(2)
    pool.cache_block(held[0], b"prefix")
    pool.free_blocks(reversed(held))
    assert pool.free_queue.block_ids()[-1] == held[0].block_id  # cached: at the back
    assert pool.get_new_blocks(2)[0] is held[1]  # the uncached one first
    assert pool.get_cached_block(b"prefix") is held[0]
    pool.get_new_blocks(pool.num_free_blocks)  # only when every free block is taken is the cached one evicted
    assert pool.get_cached_block(b"prefix") is None and pool.num_touched == 8
