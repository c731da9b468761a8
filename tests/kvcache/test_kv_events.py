"""KV cache events from the block pool and the manager: a BlockStored per run of blocks that became findable (in
chain order, with their parent and tokens), a BlockRemoved per eviction, AllBlocksCleared on a reset, the salt and
the adapter in extra_keys, and nothing at all when events are off."""

from __future__ import annotations

import hashlib

import pytest

from sluice.kvcache.block_pool import BlockPool
from sluice.kvcache.events import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventSink,
    external_hash,
)
from sluice.kvcache.manager import KVCacheManager
from sluice.scheduling.request import Request
from sluice.scheduling.sampling_params import LoRARequest, SamplingParams

BS = 4


def request(rid: str, tokens: list[int], **params) -> Request:
    r = Request(rid, tokens, SamplingParams(**params))
    r.update_block_hashes(BS)
    return r


def admit(kv: KVCacheManager, r: Request) -> None:
    """Look up the prefix, then allocate the rest of the prompt, as the scheduler does."""
    hits = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - len(hits) * BS, hits) is not None
    r.num_computed_tokens = r.num_tokens


def stored(events) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def test_external_hash_is_the_digests_low_64_bits():
    digest = hashlib.sha256(b"x").digest()
    assert external_hash(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert 0 <= external_hash(b"\xff" * 32) == 2**64 - 1


def test_a_prompt_is_stored_as_one_run_in_chain_order_and_decode_blocks_extend_the_chain():
    sink = KVEventSink()
    kv = KVCacheManager(16, BS, events=sink)
    r = request("a", list(range(100, 110)))  # 2 full blocks and 2 tokens
    admit(kv, r)
    (ev,) = sink.drain()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [external_hash(h) for h in r.block_hashes[:2]]
    assert ev.parent_block_hash is None and ev.token_ids == list(range(100, 108))
    assert (ev.block_size, ev.lora_id, ev.lora_name, ev.medium, ev.extra_keys) == (BS, None, None, "GPU", None)

    for t in (1, 2):  # two generated tokens fill block 2
        r.append_output_token(t)
        r.update_block_hashes(BS)
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    (ev,) = sink.drain()
    assert ev.block_hashes == [external_hash(r.block_hashes[2])]
    assert ev.parent_block_hash == external_hash(r.block_hashes[1])
    assert ev.token_ids == [108, 109, 1, 2]


def test_hits_are_not_stored_again_and_the_new_run_names_the_last_hit_as_parent():
    sink = KVEventSink()
    kv = KVCacheManager(16, BS, events=sink)
    admit(kv, request("a", list(range(9))))
    sink.drain()
    b = request("b", list(range(8)) + [50, 51, 52, 53, 54])  # shares blocks 0 and 1
    admit(kv, b)
    (ev,) = sink.drain()
    assert ev.block_hashes == [external_hash(b.block_hashes[2])]
    assert ev.parent_block_hash == external_hash(b.block_hashes[1]) and ev.token_ids == [50, 51, 52, 53]


def test_evictions_remove_what_was_stored_and_a_reset_clears_all():
    sink = KVEventSink()
    kv = KVCacheManager(4, BS, events=sink)
    a = request("a", list(range(13)))  # 3 full blocks + 1 token: the whole pool
    admit(kv, a)
    (ev,) = sink.drain()
    a_hashes = ev.block_hashes
    kv.free(a)  # freed tail first: block 3 (unhashed), 2, 1, 0 join the free queue in that order
    assert sink.drain() == []  # a freed block stays cached: nothing is removed yet
    b = request("b", [7] * 9)
    admit(kv, b)
    events = sink.drain()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert all(isinstance(e, BlockRemoved) and e.medium == MEDIUM_DEVICE for e in events[:-1])
    assert removed == [a_hashes[2], a_hashes[1]]  # least recently freed first; block 0 still cached
    assert isinstance(events[-1], BlockStored) and len(events[-1].block_hashes) == 2
    assert kv.get_computed_blocks(request("a2", list(range(13))))  # a's first block is still a hit
    kv.free(b)
    kv.reset_prefix_cache()
    assert sink.drain() == [AllBlocksCleared()]


def test_a_failed_step_reports_its_uncached_blocks_removed():
    sink = KVEventSink()
    kv = KVCacheManager(8, BS, events=sink)
    a = request("a", list(range(9)))
    admit(kv, a)
    (ev,) = sink.drain()
    kv.free(a, uncache_from_block=0)
    assert [h for e in sink.drain() for h in e.block_hashes] == ev.block_hashes


def test_salt_and_adapter_ride_in_extra_keys_and_change_every_hash():
    sink = KVEventSink()
    kv = KVCacheManager(16, BS, events=sink)
    tokens = list(range(12))
    lora = LoRARequest("tenant-adapter", 7, object())
    admit(kv, request("plain", tokens))
    admit(kv, request("salted", tokens, cache_salt="tenant-a"))
    admit(kv, request("lora", tokens, cache_salt="tenant-a", lora_request=lora))
    plain, salted, adapted = stored(sink.drain())
    assert plain.extra_keys is None
    assert salted.extra_keys == [("tenant-a",), None, None]  # the salt on the first block only
    assert (salted.lora_id, salted.lora_name) == (None, None)
    assert adapted.extra_keys == [("tenant-adapter", "tenant-a"), ("tenant-adapter",), ("tenant-adapter",)]
    assert (adapted.lora_id, adapted.lora_name) == (7, "tenant-adapter")
    assert plain.token_ids == salted.token_ids == adapted.token_ids == tokens  # every full block is stored
    hashes = [set(e.block_hashes) for e in (plain, salted, adapted)]
    assert not (hashes[0] & hashes[1] or hashes[1] & hashes[2] or hashes[0] & hashes[2])


def test_a_run_breaks_where_another_block_already_holds_the_hash():
    sink = KVEventSink()
    pool = BlockPool(4, events=sink)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, b"h" * 32) is True
    assert pool.cache_block(b, b"h" * 32) is False  # a duplicate: stays unshared, reports nothing
    assert pool.cache_block(a, b"g" * 32) is False  # already hashed
    pool.free_blocks([b])
    pool.get_new_blocks(3)  # reuses b (never findable) and two plain blocks: no removal
    assert sink.drain() == []


def test_events_off_builds_nothing(monkeypatch):
    kv = KVCacheManager(4, BS)
    assert kv.events is None and kv.pool.events is None

    def boom(*a, **k):
        raise AssertionError("an event was built with events off")

    monkeypatch.setattr("sluice.kvcache.manager.BlockStored", boom)
    monkeypatch.setattr("sluice.kvcache.block_pool.BlockRemoved", boom)
    monkeypatch.setattr("sluice.kvcache.block_pool.AllBlocksCleared", boom)
    a = request("a", list(range(13)))
    admit(kv, a)
    kv.free(a)
    b = request("b", [3] * 13)
    admit(kv, b)  # evicts a's blocks
    kv.free(b)
    kv.reset_prefix_cache()


def test_the_sink_is_bounded_and_counts_what_it_drops():
    sink = KVEventSink(max_events=2)
    for _ in range(3):
        sink.append(AllBlocksCleared())
    assert len(sink.drain()) == 2 and sink.num_dropped == 1
    sink.append(AllBlocksCleared())
    assert len(sink.drain()) == 1
    with pytest.raises(ValueError):
        KVEventSink(0)


def test_wire_layout_is_vllms_tagged_arrays():
    ev = BlockStored([1, 2], None, [5, 6, 7, 8, 9, 10, 11, 12], 4, None, "GPU", None)
    assert ev.wire() == ["BlockStored", [1, 2], None, [5, 6, 7, 8, 9, 10, 11, 12], 4, None, "GPU", None]
    ev.extra_keys = [("a", "s"), None]
    assert ev.wire()[-1] == [["a", "s"], None]
    assert BlockRemoved([3], "GPU").wire() == ["BlockRemoved", [3], "GPU"]
    assert AllBlocksCleared().wire() == ["AllBlocksCleared"]
