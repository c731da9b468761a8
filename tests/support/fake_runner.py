"""A model-free stand-in for the model runner: a KV store of (token, position) per slot.

The next token is a hash of the sequence read back through the block table, so any KV corruption
(wrong slot, stale prefix block, bad swap copy) changes the output and shows up against a reference run.
"""

from __future__ import annotations

import hashlib

from sluice.scheduling.output import ModelRunnerOutput, SchedulerOutput

VOCAB = 1000


def next_token(tokens: list[int]) -> int:
    """Deterministic 'model': the next token depends on the whole sequence."""
    digest = hashlib.blake2b(repr(tokens).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


class InjectedFault(RuntimeError):
    """Raised by FakeRunner where a test asked a step to fail."""


GARBAGE = -7  # what a slot holds after a copy or write that did not finish: a token no model would produce


class FakeRunner:
    """Writes scheduled tokens into slots, performs swap copies, and 'attends' by reading slots back.

    `fail_next` makes the next step raise part-way: "swap_in" (half the swap-in copies done, the rest of
    their targets garbage), "swap_out" (likewise for swap-outs), or "forward" (half the new tokens written, the
    other slots garbage). A step that fails must not let any of that garbage reach a later output.
    """

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.host: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_host_blocks)]
        self.steps: list[SchedulerOutput] = []
        self.fail_next: str | None = None

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        self.steps.append(out)
        fail, self.fail_next = self.fail_next, None
        out.check_copy_order()
        for i, (host, dev) in enumerate(out.swap_in):
            if fail == "swap_in" and i >= len(out.swap_in) // 2:
                self.slots[dev * bs : (dev + 1) * bs] = [(GARBAGE, p) for p in range(bs)]
                continue
            self.slots[dev * bs : (dev + 1) * bs] = list(self.host[host])
        if fail == "swap_in":
            raise InjectedFault("swap-in copy failed")
        for i, (dev, host) in enumerate(out.swap_out):
            if fail == "swap_out" and i >= len(out.swap_out) // 2:
                self.host[host] = [(GARBAGE, p) for p in range(bs)]
                continue
            self.host[host] = list(self.slots[dev * bs : (dev + 1) * bs])
        if fail == "swap_out":
            raise InjectedFault("swap-out copy failed")
        writes = [(s, j) for s in out.scheduled for j in range(s.num_tokens)]
        for k, (s, j) in enumerate(writes):  # write every new token first, as each layer does
            pos = s.start_pos + j
            written = GARBAGE if fail == "forward" and k >= len(writes) // 2 else s.token_ids[j]
            self.slots[s.block_ids[pos // bs] * bs + pos % bs] = (written, pos)
        if fail == "forward":
            raise InjectedFault("forward failed")
        result = ModelRunnerOutput()
        for s in out.scheduled:
            if not s.sample:
                continue
            end = s.start_pos + s.num_tokens
            seq = []
            for pos in range(end):
                entry = self.slots[s.block_ids[pos // bs] * bs + pos % bs]
                assert entry is not None and entry[1] == pos, f"slot for pos {pos} of {s.request_id} holds {entry}"
                seq.append(entry[0])
            result.sampled[s.request_id] = next_token(seq)
        return result


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What an unbatched, unpreempted run of the fake model produces."""
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt) :]
