"""KV cache knobs: block size, pool size, swap space and prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.knobs import knob


@dataclass(slots=True)
class CacheConfig:
    """How the paged KV cache is laid out and sized."""

    block_size: int = knob(16, "Tokens per KV cache block.")
    num_kv_blocks: int = knob(0, "KV cache blocks on the device (0: derive from --kv-cache-memory).")
    kv_cache_memory: float = knob(1.0, "KV cache size in GiB on the device when --num-kv-blocks is 0.")
    swap_space: float = knob(1.0, "Host memory in GiB for swapped-out KV blocks (preemption mode 'swap').")
    enable_prefix_caching: bool = knob(
        True, "Reuse KV blocks of identical prompt prefixes across requests.", flag="--no-prefix-caching"
    )
    cpu_decode_kernel: bool = knob(
        True,
        "CPU fp32: decode attention in a small C kernel that reads the paged cache in place (built on first use "
        "with the system C compiler; the torch path when none is found).",
        flag="--no-cpu-decode-kernel",
    )

    def validate(self) -> None:
        """Raise ValueError on an inconsistent configuration."""
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.num_kv_blocks < 0:
            raise ValueError("num_kv_blocks must be >= 0")
        if self.kv_cache_memory <= 0 and self.num_kv_blocks == 0:
            raise ValueError("kv_cache_memory must be > 0 when num_kv_blocks is 0")
        if self.swap_space < 0:
            raise ValueError("swap_space must be >= 0")
