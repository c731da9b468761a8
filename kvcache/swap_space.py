"""Host-memory swap slots: which host blocks hold swapped-out KV."""

from __future__ import annotations

from collections import deque


class SwapSpace:
    """A free list of host block ids; the copies themselves are the model runner's job."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Host slots available for swap-out."""
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` host slots."""
        assert num_blocks <= len(self._free), "swap space exhausted"
        return [self._free.popleft() for _ in range(num_blocks)]

    def free(self, block_ids: list[int]) -> None:
        """Return host slots."""
        self._free.extend(block_ids)
        assert len(self._free) <= self.num_blocks, "host slot freed twice"
