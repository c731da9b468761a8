"""Host-memory swap slots: which host blocks hold swapped-out KV."""

from __future__ import annotations

from collections import deque


class SwapSpace:
    """A free list of host block ids; the copies themselves are the model runner's job.

    Its checks are real exceptions, not asserts: a slot handed out twice means two requests' KV in one place,
    so they must hold under `python -O` too.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks
        # Slots ever handed out: never-used ones leave in id order and freed ones are reused first, so the used
        # ones are the slots below it (as in BlockPool: host pages follow the most slots held at once).
        self.num_touched = 0

    @property
    def num_free_blocks(self) -> int:
        """Host slots available for swap-out."""
        return len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` host slots."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"swap space exhausted: asked for {num_blocks}, {len(self._free)} free")
        slots = [self._free.popleft() for _ in range(num_blocks)]
        for slot in slots:
            self._is_free[slot] = False
        if slots:
            self.num_touched = max(self.num_touched, max(slots) + 1)
        return slots

    def free(self, block_ids: list[int]) -> None:
        """Return host slots; a slot that is already free raises (nothing is changed then)."""
        if len(set(block_ids)) != len(block_ids) or any(self._is_free[b] for b in block_ids):
            raise RuntimeError(f"host slot freed twice: {sorted(b for b in block_ids if self._is_free[b])}")
        for slot in block_ids:
            self._is_free[slot] = True
        self._free.extendleft(reversed(block_ids))
