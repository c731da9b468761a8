"""The paged KV tensors on the device, and the host-memory pool that swapped-out blocks live in."""

from __future__ import annotations

import math
import mmap

import torch


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def zeros_on_first_touch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages become resident only when first written or read: anonymous mmap memory is
    zero-filled by the kernel on first touch, where torch.zeros writes (and so holds) every page at once. The KV
    cache's resident size then follows the blocks in use, not the blocks configured."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor keeps the mapping alive (frombuffer holds a reference to it).
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class KVTensors:
    """K and V for every layer in one tensor [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim],
    plus a host pool of the same layout that whole blocks are swapped to and from."""

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_host_blocks: int = 0,
    ):
        self.device = torch.device(device)
        self.num_blocks, self.num_host_blocks, self.block_size = num_blocks, num_host_blocks, block_size
        shape = (num_layers, block_size, num_kv_heads, head_dim)
        # One allocation for all layers lets a swap move a block of every layer in a single index op.
        # Zeroed rather than empty: padded block-table entries gather from real blocks, and garbage there
        # could be NaN/inf, which survives masking (0 * inf) in some attention kernels.
        kv_shape, host_shape = (2, shape[0], num_blocks, *shape[1:]), (2, shape[0], num_host_blocks, *shape[1:])
        if self.device.type == "cpu":
            self.kv = zeros_on_first_touch(kv_shape, dtype)
        else:
            self.kv = torch.zeros(kv_shape, dtype=dtype, device=self.device)
        # Pinned host memory makes device<->host copies DMA-able; only meaningful with CUDA.
        pin = self.device.type == "cuda" and num_host_blocks > 0
        self.host_kv = (torch.zeros(host_shape, dtype=dtype, pin_memory=True) if pin
                        else zeros_on_first_touch(host_shape, dtype))
        # (key_cache, value_cache) views per layer, each [num_blocks, block_size, num_kv_heads, head_dim].
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.kv[0, i], self.kv[1, i]) for i in range(num_layers)
        ]

    @property
    def num_bytes(self) -> int:
        """Device bytes held by the KV tensors."""
        return self.kv.numel() * self.kv.element_size()

    @property
    def host_num_bytes(self) -> int:
        """Host bytes held by the swap pool."""
        return self.host_kv.numel() * self.host_kv.element_size()

    def resident_bytes(self, used_blocks: int) -> int:
        """Device bytes resident once `used_blocks` blocks were written: theirs on CPU (zeros_on_first_touch), all
        of them where torch.zeros wrote every byte up front (a GPU)."""
        if self.device.type != "cpu":
            return self.num_bytes
        return min(used_blocks, self.num_blocks) * (self.num_bytes // max(1, self.num_blocks))

    def host_resident_bytes(self, used_blocks: int) -> int:
        """Swap pool bytes resident once `used_blocks` host blocks were written (pinned memory: all of it)."""
        if self.host_kv.is_pinned():
            return self.host_num_bytes
        return min(used_blocks, self.num_host_blocks) * (self.host_num_bytes // max(1, self.num_host_blocks))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole device blocks to host blocks, for every layer: pairs are (device_block, host_block)."""
        if not pairs:
            return
        src, dst = _split(pairs)
        blocks = self.kv.index_select(2, src.to(self.device))
        # Synchronous on purpose: the device blocks may be reused by this very step's forward.
        self.host_kv.index_copy_(2, dst, blocks.to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole host blocks back to device blocks, for every layer: pairs are (host_block, device_block)."""
        if not pairs:
            return
        src, dst = _split(pairs)
        blocks = self.host_kv.index_select(2, src).to(self.device)
        self.kv.index_copy_(2, dst.to(self.device), blocks)


def _split(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) pairs as two index tensors on the CPU."""
    both = torch.tensor(pairs, dtype=torch.long).view(-1, 2)
    return both[:, 0], both[:, 1]
