"""Exported gauges and preemption counters equal the real scheduler's and KV cache's own state, step by step."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from sluice.metrics.prometheus import SluiceMetrics
from sluice.scheduling.request import RequestStatus
from tests.support.sched_helpers import make_request, make_scheduler

MODEL = "sched"
NUM_BLOCKS, BLOCK_SIZE, HOST_BLOCKS = 10, 4, 6


def value(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, {"model_name": MODEL, **labels})


def truth(scheduler, host_blocks: int) -> dict[str, float]:
    """The state recounted from blocks and request statuses, not from the scheduler's own stats."""
    kv = scheduler.kv
    free = sum(1 for b in kv.pool.blocks if b.ref_cnt == 0)
    statuses = [r.status for r in scheduler.requests.values()]
    return {
        "sluice_kv_cache_free_blocks": free,
        "sluice_kv_cache_total_blocks": NUM_BLOCKS,
        "sluice_kv_cache_usage_ratio": (NUM_BLOCKS - free) / NUM_BLOCKS,
        "sluice_swap_free_blocks": host_blocks - sum(len(h) for h in kv.req_host_blocks.values()),
        "sluice_swap_total_blocks": host_blocks,
        "sluice_requests_waiting": sum(s in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for s in statuses),
        "sluice_requests_running": statuses.count(RequestStatus.RUNNING),
        "sluice_requests_swapped": statuses.count(RequestStatus.SWAPPED),
    }


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_gauges_and_preemptions_match_scheduler_state(mode):
    reg = CollectorRegistry()
    metrics = SluiceMetrics(MODEL, reg)
    host_blocks = HOST_BLOCKS if mode == "swap" else 0
    scheduler, runner = make_scheduler(
        NUM_BLOCKS, BLOCK_SIZE, host_blocks, preemption_mode=mode,
        max_num_batched_tokens=32,
    )
    # Five requests that grow to 5 blocks each on a 10-block pool: preemption is unavoidable.
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", [100 + i] * 8 + [i], max_tokens=11, arrival=float(i)))
    preempted = {"recompute": 0, "swap": 0}
    aborted = False
    for step in range(500):
        if not scheduler.num_unfinished:
            break
        out = scheduler.schedule()
        for rid in out.preempted_ids:  # classify each victim by where it went
            status = scheduler.requests[rid].status
            preempted["swap" if status == RequestStatus.SWAPPED else "recompute"] += 1
        scheduler.update_from_output(out, runner.execute(out))
        if step == 6 and not aborted:  # a client goes away mid-run: its blocks free at once
            victim = next(iter(scheduler.requests))
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted = True
        metrics.observe_step(scheduler.make_stats())
        for name, expected in truth(scheduler, host_blocks).items():
            assert value(reg, name) == pytest.approx(expected), (step, name)
        for m, n in preempted.items():
            assert value(reg, "sluice_preemptions_total", mode=m) == n, (step, m)
    else:
        pytest.fail("scheduler did not drain")

    assert aborted
    assert preempted[mode] > 0, f"the scenario must force a {mode} preemption"
    if mode == "recompute":
        assert preempted["swap"] == 0
    # Everything ended: the gauges say the cache and swap pool are entirely free.
    assert value(reg, "sluice_kv_cache_free_blocks") == NUM_BLOCKS
    assert value(reg, "sluice_kv_cache_usage_ratio") == 0
    assert value(reg, "sluice_swap_free_blocks") == host_blocks
    for gauge in ("waiting", "running", "swapped"):
        assert value(reg, f"sluice_requests_{gauge}") == 0
    # Counters: generated tokens are exact (4 full requests + the aborted one's partial output).
    assert value(reg, "sluice_generation_tokens_total") >= 4 * 11
