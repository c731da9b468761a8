"""The latency budget: with streams decoding, a long prompt is chunked to keep each step within the target the
measured cost model gives; with nothing decoding it takes the whole step budget; prompts always progress."""

from __future__ import annotations

import pytest

from sluice.scheduling.cost_model import StepShape
from sluice.scheduling.step_budget import AUTO_ITL_FACTOR, ESTABLISHED_TOKENS, STARVE_STEPS
from tests.support.fair_sim import BUDGET, STREAM_STEPS, Sim, decoding_stream, request, sim, step_cost
from tests.support.sched_helpers import make_scheduler


def decode_only_cost(out) -> float:
    """What the step would have cost without its prompt work."""
    shape = StepShape()
    for row in out.scheduled:
        if row.num_output_tokens and row.start_pos == row.num_prompt_tokens + row.num_output_tokens - 1:
            shape.add_decode(row.start_pos, row.num_tokens)
    return step_cost(shape)


def test_with_a_stream_decoding_a_long_prompt_is_chunked_to_the_target():
    s = sim()
    decoding_stream(s)
    s.sched.add_request(request("long", 3000, 1, seed=1))
    s.run(400, until=lambda: "long" in s.tokens)
    assert "long" in s.tokens, "the long prompt never finished"
    mixed = [out for out in s.steps[STREAM_STEPS:] if s.scheduled(out, "long") and s.scheduled(out, "stream")]
    assert len(mixed) > 20
    chunks = [s.scheduled(out, "long") for out in mixed]
    assert max(chunks) < BUDGET - 1 and min(chunks[:-1]) >= 4  # chunked, and never below one block
    for out in mixed[3:]:  # a few steps to learn what prompt tokens cost
        target = AUTO_ITL_FACTOR * decode_only_cost(out)
        assert out.decision.itl_target_s == pytest.approx(target, rel=0.05)
        assert step_cost(out.decision.shape) <= target * 1.05, out.decision
    # The stream got its token in every one of those steps, each within twice its idle step time.
    assert all(s.scheduled(out, "stream") == 1 for out in s.steps[STREAM_STEPS:] if s.scheduled(out, "long"))
    assert sum(s.kept) >= 0.9 * len(s.kept)
    # Later chunks sit deeper in the prompt (attention reads more): they get smaller, within the same time.
    assert chunks[-2] < chunks[5]


def test_with_nothing_decoding_a_prompt_takes_the_whole_budget():
    s = sim()
    s.sched.add_request(request("long", 3000, 1))
    s.run(20, until=lambda: "long" in s.tokens)
    chunks = [s.scheduled(out, "long") for out in s.steps]
    assert chunks[:-1] == [BUDGET] * (len(chunks) - 1) and sum(chunks) == 3000
    assert all(out.decision.itl_target_s == 0 for out in s.steps)


def test_prompts_progress_however_tight_the_target():
    """A target below what a decode-only step costs: the prompt still gets a block at least every few steps."""
    s = sim(max_itl_ms=0.001)
    decoding_stream(s)
    s.sched.add_request(request("long", 100, 1, seed=1))
    s.run(200, until=lambda: "long" in s.tokens)
    chunks = [s.scheduled(out, "long") for out in s.steps[STREAM_STEPS:]]
    # A block at a time (or the few tokens that keep its client level with the stream's service), till done.
    assert max(chunks) == 4 and 0 in chunks and sum(chunks) == 100
    done = [i for i, n in enumerate(chunks) if n]
    assert max(b - a for a, b in zip([-1, *done], done, strict=False)) <= STARVE_STEPS + 1
    assert not any(s.kept)


def test_when_one_block_costs_more_than_the_target_allows_the_streams_keep_it_on_average():
    """Prompt tokens so dear that one block alone breaks the target: smaller chunks, a block only when the credit
    allows, and the steps stay within the target on average (the time credit)."""
    dear = (4e-3, 5e-4, 2e-3, 8e-4, 2e-4, 5e-3, 1e-3)  # a block of 4 prompt tokens: 8.5 ms beside a 4.8 ms decode step
    sched, runner = make_scheduler(num_blocks=2048, block_size=4, max_num_batched_tokens=BUDGET)
    s = Sim(sched, runner, cost=lambda shape: step_cost(shape, dear))
    decoding_stream(s)
    s.sched.add_request(request("long", 400, 1, seed=1))
    s.run(400, until=lambda: "long" in s.tokens)
    steps = [out for out in s.steps[STREAM_STEPS + 10:] if out.decision.itl_target_s]
    chunks = [s.scheduled(out, "long") for out in steps]
    assert max(chunks) == 4 and min(chunks) < 4
    mean_step = sum(step_cost(out.decision.shape, dear) for out in steps) / len(steps)
    mean_target = sum(out.decision.itl_target_s for out in steps) / len(steps)
    assert mean_step <= mean_target * 1.1


def test_off_restores_the_whole_leftover_budget():
    s = sim(max_itl_ms=-1)
    decoding_stream(s)
    s.sched.add_request(request("long", 1000, 1, seed=1))
    out = s.step()
    assert s.scheduled(out, "long") == BUDGET - 1 and s.scheduled(out, "stream") == 1
    assert out.decision.itl_target_s == 0


def test_a_fixed_target_bounds_the_step():
    s = sim(max_itl_ms=20)
    decoding_stream(s)
    s.sched.add_request(request("long", 3000, 1, seed=1))
    s.run(60)
    mixed = [out for out in s.steps[STREAM_STEPS + 4:] if s.scheduled(out, "long")]
    assert mixed and all(out.decision.itl_target_s == 0.02 for out in mixed)
    assert all(step_cost(out.decision.shape) <= 0.02 * 1.05 for out in mixed)
    assert max(s.scheduled(out, "long") for out in mixed) > 4  # the budget is real, not only the minimum


def test_before_any_prompt_step_was_measured_only_the_minimum_goes_beside_decodes():
    """A cold model knows nothing of what prompt tokens cost: it takes one block, measures, then sizes."""
    s = sim()
    s.sched.add_request(request("a", 1, 50))  # a one-token prompt, then decoding (an established stream)
    s.run(ESTABLISHED_TOKENS + 1)
    s.sched.latency.model.__init__()  # forget the prefill step it measured
    s.step()  # decode only
    s.sched.add_request(request("long", 2000, 1, seed=1))
    first, second = s.step(), s.step()
    assert s.scheduled(first, "long") == 4 and s.scheduled(second, "long") > 4


def test_a_burst_arriving_beside_its_own_first_streams_is_not_held_but_beside_an_established_one_it_is():
    """Requests of one burst reach the server over a few hundred ms: those queued after its first ones began to
    stream are prefilled at the full budget while those streams are young (fewer than ESTABLISHED_TOKENS tokens);
    the same requests beside an established stream are held to the target."""
    dear = (4e-3, 5e-4, 2e-3, 8e-4, 2e-4, 5e-3, 1e-3)  # prompt tokens that the target would hold back

    def late_burst(established: bool) -> int:
        sched, runner = make_scheduler(num_blocks=2048, block_size=4, max_num_batched_tokens=BUDGET)
        s = Sim(sched, runner, cost=lambda shape: step_cost(shape, dear))
        if established:
            decoding_stream(s)
        first = [f"a{i}" for i in range(4)]
        for i, rid in enumerate(first):
            s.sched.add_request(request(rid, 60, 40, seed=200 + i))
        s.run(100, until=lambda: all(rid in s.tokens for rid in first))  # noqa: B023
        assert all(len(s.tokens[rid]) < ESTABLISHED_TOKENS for rid in first)  # streaming, still young
        for i in range(40):
            s.sched.add_request(request(f"b{i}", 60, 40, seed=300 + i))
        out = s.step()
        return sum(row.num_tokens for row in out.scheduled if row.request_id.startswith("b"))

    young, beside_stream = late_burst(False), late_burst(True)
    assert young == BUDGET - 4  # every token the burst's four decode rows left
    assert beside_stream < young / 4


def test_the_target_is_made_of_the_measured_base_step_where_the_model_runs_high():
    from sluice.scheduling.config import SchedulerConfig
    from sluice.scheduling.step_budget import LatencyBudget, StepDecision

    budget = LatencyBudget(SchedulerConfig(), 16)
    crowd, one = StepShape(), StepShape()
    for i in range(10):
        crowd.add_decode(100 + 50 * i, constrained=i > 0)
    one.add_decode(100)
    for _ in range(20):  # a crowd's steps only: the model extrapolates to one row
        budget.observe(StepDecision(decode_rows=10, base_rows=1, itl_target_s=1.0, shape=crowd), 0.060)
    predicted = budget.model.predict_decode(one)
    assert budget.target(one) == pytest.approx(AUTO_ITL_FACTOR * predicted)  # unmeasured: the model's
    budget.observe(StepDecision(decode_rows=1, base_rows=1, itl_target_s=1.0, shape=one), 0.5 * predicted)
    assert budget.base_step == (one, pytest.approx(0.5 * predicted))
    assert 0.5 * predicted < budget.model.predict_decode(one)  # the model still runs high
    assert budget.target(one) == pytest.approx(AUTO_ITL_FACTOR * 0.5 * predicted)  # the measured step
    budget.observe(StepDecision(decode_rows=1, base_rows=1, itl_target_s=1.0, shape=one), 10.0)  # a stall
    assert budget.target(one) == pytest.approx(AUTO_ITL_FACTOR * budget.model.predict_decode(one))  # the lesser
    budget.base_step = (one, 0.5 * predicted)
    two, three = StepShape(), StepShape()
    for i in range(3):
        three.add_decode(100)
        if i < 2:
            two.add_decode(100)
    carried = 0.5 * predicted * budget.model.predict_decode(two) / budget.model.predict_decode(one)
    assert budget.target(two) == pytest.approx(AUTO_ITL_FACTOR * carried)  # carried by the model's ratio
    assert budget.target(three) == pytest.approx(  # more than BASE_ROWS_SPAN times the rows measured: not used
        AUTO_ITL_FACTOR * budget.model.predict_decode(three))


def test_a_probe_comes_sooner_while_the_base_is_unmeasured():
    from sluice.scheduling.config import SchedulerConfig
    from sluice.scheduling.step_budget import BASE_ROWS_SPAN, PROBE_EVERY, PROBE_SOON, LatencyBudget, StepDecision

    budget = LatencyBudget(SchedulerConfig(), 16)
    decision = StepDecision(decode_rows=3, base_rows=2, itl_target_s=0.02)
    base, far = StepShape(), StepShape()
    for _ in range(2):
        base.add_decode(100)
    for _ in range(2 * BASE_ROWS_SPAN + 1):
        far.add_decode(100)
    due = [budget.probe_due(decision, base) for _ in range(3 * PROBE_SOON)]
    assert [i for i, d in enumerate(due) if d] == [PROBE_SOON - 1, 2 * PROBE_SOON - 1, 3 * PROBE_SOON - 1]
    budget.observe(StepDecision(decode_rows=2, base_rows=2, itl_target_s=0.02, shape=base), 0.01)  # measured
    due = [budget.probe_due(decision, base) for _ in range(2 * PROBE_EVERY)]
    assert [i for i, d in enumerate(due) if d] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1]
    due = [budget.probe_due(decision, far) for _ in range(PROBE_SOON)]  # measured at too few rows: sooner
    assert [i for i, d in enumerate(due) if d] == [PROBE_SOON - 1]
    assert not any(budget.probe_due(StepDecision(decode_rows=3, base_rows=2), base) for _ in range(2 * PROBE_EVERY))
    assert not any(budget.probe_due(decision, base, guarding=False) for _ in range(2 * PROBE_EVERY))


def test_a_burst_is_probed_only_once_its_streams_are_guarded_and_seldom_while_its_rows_grow():
    """64 requests at once (workload A): a probe delays every prompt still waiting by a step. None while no stream is
    established (the target holds nothing back then); after, the base measured at fewer rows is carried to the
    growing row count, so probes come one in PROBE_EVERY, not one in PROBE_SOON."""
    from sluice.scheduling.step_budget import PROBE_EVERY

    s = sim(max_num_seqs=64)
    for i in range(64):
        s.sched.add_request(request(f"r{i}", 100, 64, seed=i))
    s.run(400, until=lambda: len(s.first_token_step) == 64)
    assert len(s.first_token_step) == 64
    probes = [k for k, out in enumerate(s.steps) if out.decision.probe]
    established = next(k for k, out in enumerate(s.steps)
                       if any(row.num_output_tokens >= ESTABLISHED_TOKENS for row in out.scheduled))
    assert probes and min(probes) >= established
    assert len(probes) <= 1 + (len(s.steps) - established) // PROBE_EVERY, (probes, established, len(s.steps))
