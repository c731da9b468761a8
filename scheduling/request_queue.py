"""Waiting queues: FCFS (a deque) and priority (a heap keyed (priority, arrival)); lower priority value first."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from sluice.scheduling.request import Request


def priority_key(request: Request) -> tuple[int, float, int]:
    """Sort key under the priority policy: lower `priority` first, then earlier arrival."""
    return (request.priority, request.arrival_time, request.arrival_seq)


def fcfs_key(request: Request) -> tuple[int, float, int]:
    """Sort key under FCFS: arrival order only."""
    return (0, request.arrival_time, request.arrival_seq)


class FCFSQueue:
    """Arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        # Lazy removal keeps abort O(1). Keyed by object identity, not request id: an id aborted and added again
        # while its stale entry is still queued must not make the new request disappear.
        self._removed: set[int] = set()
        self._len = 0

    def push(self, request: Request) -> None:
        """Enqueue a new request at the back."""
        self._queue.append(request)
        self._len += 1

    def push_front(self, request: Request) -> None:
        """Re-enqueue a preempted request ahead of everything that waits."""
        self._queue.appendleft(request)
        self._len += 1

    def peek(self) -> Request:
        """The next request to admit."""
        self._drop_removed()
        return self._queue[0]

    def pop(self) -> Request:
        """Dequeue the next request."""
        self._drop_removed()
        self._len -= 1
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        """Forget a queued request (abort)."""
        self._removed.add(id(request))
        self._len -= 1

    def _drop_removed(self) -> None:
        while self._queue and id(self._queue[0]) in self._removed:
            self._removed.discard(id(self._queue.popleft()))

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        return (r for r in self._queue if id(r) not in self._removed)


class PriorityQueue:
    """Heap on (priority, arrival_time, seq): equal priorities stay FCFS; preempted requests keep their place."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []
        self._removed: set[int] = set()  # ids of removed Request objects (see FCFSQueue)
        self._len = 0

    def push(self, request: Request) -> None:
        """Enqueue in O(log n)."""
        heapq.heappush(self._heap, (priority_key(request), request))
        self._len += 1

    # A preempted request's original arrival time already puts it ahead of later arrivals of its priority.
    push_front = push

    def peek(self) -> Request:
        """The highest-priority waiting request."""
        self._drop_removed()
        return self._heap[0][1]

    def pop(self) -> Request:
        """Dequeue the highest-priority request in O(log n)."""
        self._drop_removed()
        self._len -= 1
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        """Forget a queued request (abort); the heap entry is dropped lazily."""
        self._removed.add(id(request))
        self._len -= 1

    def _drop_removed(self) -> None:
        while self._heap and id(self._heap[0][1]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[1]))

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        return (r for _, r in sorted(self._heap, key=lambda e: e[0]) if id(r) not in self._removed)


RequestQueue = FCFSQueue | PriorityQueue


def create_request_queue(policy: str) -> RequestQueue:
    """The waiting queue for a scheduling policy ('fcfs' or 'priority')."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
