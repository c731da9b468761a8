"""Who gets a step's prompt tokens: flows least-served first, within the latency budget and the seats.

Decoding requests get their token (decode_rows.py may hold back a crowd's extra rows). The prompt tokens left (the
step budget less the decodes, and while anything decodes, no more than the latency budget allows) go grant by grant
to the flow that `flow_key` puts first: priority, then requests preempted by recompute, then the least
`counter + prompt_weight * remaining`.

A flow's grant goes to its first request that still has prompt work: one already running (a chunked prefill), else
its next waiting request, which needs a seat. Charging a grant to the client's counter (on a copy: the real
counters are charged for what was really scheduled) moves the flow back in the order; within a flow, requests
are prefilled one after the other, so the `n` samples of one prompt reuse its blocks instead of computing it n
times side by side.

The latency budget guards the decoding clients against the prompt work of clients served at least as much as they
were (fairness.py's counters): a large request arriving beside running streams is held to the time target, while
a burst queued before its first requests began to stream (served less than those) is prefilled at full speed, as
without a target, its throughput intact.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from sluice.kvcache.manager import cdiv
from sluice.scheduling.cost_model import StepShape
from sluice.scheduling.fairness import VirtualCounters
from sluice.scheduling.flow_queue import FlowQueue, flow_key
from sluice.scheduling.request import Request
from sluice.scheduling.step_budget import LatencyBudget, StepDecision


@dataclass(slots=True)
class PrefillPlan:
    """A step's prompt grants: running requests by id, waiting ones to admit in order."""

    running: dict[str, int] = field(default_factory=dict)
    admit: list[tuple[Request, int]] = field(default_factory=list)
    decision: StepDecision = field(default_factory=StepDecision)
    admitted: int = 0  # prompt tokens the admissions really took (the scheduler counts them)
    held: set[str] = field(default_factory=set)  # decoding requests that sit this step out (decode_rows.py)

    @property
    def running_tokens(self) -> int:
        """Prompt tokens granted to running requests."""
        return sum(self.running.values())


@dataclass(slots=True)
class _Flow:
    """The planner's view of one flow: its running prefills, then its waiting requests."""

    client: str
    running: deque[Request] = field(default_factory=deque)
    waiting: Iterator[Request] | None = None
    seats: int = 0  # sequences it holds (running and planned admissions)
    current: Request | None = None
    left: int = 0  # prompt tokens the current request still has to compute after prefix hits (-1: not yet seated)
    admitted: bool = False  # the current request is a planned admission
    hit_tokens: int = 0  # a planned admission's prefix-cache hits,
    hit_blocks_taken: int = 0  # and those of them that leave the free queue (free cached blocks)


@dataclass(slots=True)
class PlanInputs:
    """What the scheduler knows before it plans: the budgets, and the KV cache as far as planning needs it."""

    token_room: int  # step budget less the decode rows
    seats_free: int  # max_num_seqs less the running requests
    flow_seats: int  # most sequences one flow may hold
    chunk_cap: int  # long_prefill_token_threshold (0: none)
    admit: bool  # whether waiting requests may be admitted this step (cleared when the next one cannot fit)
    free_blocks: int  # free KV blocks less those the decode rows take
    block_size: int
    held_blocks: Callable[[str], int]  # blocks a running request holds
    prefix: Callable[[Request], tuple[int, int]]  # a waiting request's hit tokens, and hit blocks now free
    out_of_blocks: bool = False  # a grant found no free block (set while planning)


def plan_prefill(inputs: PlanInputs, decision: StepDecision, partials: list[Request], running_seats: dict[str, int],
                 waiting: FlowQueue, counters: VirtualCounters, budget: LatencyBudget,
                 decoding: set[str] | frozenset[str] = frozenset()) -> PrefillPlan:
    """Grant the step's prompt tokens; `decision` carries the decode rows' shape and the time target, `decoding`
    the clients whose requests decode in this step."""
    plan = PrefillPlan(decision=decision)
    flows = _flows(partials, running_seats, waiting, inputs.admit)
    counters.refresh_backlog({f.client for f in flows}, decoding)
    charged = {f.client: counters.value(f.client) for f in flows}
    # The least-served decoding client: prompt work of a client served at least as much must not stall it.
    guarded = min((counters.value(c) for c in decoding), default=None) if decision.itl_target_s else None
    priority_policy = waiting.policy == "priority"
    heap = [(flow_key(f.current, counters, priority_policy), i, f) for i, f in enumerate(flows) if _advance(f, inputs)]
    heapq.heapify(heap)
    seq, room, shape, granted, served, time_bound = len(heap), inputs.token_room, decision.shape.copy(), 0, set(), False
    floor = budget.floor(decision)
    while heap and room > 0:
        f = heapq.heappop(heap)[2]
        if f.left < 0 and not _seat(f, inputs):
            continue  # its next request needs a seat: none left for it this step
        request, most = f.current, min(f.left, room, inputs.chunk_cap or room)
        start = request.num_tokens - f.left  # after the computed tokens and any prefix hits
        behind = math.inf if guarded is None else math.ceil((guarded - charged[f.client]) / counters.prompt_weight)
        trusted, wanted = _wanted(budget, decision, shape, start, most, max(0, floor - granted, behind))
        if not wanted:  # not one token fits the time target
            time_bound = True
            break
        n = _take_blocks(f, start, wanted, inputs)
        if not n:
            continue  # no free block for it: others may still fit (or get the minimum below)
        if f.admitted:
            plan.admit.append((request, n))
        else:
            plan.running[request.request_id] = n
        shape.add_chunk(start, n)
        granted, room = granted + n, room - n
        served.add(request.flow_id)
        charged[f.client] += counters.prompt_weight * n
        if wanted < most:  # the time target (or how far the model is trusted) cut this grant: no other fits
            time_bound = wanted < trusted
            break
        # One grant per request and step (its key does not change while it is served: it would win again).
        if _advance(f, inputs):
            heapq.heappush(heap, (flow_key(f.current, counters, priority_policy, charged[f.client]), seq, f))
            seq += 1
    if not granted and inputs.out_of_blocks and partials and room > 0:
        granted = _unstick(plan, partials[0], shape, room, inputs.chunk_cap, floor)
        served.add(partials[0].flow_id)
    budget.granted(granted)
    decision.prefill_tokens, decision.flows_served = granted, len(served)
    decision.prefill_budget = granted if time_bound else granted + room
    decision.time_bound |= time_bound  # held decode rows may have set it
    return plan


def _wanted(budget: LatencyBudget, decision: StepDecision, shape: StepShape, start: int, most: int,
            floor: int) -> tuple[int, int]:
    """(tokens the model is trusted with, tokens the time target allows) for a grant of at most `most`; `floor`
    tokens go in regardless: the minimum progress, and the catch-up of a client served less than every decoding
    one (up to level with them: a burst queued before the streams began goes at full speed)."""
    if floor >= most:
        return most, most
    trusted = min(most, max(budget.trusted(decision, shape), floor))  # no extrapolation past what it has seen
    return trusted, _fit(budget, decision, shape, start, trusted, floor)


def _unstick(plan: PrefillPlan, first: Request, shape: StepShape, room: int, chunk_cap: int, floor: int) -> int:
    """No prompt tokens fit the free blocks: the first running prefill (in running order: priority, arrival) gets
    the minimum, and the running phase preempts from the tail for it, as for a decode. Without this, requests that
    each hold part of the memory could wait on one another for ever. Returns the tokens granted."""
    n = min(first.num_tokens - first.num_computed_tokens, room, chunk_cap or room, max(floor, 1))
    plan.running[first.request_id] = n
    shape.add_chunk(first.num_computed_tokens, n)
    return n


def _take_blocks(f: _Flow, start: int, n: int, inputs: PlanInputs) -> int:
    """Count the blocks a grant of `n` tokens takes, cut to what fits in the free blocks (no preemption for prompt
    work beyond the minimum, see plan_prefill). A waiting request that cannot have any closes admission for the
    step: the running ones, which hold the blocks, go on, and as in FCFS nothing is admitted past it."""
    bs = inputs.block_size
    if not f.admitted:  # it holds blocks up to `start`: the grant gets what the free ones hold beyond them
        held = inputs.held_blocks(f.current.request_id)
        fits = min(n, max(0, (held + inputs.free_blocks) * bs - start))
        inputs.out_of_blocks |= fits == 0 < n
        n = fits
        inputs.free_blocks -= max(0, cdiv(start + n, bs) - held)
        return n
    free = inputs.free_blocks - f.hit_blocks_taken
    n = min(n, max(0, free * bs))
    if n == 0:
        inputs.admit, inputs.out_of_blocks = False, True
        return 0
    inputs.free_blocks = free - (cdiv(f.hit_tokens + n, bs) - f.hit_tokens // bs)
    return n


def _flows(partials: list[Request], running_seats: dict[str, int], waiting: FlowQueue, admit: bool) -> list[_Flow]:
    """Every flow with prompt work: running prefills in running order, then its waiting queue (when admitting:
    a flow that waits is backlogged all the same)."""
    flows: dict[str, _Flow] = {}
    for r in partials:
        f = flows.get(r.flow_id)
        if f is None:
            f = flows[r.flow_id] = _Flow(r.client_id, seats=running_seats.get(r.flow_id, 0))
        f.running.append(r)
    for flow_id, queue in waiting.flows():
        f = flows.get(flow_id)
        if f is None:
            f = flows[flow_id] = _Flow(queue.peek().client_id, seats=running_seats.get(flow_id, 0))
        if admit:
            f.waiting = iter(queue)
    return list(flows.values())


def _advance(f: _Flow, inputs: PlanInputs) -> bool:
    """Make the flow's next request with prompt work current; False when it has none it may start."""
    if f.running:
        f.current, f.admitted = f.running.popleft(), False
        f.left = f.current.num_tokens - f.current.num_computed_tokens
        return True
    request = next(f.waiting, None) if f.waiting is not None and inputs.admit else None
    if request is None:
        return False
    f.current, f.admitted, f.left = request, True, -1  # its seat and prefix hits are settled when its turn comes
    return True


def _seat(f: _Flow, inputs: PlanInputs) -> bool:
    """Give the flow's waiting request a seat and look up its prefix hits; False when it may not have one."""
    if not inputs.admit or inputs.seats_free <= 0 or f.seats >= inputs.flow_seats:
        return False
    inputs.seats_free -= 1
    f.seats += 1
    request = f.current
    f.hit_tokens, f.hit_blocks_taken = inputs.prefix(request)
    f.left = request.num_tokens - request.num_computed_tokens - f.hit_tokens
    return True


def _fit(budget: LatencyBudget, decision: StepDecision, shape: StepShape, start: int, most: int, floor: int) -> int:
    """The largest chunk (up to `most`) the latency budget allows; `floor` tokens are never refused."""
    floor = min(most, floor)
    if most == floor or budget.fits(decision, _with(shape, start, most)):
        return most
    lo, hi = floor, most  # lo fits (or is the floor), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if budget.fits(decision, _with(shape, start, mid)):
            lo = mid
        else:
            hi = mid
    return lo


def _with(shape: StepShape, start: int, tokens: int) -> StepShape:
    grown = shape.copy()
    grown.add_chunk(start, tokens)
    return grown
