"""Fair shares of prompt work among clients: VTC's virtual token counters (Sheng et al., OSDI '24).

A client is a tenant (the operator-trusted header `--tenant-header` names it) or, without one, a flow: everything
one API call admits (a prompt list, `n` samples, embedding inputs). Its counter is the service it has received,
`prompt_weight` per prompt token computed plus `output_weight` per token generated. The scheduler grants each
step's prompt tokens to the least-served backlogged client first (within a priority level, see prefill_plan.py),
and a client that becomes backlogged is lifted to the least counter among the backlogged ones (when none is, to
the least counter of the clients decoding, never below the last least backlogged one), so that idling earns no
credit to spend later. The counters also say whose step time the latency budget guards (prefill_plan.py): a
decoding client is not stalled by the prompt work of a client served at least as much; a client served less (a
burst of requests queued before the streams began) catches up to it at full speed.

The bound these rules give (tested in tests/scheduling/test_fairness.py): for two clients f and g backlogged at the
same time at one priority level, with no preemption in between,

    C_g - C_f  <=  prompt_weight * (L + Q)  +  output_weight * M

where L is the longest prompt work one request can have left (at most max_model_len), Q the largest grant of one
step (at most max_num_batched_tokens), and M the tokens g's requests already running at its last grant go on to
generate (at most max_num_seqs times the largest max_tokens). A grant goes to the flow whose counter plus its
current request's remaining prompt work (weighted) is least, so the counter of the client served never passes
another backlogged client's by more than w_p * (L + Q); between grants only its running requests' outputs add to
it; a client joining is lifted to at least the least backlogged counter, and one coming back had kept within the
bound of the least then, which never decreases. Tokens recomputed after a preemption are not charged again.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_IDLE_CLIENTS = 4096  # counters kept for clients with no live request (a tenant coming back keeps its own)


class VirtualCounters:
    """Per-client counters of weighted service; the lift on becoming backlogged; bounded memory for idle ones."""

    __slots__ = ("prompt_weight", "output_weight", "_values", "_live", "_idle", "_backlogged", "floor")

    def __init__(self, prompt_weight: float = 1.0, output_weight: float = 2.0) -> None:
        self.prompt_weight, self.output_weight = prompt_weight, output_weight
        self._values: dict[str, float] = {}
        self._live: dict[str, int] = {}  # client -> its requests not yet ended
        self._idle: OrderedDict[str, None] = OrderedDict()  # clients with no live request, oldest first
        self._backlogged: set[str] = set()
        self.floor = 0.0  # the least backlogged counter when last there was one: never decreases

    def value(self, client: str) -> float:
        """The client's counter (a client never seen counts from the floor)."""
        return self._values.get(client, self.floor)

    @property
    def backlogged(self) -> frozenset[str]:
        """Clients with prompt work pending at the last refresh."""
        return frozenset(self._backlogged)

    def values(self) -> dict[str, float]:
        """Every known counter (a copy)."""
        return dict(self._values)

    def open(self, client: str) -> None:
        """A request of `client` was admitted to the scheduler."""
        self._live[client] = self._live.get(client, 0) + 1
        self._idle.pop(client, None)

    def close(self, client: str) -> None:
        """A request of `client` ended; a client with none left is kept among the idle ones, the oldest dropped."""
        left = self._live.get(client, 0) - 1
        if left > 0:
            self._live[client] = left
            return
        self._live.pop(client, None)
        self._idle[client] = None
        while len(self._idle) > MAX_IDLE_CLIENTS:
            self._values.pop(self._idle.popitem(last=False)[0], None)

    def refresh_backlog(self, clients: set[str], decoding: set[str] | frozenset[str] = frozenset()) -> None:
        """Set the clients with prompt work pending now; those that were not before are lifted: to the least
        counter among those that were, or when none was, to the least among the clients decoding (a newcomer
        starts level with the streams it joins, not below them), never below the floor."""
        new = clients - self._backlogged
        if new:
            continuing = [self._values[c] for c in clients & self._backlogged]
            streams = [self.value(c) for c in decoding - new]
            base = min(continuing) if continuing else max(self.floor, min(streams, default=self.floor))
            for c in new:
                self._values[c] = max(self._values.get(c, base), base)
        self._backlogged = clients
        if clients:
            self.floor = max(self.floor, min(self._values[c] for c in clients))

    def charge(self, client: str, prompt_tokens: int) -> None:
        """Add service received: prompt tokens computed (the first time only)."""
        if prompt_tokens:
            self._values[client] = self._values.get(client, self.floor) + self.prompt_weight * prompt_tokens

    def charge_output(self, client: str, tokens: int) -> None:
        """Add service received: tokens generated (every decode step calls it for every row)."""
        values = self._values
        values[client] = values.get(client, self.floor) + self.output_weight * tokens
