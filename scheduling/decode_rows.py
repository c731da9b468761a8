"""Which decoding requests get their token in a step: each client's first row, then its other rows as time allows.

A client decoding many rows at once (a prompt list, `n` samples, 64 rows of a grammar) beside a client with one
stream would otherwise make every step as long as its whole batch: the stream's time between tokens grows with rows
that are not its own. While two or more clients decode and one of them has several rows, the step's time target is
made of one row per client decoding without a grammar (a client's own row is its share of the step, and the auto
target lets the step take twice that; what a grammar adds to a row, milliseconds for some, is its own client's cost
and comes out of the target like its further rows; where every client decodes under a grammar, one row per client).
The further rows go in least-served client first (VTC's counters, plus the output weight per row already taken this
step; priorities first under the priority policy) while the cost model says the step stays within the target (and
the model is not trusted past twice the most rows it has measured in one step: a cold one learns by doubling, not by
one step of the whole crowd). A row that sits a step out keeps its KV cache and goes first among its client's rows
next time (rows behind in output go first), so a client's rows advance together.

Every client progresses: a client's first row goes in every step, but where it decodes under a grammar and the
step would pass the target with it, every other step (a row that costs more than the stream's whole step then
costs it at most half of that a step on average); and the step that measures the target's base (step_budget.py's
probe, one in 32) runs the base rows alone. With one client decoding, or one row per client
(a burst of single streams), nothing is held: nobody else's step is at stake, and throughput is untouched.
"""

from __future__ import annotations

from sluice.scheduling.cost_model import StepShape
from sluice.scheduling.fairness import VirtualCounters
from sluice.scheduling.request import Request
from sluice.scheduling.step_budget import LatencyBudget, StepDecision


def constrained(request: Request) -> bool:
    """Whether the request decodes under a grammar (its rows cost more: the cost model's own term)."""
    return request.sampling_params.structured_output is not None


def crowded(decoding: list[Request]) -> bool:
    """Whether some client decodes several rows beside another client (only then may rows be held back)."""
    clients = {r.client_id for r in decoding}
    return 1 < len(clients) < len(decoding)


def plan_decode_rows(decoding: list[Request], counters: VirtualCounters, budget: LatencyBudget,
                     decision: StepDecision, priority_policy: bool, sat_out: set[str],
                     guarding: bool = True) -> tuple[set[str], set[str]]:
    """Add the rows that decode this step to `decision.shape`, set its time target; return the ids of the rows
    held back, and the clients none of whose rows go in (`sat_out`: those of the step before). `guarding`: an
    established stream decodes (without one, or a crowd, the target holds nothing back and is not probed)."""
    shape = decision.shape
    by_client: dict[str, list[Request]] = {}
    for r in decoding:
        by_client.setdefault(r.client_id, []).append(r)
    if not 1 < len(by_client) < len(decoding):  # not crowded(): every row goes in
        for r in decoding:
            shape.add_decode(r.num_computed_tokens, constrained=constrained(r))
        decision.decode_rows, decision.itl_target_s = shape.decode_rows, budget.target(shape)
        decision.base_rows = shape.decode_rows
        decision.probe = budget.probe_due(decision, shape, guarding)
        return set(), set()
    extras: list[tuple[int, float, int, Request]] = []
    firsts = []
    for client, rows in by_client.items():
        rows.sort(key=lambda r: (r.num_output_tokens, r.arrival_seq))  # the rows behind go first
        firsts.append(rows[0])
        served = counters.value(client)
        extras += [(r.priority if priority_policy else 0, served + i * counters.output_weight, r.arrival_seq, r)
                   for i, r in enumerate(rows[1:], 1)]
    plain = [r for r in firsts if not constrained(r)] or firsts
    base = StepShape()
    for r in plain:
        base.add_decode(r.num_computed_tokens)
    decision.itl_target_s, decision.base_rows = budget.target(base), base.decode_rows
    decision.probe = budget.probe_due(decision, base)
    held: set[str] = set()
    waiting: set[str] = set()
    for r in plain:
        shape.add_decode(r.num_computed_tokens, constrained=constrained(r))
    decision.decode_rows = shape.decode_rows
    for r in firsts:  # a grammar's first row: in where the step stays within the target, and every other step
        if r not in plain:
            grown = shape.copy()
            grown.add_decode(r.num_computed_tokens, constrained=True)
            if decision.probe or not (r.client_id in sat_out or budget.fits(decision, grown)):
                held.add(r.request_id)
                waiting.add(r.client_id)
            else:
                shape = grown
    extras.sort(key=lambda e: e[:3])
    if decision.probe:
        held |= {e[3].request_id for e in extras}
    for k, (*_, r) in enumerate([] if decision.probe else extras):
        grown = shape.copy()
        grown.add_decode(r.num_computed_tokens, constrained=constrained(r))
        if grown.decode_rows > budget.trusted_rows() or not budget.fits(decision, grown):
            held |= {e[3].request_id for e in extras[k:]}
            decision.time_bound = True
            break
        shape = grown
    decision.shape, decision.decode_rows = shape, shape.decode_rows
    return held, waiting
