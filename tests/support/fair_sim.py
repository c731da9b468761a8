"""A scheduler simulation with a synthetic step cost: the latency budget and fair shares, model-free."""

from __future__ import annotations

from collections.abc import Callable

from sluice.scheduling.cost_model import StepShape
from sluice.scheduling.output import SchedulerOutput
from sluice.scheduling.request import Request
from sluice.scheduling.sampling_params import SamplingParams
from sluice.scheduling.scheduler import Scheduler
from sluice.scheduling.step_budget import ESTABLISHED_TOKENS
from tests.support.fake_runner import FakeRunner
from tests.support.sched_helpers import make_scheduler

# a, a_p, b, c, e, f, g of scheduling/cost_model.py: 4 ms a step, 0.5 ms more with prompt tokens, 0.1 ms a prompt
# token, 0.8 ms a decoding row, 0.2 ms per thousand context tokens, 5 ms per million attention pairs, 1 ms more a
# row under a grammar.
COST = (4e-3, 5e-4, 1e-4, 8e-4, 2e-4, 5e-3, 1e-3)


def step_cost(shape: StepShape, coef=COST) -> float:
    """The synthetic machine: seconds of a step of this shape."""
    return sum(c * x for c, x in zip(coef, shape.features(), strict=True))


def request(rid: str, prompt_len: int, max_tokens: int, flow: str | None = None, tenant: str | None = None,
            priority: int = 0, arrival: float | None = None, seed: int = 0) -> Request:
    """A request of distinct tokens (no accidental prefix hits across prompts unless `seed` repeats)."""
    prompt = [(seed * 7919 + i * 31 + 1) % 1000 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, prompt, params, eos_token_id=None, priority=priority, arrival_time=arrival, flow_id=flow,
                   tenant=tenant)


class Sim:
    """Steps a scheduler with the fake runner, feeding each step's synthetic time to its cost model."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner, cost: Callable[[StepShape], float] = step_cost):
        self.sched, self.runner, self.cost = scheduler, runner, cost
        self.tokens: dict[str, list[int]] = {}  # request id -> generated tokens
        self.first_token_step: dict[str, int] = {}
        self.steps: list[SchedulerOutput] = []
        self.kept: list[bool] = []  # steps with a target: whether they kept it

    def step(self) -> SchedulerOutput:
        """One step; returns what was scheduled."""
        out = self.sched.schedule()
        kept = self.sched.observe_step(out, self.cost(out.decision.shape))
        if kept is not None:
            self.kept.append(kept)
        for ro in self.sched.update_from_output(out, self.runner.execute(out)):
            if ro.new_token_ids:
                self.first_token_step.setdefault(ro.request_id, len(self.steps))
                self.tokens.setdefault(ro.request_id, []).extend(ro.new_token_ids)
        self.steps.append(out)
        return out

    def run(self, steps: int, until: Callable[[], bool] | None = None) -> None:
        """Up to `steps` steps, stopping early once `until()` holds."""
        for _ in range(steps):
            if until is not None and until():
                return
            self.step()

    def scheduled(self, out: SchedulerOutput, rid: str) -> int:
        """Tokens `rid` computed in step `out` (0 if none)."""
        return next((s.num_tokens for s in out.scheduled if s.request_id == rid), 0)


BUDGET = 256  # max_num_batched_tokens of sim()
STREAM_STEPS = ESTABLISHED_TOKENS + 2  # the steps decoding_stream() runs


def sim(**kw) -> Sim:
    """A simulation over a scheduler of 2,048 blocks of 4 tokens and a step budget of BUDGET tokens."""
    sched, runner = make_scheduler(num_blocks=2048, block_size=4, max_num_batched_tokens=BUDGET, **kw)
    return Sim(sched, runner)


def decoding_stream(s: Sim, rid: str = "stream") -> None:
    """A stream established (ESTABLISHED_TOKENS produced: the target guards it; the model saw its decode steps)."""
    s.sched.add_request(request(rid, 8, 400))
    s.run(STREAM_STEPS)
    assert len(s.tokens[rid]) >= ESTABLISHED_TOKENS
