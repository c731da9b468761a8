"""The persistent inputs of a pure-decode step, allocated once: what a CUDA graph captured per batch size replays.

A captured graph reads its inputs from the addresses it was captured with, so every decode step copies its
token ids, positions, slots, block tables and sequence lengths into these tensors instead of making new ones,
and the forward reads them from here. Batch sizes come in a fixed set (`capture_sizes`, as vLLM's); a step of n
sequences pads to the next size where padding is on. Padding rows decode token 0 at position 0 of a scratch
block no request owns: they write only there, attend only to it, and are never sampled. On CPU nothing is
captured and the few-row kernels pay for every row, so there the rows are the step's own (`pad` False).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from sluice.kvcache.transfer import tensors_to_device


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below max_num_seqs, then max_num_seqs (vLLM's CUDA graph batch sizes)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return [*sizes, max_num_seqs]


@dataclass(slots=True)
class DecodeStep:
    """One step's views of the buffers: `size` rows, the first `num_seqs` of them real."""

    size: int
    num_seqs: int
    input_ids: torch.Tensor  # [size] long
    positions: torch.Tensor  # [size] long
    slot_mapping: torch.Tensor  # [size] long
    block_tables: torch.Tensor  # [size, max_blocks] (rows contiguous: the decode kernel reads them in place)
    seq_lens: torch.Tensor  # [size] long, this step's token included


class DecodeBuffers:
    """Input tensors for up to max(sizes) decoding sequences, on the model's device, reused by every step."""

    def __init__(self, max_num_seqs: int, max_blocks: int, block_size: int, scratch_block: int,
                 device: torch.device, pad: bool) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks, self.block_size, self.scratch_block, self.pad = max_blocks, block_size, scratch_block, pad
        rows = self.sizes[-1]
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)
        self.slot_mapping = torch.zeros(rows, **long)
        # int64 where the C decode kernel reads them in place (CPU), int32 as flash-attn takes them elsewhere
        table_type = torch.long if device.type == "cpu" else torch.int32
        self.block_tables = torch.zeros(rows, max_blocks, dtype=table_type, device=device)
        self.seq_lens = torch.ones(rows, **long)
        self._used_rows = 0  # leading rows that may hold a past step's sequences; the rest hold padding
        self._fill_padding(0, rows)

    @property
    def max_len(self) -> int:
        """The most tokens a sequence in these buffers can hold."""
        return self.max_blocks * self.block_size

    def size_for(self, num_seqs: int) -> int | None:
        """The rows a step of num_seqs decodes runs on: the next capture size, or num_seqs itself unpadded; None
        where it does not fit the buffers."""
        if num_seqs > self.sizes[-1]:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)] if self.pad else num_seqs

    def fill(self, token_ids: list[int], positions: list[int], block_ids: list[list[int]]) -> DecodeStep:
        """Copy one decode step's inputs in (one token per sequence at `positions`, its blocks) and pad."""
        n = len(token_ids)
        size = self.size_for(n)
        if size is None or any(len(b) > self.max_blocks for b in block_ids):
            raise ValueError(f"a decode step of {n} sequences does not fit the persistent buffers")
        width = max(len(b) for b in block_ids)
        tables = torch.tensor([b + [0] * (width - len(b)) for b in block_ids], dtype=torch.long)  # host
        pos = torch.tensor(positions, dtype=torch.long)
        blocks = tables.gather(1, (pos // self.block_size)[:, None])[:, 0]
        rows = torch.stack((torch.tensor(token_ids, dtype=torch.long), pos, blocks * self.block_size
                            + pos % self.block_size, pos + 1))
        # One copy for the step's inputs (pinned on CUDA: the host does not wait for the step before to finish).
        rows, tables = tensors_to_device([rows, tables], self.input_ids.device)
        for buffer, row in zip((self.input_ids, self.positions, self.slot_mapping, self.seq_lens), rows,
                               strict=True):
            buffer[:n].copy_(row)
        self.block_tables[:n, :width].copy_(tables)
        if size > n and self._used_rows > n:  # rows an earlier, larger step left: padding again
            self._fill_padding(n, min(size, self._used_rows))
        self._used_rows = self._used_rows if self._used_rows > size else n  # dirty rows past this step's stay so
        return DecodeStep(size, n, *self._views(size))

    def padding_step(self, size: int) -> DecodeStep:
        """A step of `size` padding rows only: what a capture runs (replays then read the same addresses)."""
        self._fill_padding(0, self._used_rows)
        self._used_rows = 0
        return DecodeStep(size, 0, *self._views(size))

    def _views(self, size: int) -> tuple[torch.Tensor, ...]:
        return (self.input_ids[:size], self.positions[:size], self.slot_mapping[:size], self.block_tables[:size],
                self.seq_lens[:size])

    def _fill_padding(self, first: int, end: int) -> None:
        """Rows first..end: token 0 at position 0 of the scratch block, length 1."""
        self.input_ids[first:end] = 0
        self.positions[first:end] = 0
        self.slot_mapping[first:end] = self.scratch_block * self.block_size
        self.block_tables[first:end, 0] = self.scratch_block
        self.seq_lens[first:end] = 1
