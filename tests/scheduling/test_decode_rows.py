"""A client decoding many rows beside another client's stream: its extra rows wait their turn within the step's
time target, every client's first row goes in, and a crowd alone (or a burst of single streams) is never held."""

from __future__ import annotations

from sluice.scheduling.decode_rows import crowded
from sluice.scheduling.step_budget import AUTO_ITL_FACTOR
from tests.support.fair_sim import Sim, decoding_stream, request, sim, step_cost

CROWD, CROWD_TOKENS = 40, 30


def add_crowd(s: Sim, flow: str | None = "crowd", prefix: str = "c") -> list[str]:
    ids = [f"{prefix}{i}" for i in range(CROWD)]
    for i, rid in enumerate(ids):
        s.sched.add_request(request(rid, 8, CROWD_TOKENS, flow=flow, seed=100 + i))
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
    from sluice.scheduling.cost_model import StepShape

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
