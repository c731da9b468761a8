"""A client decoding many rows beside another client's stream: its extra rows wait their turn within the step's
time target, every client's first row goes in, and a crowd alone (or a burst of single streams) is never held."""

from __future__ import annotations

import dataclasses

from sluice.scheduling.cost_model import StepShape
from sluice.scheduling.decode_rows import crowded
from sluice.scheduling.sampling_params import StructuredOutput
from sluice.scheduling.step_budget import AUTO_ITL_FACTOR
from tests.support.fair_sim import COST, STREAM_STEPS, Sim, decoding_stream, request, sim, step_cost

CROWD, CROWD_TOKENS = 40, 30


def add_crowd(s: Sim, flow: str | None = "crowd", prefix: str = "c", grammar: bool = False) -> list[str]:
    ids = [f"{prefix}{i}" for i in range(CROWD)]
    for i, rid in enumerate(ids):
        r = request(rid, 8, CROWD_TOKENS, flow=flow, seed=100 + i)
        if grammar:
            r.sampling_params = dataclasses.replace(r.sampling_params,
                                                    structured_output=StructuredOutput("regex", "[a-z]+", "re"))
        s.sched.add_request(r)
    return ids


def decoding_rows(s: Sim) -> list:
    return [r for r in s.sched.running if r.num_output_tokens and r.num_computed_tokens == r.num_tokens - 1]


def test_a_crowd_of_rows_beside_a_stream_keeps_the_streams_steps_within_the_target():
    s = sim()
    decoding_stream(s)
    crowd = add_crowd(s)
    spreads, held_steps = [], 0
    while not all(len(s.tokens.get(rid, ())) == CROWD_TOKENS for rid in crowd):
        assert len(s.steps) < 2000, "the crowd never finished"
        rows = [r for r in decoding_rows(s) if r.request_id in crowd]
        out = s.step()
        scheduled = {row.request_id for row in out.scheduled}
        assert "stream" in scheduled  # the stream gets its token every step
        if rows and all(r.request_id in scheduled or r.num_output_tokens for r in rows) and len(rows) == CROWD:
            held_steps += len({r.request_id for r in rows} - scheduled) > 0
            decoded = [r.num_output_tokens for r in rows]
            spreads.append(max(decoded) - min(decoded))
    assert held_steps > 10  # the crowd's 40 rows do not all fit twice the stream's own step
    # The crowd was prefilled one prompt after another (one flow), so its rows start apart; the rows that waited go
    # first next, so they close up, and then keep within one token of each other.
    assert all(b <= max(a, 1) for a, b in zip(spreads, spreads[1:], strict=False)) and spreads[0] > 10
    assert max(spreads[-10:]) <= 1
    # Once the cost model has seen a few steps, each step stays near the target: twice a step with one row per client.
    late = [out for out in s.steps[-40:] if out.decision.time_bound and not out.decision.shape.prefill_tokens]
    assert late, "no step held rows back at the end"
    for out in late:
        assert out.decision.itl_target_s <= AUTO_ITL_FACTOR * step_cost(two_rows(out)) * 1.05
        assert step_cost(out.decision.shape) <= out.decision.itl_target_s * 1.05
    assert all(len(s.tokens[rid]) == CROWD_TOKENS for rid in crowd)


def two_rows(out):
    """The decode-only shape of the stream's row and the crowd's first: what the step's target is made of."""
    shape = StepShape()
    rows = sorted(out.scheduled, key=lambda row: row.request_id != "stream")[:2]
    for row in rows:
        shape.add_decode(row.start_pos, row.num_tokens)
    return shape


def test_a_crowd_alone_or_a_burst_of_single_streams_is_never_held():
    for flow in ("crowd", None):  # one client with 40 rows; 40 clients of one row each
        s = sim()
        crowd = add_crowd(s, flow=flow)
        while not all(len(s.tokens.get(rid, ())) == CROWD_TOKENS for rid in crowd):
            assert len(s.steps) < 400, "the crowd never finished"
            rows = {r.request_id for r in decoding_rows(s)}
            assert not crowded(decoding_rows(s))
            out = s.step()
            assert rows <= {row.request_id for row in out.scheduled}  # every decoding row, every step
            assert not (rows and out.decision.time_bound and not out.decision.shape.prefill_tokens)


def test_a_held_row_resumes_with_its_kv_and_its_output_is_the_same():
    """Holding rows back changes when tokens come, never which (the fake runner's tokens follow the context)."""
    outs = {}
    for with_stream in (False, True):
        s = sim()
        if with_stream:
            decoding_stream(s)
        crowd = add_crowd(s)
        s.run(3000, until=lambda: all(len(s.tokens.get(rid, ())) == CROWD_TOKENS for rid in crowd))  # noqa: B023
        outs[with_stream] = {rid: s.tokens[rid] for rid in crowd}
    assert outs[True] == outs[False]


def test_a_grammar_crowds_rows_are_its_own_cost_not_a_share_of_the_streams_target():
    """Rows under a costly grammar (10 ms a row here, twice the stream's whole step) beside a stream: the target is
    twice the stream's own step, measured in the steps that run its row alone; the grammar's first row goes in every
    other step, so the stream's steps average within the target."""
    grammar_cost = (*COST[:-1], 10e-3)
    s = sim()
    s.cost = lambda shape: step_cost(shape, grammar_cost)
    decoding_stream(s)
    crowd = add_crowd(s, grammar=True)
    s.run(3000, until=lambda: all(len(s.tokens.get(rid, ())) == CROWD_TOKENS for rid in crowd))
    assert all(len(s.tokens[rid]) == CROWD_TOKENS for rid in crowd), "the grammar's crowd never finished"
    both = [out for out in s.steps[STREAM_STEPS:] if out.decision.base_rows == 1 and out.decision.itl_target_s]
    assert len(both) > 100
    assert all("stream" in {row.request_id for row in out.scheduled} for out in both)
    stream = StepShape()
    stream.add_decode(400)
    late = [out for out in both[20:] if not out.decision.probe]
    for out in late:  # the stream's own step, measured, not the grammar row's 10 ms: at most 2 x 5 ms
        assert out.decision.itl_target_s <= AUTO_ITL_FACTOR * step_cost(stream) * 1.05
    crowd_rows = [sum(row.request_id in crowd and row.num_tokens == 1 and row.start_pos >= 8 for row in out.scheduled)
                  for out in late]
    assert max(crowd_rows) == 1 and 0.45 <= sum(crowd_rows) / len(crowd_rows) <= 0.55  # every other step
    mean = sum(s.cost(out.decision.shape) for out in late) / len(late)
    # Twice the stream's step on average, and a little more: the crowd's last prompts still get their block a step.
    assert mean <= AUTO_ITL_FACTOR * step_cost(stream) * 1.1
