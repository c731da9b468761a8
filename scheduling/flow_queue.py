"""The waiting queue as flows: one RequestQueue per flow, the flow to serve first chosen by priority and service.

A flow is what one API call admits (its prompt list, its `n` samples, its embedding inputs); within a flow the
queue's own order holds (FCFS, or priority then arrival), and a preempted request goes back to its flow's front.
Across flows the order is `flow_key`: priority first (lower value first, under the priority policy), then
requests preempted by recompute (they had been running: they resume before new work, as DESIGN.md's invariant 5
asks), then the least `counter + prompt_weight * remaining prompt` (VTC's counters; the remaining work makes the
order stick to the request being prefilled until a less-served client arrives), then arrival.
"""

from __future__ import annotations

from collections.abc import Iterator

from sluice.scheduling.fairness import VirtualCounters
from sluice.scheduling.request import Request, RequestStatus
from sluice.scheduling.request_queue import RequestQueue, create_request_queue


def flow_key(request: Request, counters: VirtualCounters, priority_policy: bool,
             counter: float | None = None) -> tuple[int, int, float, float, int]:
    """The order of flows whose current request is `request` (`counter`: its client's, when not the live one)."""
    value = counters.value(request.client_id) if counter is None else counter
    remaining = request.num_tokens - request.num_computed_tokens
    return (request.priority if priority_policy else 0, 0 if request.status == RequestStatus.PREEMPTED else 1,
            value + counters.prompt_weight * remaining, request.arrival_time, request.arrival_seq)


class FlowQueue:
    """Waiting requests by flow; `peek`/`pop` give the head of the flow `flow_key` puts first."""

    def __init__(self, policy: str, counters: VirtualCounters) -> None:
        self.policy = policy
        self.counters = counters
        self._flows: dict[str, RequestQueue] = {}
        self._len = 0

    def push(self, request: Request) -> None:
        """Enqueue a new request at the back of its flow."""
        self._flow(request).push(request)
        self._len += 1

    def push_front(self, request: Request) -> None:
        """Re-enqueue a preempted request at the front of its flow."""
        self._flow(request).push_front(request)
        self._len += 1

    def _flow(self, request: Request) -> RequestQueue:
        queue = self._flows.get(request.flow_id)
        if queue is None:
            queue = self._flows[request.flow_id] = create_request_queue(self.policy)
        return queue

    def peek(self) -> Request:
        """The next request to admit."""
        priority_policy = self.policy == "priority"
        return min((q.peek() for q in self._flows.values()),
                   key=lambda r: flow_key(r, self.counters, priority_policy))

    def pop(self) -> Request:
        """Dequeue the next request."""
        request = self.peek()
        self.remove(request)
        return request

    def remove(self, request: Request) -> None:
        """Forget a queued request (admitted out of turn, or aborted)."""
        queue = self._flows[request.flow_id]
        queue.remove(request)
        self._len -= 1
        if not queue:
            del self._flows[request.flow_id]

    def flows(self) -> Iterator[tuple[str, RequestQueue]]:
        """(flow id, its queue) of every flow with a waiting request."""
        return iter(self._flows.items())

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, flow by flow in serving order."""
        priority_policy = self.policy == "priority"
        heads = sorted(self._flows.values(), key=lambda q: flow_key(q.peek(), self.counters, priority_policy))
        return (r for q in heads for r in q)
