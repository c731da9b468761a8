"""Drive a Scheduler + KVCacheManager with the fake runner, no model involved."""

from __future__ import annotations

from sluice.kvcache.manager import KVCacheManager
from sluice.scheduling.config import SchedulerConfig
from sluice.scheduling.request import Request
from sluice.scheduling.sampling_params import SamplingParams
from sluice.scheduling.scheduler import Scheduler
from tests.fake_runner import FakeRunner


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
