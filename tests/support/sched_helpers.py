"""Drive a Scheduler + KVCacheManager with the fake runner, no model involved."""

from __future__ import annotations

from collections import Counter

from sluice.kvcache.manager import KVCacheManager
from sluice.scheduling.config import SchedulerConfig
from sluice.scheduling.request import Request, RequestStatus
from sluice.scheduling.sampling_params import SamplingParams
from sluice.scheduling.scheduler import Scheduler
from tests.support.fake_runner import FakeRunner


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    num_host_blocks: int = 0,
    prefix_caching: bool = True,
    max_model_len: int = 4096,
    **sched_kwargs,
) -> tuple[Scheduler, FakeRunner]:
    """A scheduler over a fresh KV manager, plus a fake runner of the same geometry."""
    kv = KVCacheManager(num_blocks, block_size, prefix_caching, num_host_blocks)
    sched_kwargs.setdefault("max_num_batched_tokens", 2048)
    scheduler = Scheduler(SchedulerConfig(**sched_kwargs), kv, max_model_len)
    return scheduler, FakeRunner(num_blocks, block_size, num_host_blocks)


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, priority: int = 0, arrival: float | None = None):
    """A request that ignores EOS so its length is exactly max_tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, prompt, params, eos_token_id=None, priority=priority, arrival_time=arrival)


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000, on_step=None) -> dict:
    """Step until nothing is left; returns request_id → output tokens."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            return outputs
        out = scheduler.schedule()
        if on_step:
            on_step(scheduler, out)
        for ro in scheduler.update_from_output(out, runner.execute(out)):
            outputs.setdefault(ro.request_id, []).extend(ro.new_token_ids)
    raise AssertionError("scheduler did not finish (livelock?)")


def check_invariants(sched) -> None:
    kv = sched.kv
    pool = kv.pool
    refs = Counter()
    for blocks in kv.req_blocks.values():
        for b in blocks:
            refs[b.block_id] += 1
    for block in pool.blocks:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == refs[block.block_id], f"{block} referenced by {refs[block.block_id]} tables"
        if refs[block.block_id] > 1:
            assert block.block_hash is not None, f"{block} shared but is not a cached prefix block"
    assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    assert sorted(pool.free_queue.block_ids()) == sorted(b.block_id for b in pool.blocks if b.ref_cnt == 0)
    for h, b in pool.cached.items():
        assert b.block_hash == h
    host_used = [h for hs in kv.req_host_blocks.values() for h in hs]
    assert len(host_used) == len(set(host_used))
    assert len(host_used) + kv.swap_space.num_free_blocks == kv.swap_space.num_blocks
    # every live request is in exactly one place that matches its status
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
    for r in sched.swapped:
        assert r.status == RequestStatus.SWAPPED and r.request_id in kv.req_host_blocks
    assert len(sched.running) + len(sched.swapped) + len(sched.waiting) == sched.num_unfinished
