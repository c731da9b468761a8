"""Scheduler + KV manager alone: cost of schedule() + update_from_output() per step with N running requests."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from sluice.kvcache.manager import KVCacheManager
from sluice.scheduling.config import SchedulerConfig
from sluice.scheduling.output import ModelRunnerOutput, SchedulerOutput
from sluice.scheduling.request import Request
from sluice.scheduling.sampling_params import SamplingParams
from sluice.scheduling.scheduler import Scheduler


@dataclass(slots=True)
class SchedulerPoint:
    """Per-step bookkeeping cost with `num_running` requests all decoding."""

    num_running: int
    steps: int
    schedule_us: float
    update_us: float
    step_us: float
    us_per_request: float


class NullRunner:
    """A model-free runner: every request that may sample gets the same token, instantly."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Sample token 7 for each sampling request."""
        return ModelRunnerOutput(sampled={s.request_id: 7 for s in out.scheduled if s.sample})


def measure(
    num_running: int, steps: int = 30, prompt_len: int = 100, block_size: int = 16, seed: int = 0
) -> SchedulerPoint:
    """Admit num_running requests, then time `steps` pure-decode steps (median per phase)."""
    rng = random.Random(seed)
    max_len = prompt_len + steps + 8
    num_blocks = num_running * -(-max_len // block_size) + 16
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=num_running * prompt_len)
    scheduler = Scheduler(config, kv, max_model_len=max_len + 8)
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(num_running):
        scheduler.add_request(Request(f"r{i}", [rng.randrange(3, 30000) for _ in range(prompt_len)], params, None))
    runner = NullRunner()
    out = scheduler.schedule()  # the whole prefill in one step
    scheduler.update_from_output(out, runner.execute(out))
    sched_t, update_t = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        result = runner.execute(out)
        t2 = time.perf_counter()
        scheduler.update_from_output(out, result)
        t3 = time.perf_counter()
        assert len(out.scheduled) == num_running, "every request should decode in every measured step"
        sched_t.append(t1 - t0)
        update_t.append(t3 - t2)
    s, u = 1e6 * statistics.median(sched_t), 1e6 * statistics.median(update_t)
    return SchedulerPoint(num_running, steps, s, u, s + u, (s + u) / num_running)


def scheduler_scaling(
    sizes: tuple[int, ...] = (64, 256, 1024), steps: int = 30, repeats: int = 3
) -> list[SchedulerPoint]:
    """One point per size; compare us_per_request across sizes to see the growth (flat = linear).

    Each size keeps its fastest of `repeats` runs, taken in turns: a sub-millisecond step on a shared machine
    swings by 2x from one run to the next, and the minimum is the stable estimate of what the code costs.
    """
    measure(16, steps=3)  # warm the interpreter's caches before the first timed size
    best: dict[int, SchedulerPoint] = {}
    for _ in range(repeats):
        for n in sizes:
            point = measure(n, steps)
            if n not in best or point.step_us < best[n].step_us:
                best[n] = point
    return [best[n] for n in sizes]
