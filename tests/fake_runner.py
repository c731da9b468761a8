"""A model-free stand-in for the model runner: a KV store of (token, position) per slot.

The next token is a hash of the sequence read back through the block table, so any KV corruption
(wrong slot, stale prefix block, bad swap copy) changes the output and shows up against a reference run.
"""

from __future__ import annotations

import hashlib

from scheduling.output import ModelRunnerOutput, SchedulerOutput

VOCAB = 1000


def next_token(tokens: list[int]) -> int:
    """Deterministic 'model': the next token depends on the whole sequence."""
    digest = hashlib.blake2b(repr(tokens).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % VOCAB


class FakeRunner:
    """Writes scheduled tokens into slots, performs swap copies, and 'attends' by reading slots back."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.host: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_host_blocks)]
        self.steps: list[SchedulerOutput] = []

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        self.steps.append(out)
        for host, dev in out.swap_in:
            self.slots[dev * bs : (dev + 1) * bs] = list(self.host[host])
        for dev, host in out.swap_out:
            self.host[host] = list(self.slots[dev * bs : (dev + 1) * bs])
        for s in out.scheduled:  # write every new token first, as each layer does
            for j, tok in enumerate(s.token_ids):
                pos = s.start_pos + j
                self.slots[s.block_ids[pos // bs] * bs + pos % bs] = (tok, pos)
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
