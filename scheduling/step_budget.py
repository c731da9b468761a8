"""The latency budget of a step (Sarathi-Serve's stall-free batching): how much prompt work a step may carry.

While requests are decoding, every one of them waits for the whole step before its next token, so a step takes
prompt tokens only up to what keeps it within a time-between-tokens target, measured by the online cost model.
The target is `--max-itl-ms`, or by default twice what a decode-only step of the current batch costs: a running
stream then keeps at least half its idle token rate while a long prompt is prefilled beside it, and the prompt
goes on at about half its solo rate. Whose prompt work the target holds back is fairness's call (prefill_plan.py):
that of clients served at least as much as the streams; a burst queued before the streams began is not held.
With nothing decoding there is no one to stall: prompt work takes the whole token budget, as before.

The auto target's base is measured, not only extrapolated: a step that runs just the rows the target is made of
(every decoding row; one per client while a crowd's extra rows may wait, decode_rows.py) is timed, and the target
is twice the lesser of that time and the cost model's prediction. The model alone would extrapolate from the
steps it sees, and a crowd's steps (many rows, many of them under a grammar, their contexts growing together)
leave it unable to tell a row's cost from a step's. With the auto target, one step in PROBE_EVERY runs only those
rows (no prompt work, no extra rows) while prompts or a crowd wait, and sooner (after PROBE_SOON steps) when no
base was measured within BASE_ROWS_SPAN times its present number of rows: the machine may speed up or slow down
meanwhile. A base measured at another number of rows is carried to the present one by the model's ratio between
the two (a burst's rows grow step by step: probing each count would delay its prompts by a step each time). Only
a target that guards someone is measured: before any stream is established, prompt work is not held for it
(prefill_plan.py), and a probe would only delay the prompts.

The planner aims a little under the target (AIM), and the measured steps feed back: a time credit (each step the
target limited adds the aim less its measured time, the past fading) moves what the planner aims at, so that steps
average the aim even where the model errs.

Prompts always progress, however tight the target or wrong the model: a step carries at least one KV block's worth
of prompt work while the streams are within their target on average (the credit is not negative). When even one
block does not fit in the target (a small batch on a slow machine), smaller chunks go in, the minimum as the
credit allows, and never fewer than once in STARVE_STEPS steps. The model is not trusted beyond twice the most
prompt tokens it has seen in one step: a cold one learns by doubling, never by one long stall.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.scheduling.config import SchedulerConfig
from sluice.scheduling.cost_model import StepCostModel, StepShape

AUTO_ITL_FACTOR = 2.0  # target = this x a decode-only step: a stream keeps at least 1 / factor of its idle rate
STARVE_STEPS = 4  # steps in a row without prompt tokens after which the minimum goes in whatever it costs
CREDIT_LEAK, CREDIT_GAIN = 0.9, 0.3  # the credit's memory per step, and how much of it moves the planning target
AIM = 0.9  # the planner aims this far under the target: a step a little slower than predicted still keeps it
# A stream is guarded once it has produced this many tokens; before, it is still part of the burst it arrived with:
# over HTTP a burst's requests arrive over a few hundred ms, and those queued after its first ones began to stream
# would otherwise start level with them and be held to the target (workload A's time to first token, +0.7 s).
ESTABLISHED_TOKENS = 16
PROBE_EVERY = 32  # with the auto target, one step in this many runs only the target's base rows (see probe_due)
PROBE_SOON = 8  # ... or one in this many while the base is unmeasured near its present number of rows
BASE_ROWS_SPAN = 2  # a base measured at up to this factor more or fewer rows is carried to the present rows
BASE_MEMORY = 0.5  # weight of the past in the measured base step (per base-shaped step measured)


@dataclass(slots=True)
class StepDecision:
    """How one step's prompt work was chosen: the step trace and the metrics read it."""

    token_budget: int = 0  # max_num_batched_tokens
    decode_rows: int = 0  # requests decoding in this step
    base_rows: int = 0  # the decoding rows the time target is made of (one per client while a crowd's rows wait)
    probe: bool = False  # this step runs only the base rows, to measure what the target is made of
    itl_target_s: float = 0.0  # the time this step should stay within (0: nothing decoding, no target)
    prefill_budget: int = 0  # prompt tokens the target allowed (at least the minimum progress)
    prefill_tokens: int = 0  # prompt tokens granted
    flows_served: int = 0  # flows that got prompt tokens
    time_bound: bool = False  # the time target limited the prompt tokens (more were waiting)
    predicted_s: float = 0.0  # the cost model's estimate for the step as planned
    shape: StepShape = field(default_factory=StepShape)  # what it computed, for the cost model

    def trace(self) -> dict[str, float | int]:
        """Span-event and log attributes (plain numbers)."""
        return {"itl_target_ms": round(self.itl_target_s * 1e3, 2), "prefill_budget": self.prefill_budget,
                "prefill_tokens": self.prefill_tokens, "decode_rows": self.decode_rows,
                "flows_served": self.flows_served, "predicted_ms": round(self.predicted_s * 1e3, 2)}


class LatencyBudget:
    """Turns the decoding batch into a time target and tells the planner whether one more grant still fits."""

    def __init__(self, config: SchedulerConfig, block_size: int) -> None:
        self.enabled = config.max_itl_ms >= 0
        self.fixed_target_s = config.max_itl_ms / 1e3 if config.max_itl_ms > 0 else 0.0
        self.min_prefill = max(1, block_size)  # one block a step: prompts never starve
        self.model = StepCostModel()
        self.largest_prefill = 0  # most prompt tokens of a measured step: the model is trusted to twice that
        self.largest_rows = 0  # most decoding rows of a measured step: likewise
        self.credit = 0.0  # seconds the decoding steps stayed under their targets, recently (leaky sum)
        self.starved = 0  # steps in a row that had prompt work pending and granted none
        self.mixed_run = 0  # steps with decoding rows since the last one that ran only the base rows
        self.base_step: tuple[StepShape, float] | None = None  # the latest steps of only the base rows, and seconds

    def target(self, decode_shape: StepShape) -> float:
        """Seconds a step with this decoding batch should stay within (0 where nothing decodes or it is off)."""
        if not self.enabled or not decode_shape.decode_rows:
            return 0.0
        if self.fixed_target_s:
            return self.fixed_target_s
        base = self.model.predict_decode(decode_shape)
        measured = self._measured_base(decode_shape)
        return AUTO_ITL_FACTOR * (base if measured is None else min(base, measured))

    def _measured_base(self, shape: StepShape) -> float | None:
        """Seconds the latest steps of only the base rows took: as measured at `shape`'s number of rows, or carried to
        it by the model's ratio from up to BASE_ROWS_SPAN times more or fewer rows (else None)."""
        if self.base_step is None:
            return None
        measured, seconds = self.base_step
        rows, then = shape.decode_rows, measured.decode_rows
        if rows == then:
            return seconds
        if not (then <= rows * BASE_ROWS_SPAN and rows <= then * BASE_ROWS_SPAN):
            return None
        before = self.model.predict_decode(measured)
        return seconds * self.model.predict_decode(shape) / before if before > 0 else None

    def probe_due(self, decision: StepDecision, base: StepShape, guarding: bool = True) -> bool:
        """Whether this step should run only its `base` rows, prompt work or a crowd's rows waiting: the auto target
        is made of what such a step costs, and a long prefill or a crowd would otherwise leave that measurement
        stale or missing for as long as it lasts. One step in PROBE_EVERY (~3% of a prompt's steps), or in
        PROBE_SOON while the base is unmeasured near its present number of rows; never while the target guards
        no one (`guarding`: no established stream decodes and no crowd's rows wait)."""
        if self.fixed_target_s or not decision.itl_target_s or not guarding:
            return False
        self.mixed_run += 1
        # Whether the base is measured (the model's predictions, where rows differ) matters only between the two.
        if self.mixed_run < PROBE_SOON or (self.mixed_run < PROBE_EVERY and self._measured_base(base) is not None):
            return False
        self.mixed_run = 0
        return True

    def floor(self, decision: StepDecision) -> int:
        """Prompt tokens this step carries whatever the target says."""
        if not decision.decode_rows or self.credit >= 0 or self.starved >= STARVE_STEPS:
            return self.min_prefill
        return 0

    def granted(self, tokens: int) -> None:
        """The planner granted `tokens` prompt tokens with prompt work pending."""
        self.starved = 0 if tokens else self.starved + 1

    def trusted(self, decision: StepDecision, shape: StepShape) -> int:
        """Prompt tokens one more grant may take before the model would extrapolate past twice the most it has seen
        in one measured step (it grows by doubling as steps are seen, never by one long stall)."""
        if not self.enabled or not decision.decode_rows:
            return 1 << 30
        return max(0, 2 * self.largest_prefill - shape.prefill_tokens)

    def trusted_rows(self) -> int:
        """Decoding rows a step may hold before the model would extrapolate past twice the most it has measured."""
        return 2 * self.largest_rows

    def fits(self, decision: StepDecision, shape: StepShape) -> bool:
        """Whether a step of `shape` stays within the decision's target (beyond the minimum progress)."""
        if not self.enabled or not decision.decode_rows:
            return True
        return self.model.predict(shape) <= self.planning_target(decision.itl_target_s)

    def planning_target(self, target: float) -> float:
        """The target the planner aims at: corrected by the credit, so that measured steps average the target
        even where the model's predictions run high or low (a leaky integral controller, within half the target)."""
        return min(max(AIM * target + CREDIT_GAIN * self.credit, 0.5 * target), 1.5 * target)

    def observe(self, decision: StepDecision, seconds: float) -> bool | None:
        """Feed a measured step to the cost model; whether it kept its target (None: it had none)."""
        self.model.observe(decision.shape, seconds)
        shape = decision.shape
        if shape.decode_rows and not shape.prefill_tokens and shape.decode_rows <= decision.base_rows:
            self.mixed_run = 0
            last = self._measured_base(shape)
            seconds_now = seconds if last is None else BASE_MEMORY * last + (1 - BASE_MEMORY) * seconds
            self.base_step = (shape.copy(), seconds_now)
        self.largest_prefill = max(self.largest_prefill, decision.shape.prefill_tokens)
        self.largest_rows = max(self.largest_rows, decision.shape.decode_rows)
        if not decision.itl_target_s:
            return None
        target = decision.itl_target_s
        # Only steps the time target sized count: a step with no prompt work waiting, or less than the target
        # would allow, is under target by nature.
        self.credit = CREDIT_LEAK * self.credit + (AIM * target - seconds if decision.time_bound else 0.0)
        return seconds <= target
