"""Bounded label values for per-tenant series: a label per client-supplied string would explode the series count.

A tenant gets a series of its own once it is among the top K by tokens served and has had at least 1/(2K) of all
tokens served so far; at most K tenants ever do (a counter's series never moves: one that drops out of the top
keeps its own). Every other tenant counts under "other", and so do the tokens a tenant was served before it got
its series. With few tenants each has its series from its first tokens; with many small ones, only the heavy do.
The top is kept with the space-saving algorithm over a bounded table, so memory stays bounded however many
tenants come and go.
"""

from __future__ import annotations

import heapq

OTHER = "other"
MAX_TENANT_SERIES = 16
TRACKED = 16 * MAX_TENANT_SERIES  # tenants whose counts are kept (space-saving: the least is replaced)


class TenantLabels:
    """Maps a tenant to its label value, given the tokens it was just served."""

    __slots__ = ("k", "tracked", "_labelled", "_counts", "_total")

    def __init__(self, k: int = MAX_TENANT_SERIES, tracked: int = TRACKED) -> None:
        self.k, self.tracked = k, max(tracked, k)
        self._labelled: set[str] = set()
        self._counts: dict[str, int] = {}
        self._total = 0

    @property
    def labelled(self) -> frozenset[str]:
        """The tenants with a series of their own."""
        return frozenset(self._labelled)

    def label(self, tenant: str, tokens: int) -> str:
        """The label value to count `tokens` of `tenant` under."""
        self._total += tokens
        if tenant in self._labelled:
            return tenant
        counts = self._counts
        if tenant in counts:
            counts[tenant] += tokens
        elif len(counts) < self.tracked:
            counts[tenant] = tokens
        else:  # space-saving: the newcomer takes over the least count (an upper bound of what it had)
            least = min(counts, key=counts.__getitem__)
            counts[tenant] = counts.pop(least) + tokens
        heavy = 2 * self.k * counts[tenant] >= self._total
        if heavy and len(self._labelled) < self.k and (
                len(counts) <= self.k or counts[tenant] >= heapq.nlargest(self.k, counts.values())[-1]):
            self._labelled.add(tenant)
            return tenant
        return OTHER
