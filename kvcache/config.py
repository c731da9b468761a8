"""KV cache knobs: block size, pool size, swap space and prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.knobs import knob

AUTO = "auto"
# vLLM's default host swap space on an accelerator; also the most 'auto' gives a CPU swap pool.
CUDA_SWAP_SPACE_GIB = 4.0
# The most an 'auto' KV cache takes on CPU, as vLLM's VLLM_CPU_KVCACHE_SPACE default: a default that leaves a
# laptop usable. Larger caches are one flag away (--kv-cache-memory, --num-kv-blocks).
CPU_KV_CACHE_GIB = 4.0
KV_CACHE_DTYPES = (AUTO, "float16", "bfloat16")


def gib_or_auto(value: float | int | str) -> float | str:
    """A size in GiB (a number, or its text) or 'auto'; ValueError otherwise. Also the flags' argparse type."""
    if isinstance(value, str):
        if value.strip().lower() == AUTO:
            return AUTO
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{value!r} is neither 'auto' nor a size in GiB") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is neither 'auto' nor a size in GiB")
    if not value >= 0:  # NaN included
        raise ValueError(f"{value!r} GiB is negative")
    return float(value)


gib_or_auto.__name__ = "'auto' or GiB"  # how argparse and the env-variable check name the expected value


@dataclass(slots=True)
class CacheConfig:
    """How the paged KV cache is laid out and sized."""

    block_size: int = knob(16, "Tokens per KV cache block.")
    num_kv_blocks: int = knob(0, "KV cache blocks on the device (0: derive from --kv-cache-memory).")
    kv_cache_memory: float | str = knob(
        AUTO,
        "KV cache size in GiB on the device when --num-kv-blocks is 0; 'auto': on CPU the smallest of "
        f"{CPU_KV_CACHE_GIB:g} GiB, what --max-num-seqs sequences of the context length (--max-model-len, else the "
        "model's) can use, and half of the memory left after loading the model (the smaller of the cgroup limit "
        "less the weights and MemAvailable); on CUDA --gpu-memory-utilization of the device less the weights and "
        "the peak activations of the largest step.",
        type=gib_or_auto,
    )
    gpu_memory_utilization: float = knob(
        0.9,
        "CUDA, with --kv-cache-memory auto: share of the device's memory Sluice may use in all (weights, "
        "activations and KV cache), as vLLM's flag.",
    )
    swap_space: float | str = knob(
        AUTO,
        "Host memory in GiB for swapped-out KV blocks (preemption mode 'swap'); 'auto': on CPU 0 unless "
        "--preemption-mode is swap (the host pool is the same RAM as the cache), then as large as the KV cache up "
        f"to {CUDA_SWAP_SPACE_GIB:g} GiB; {CUDA_SWAP_SPACE_GIB:g} on CUDA.",
        type=gib_or_auto,
    )
    enable_prefix_caching: bool = knob(
        True, "Reuse KV blocks of identical prompt prefixes across requests.", flag="--no-prefix-caching"
    )
    cpu_decode_kernel: bool = knob(
        True,
        "CPU fp32 or bf16: decode attention in a small C kernel that reads the paged cache in place (built on "
        "first use with the system C compiler; the torch path when none is found). With Sluice's own model and no "
        "sliding window it attends prompt chunks too, instead of SDPA per sequence.",
        flag="--no-cpu-decode-kernel",
    )
    kv_cache_dtype: str = knob(
        AUTO,
        "Element type the KV cache stores: 'auto' the compute dtype (--dtype); 'float16' or 'bfloat16' halve a "
        "float32 model's cache (keys and values rounded as they are stored, attention still in float32). float16, "
        "llama.cpp's default cache type, keeps 3 more mantissa bits than bfloat16 but overflows past 65504; the "
        "torch attention backend and the C decode kernel read either.",
        choices=KV_CACHE_DTYPES,
    )
    attention_backend: str = knob(
        "auto",
        "Paged attention: 'triton' (CUDA: Sluice's Triton kernels, every sequence of a step in one launch per "
        "layer, decode steps in CUDA graphs), 'flex' (torch FlexAttention, compiled per shape; CUDA needs a block "
        "size >= 16), 'flash' (flash-attn, CUDA, block size a multiple of 256), 'torch' (SDPA over gathered "
        "blocks, and the C decode kernel on CPU); 'auto': flash where it fits, else triton, else flex on CUDA; "
        "torch on CPU.",
        choices=("auto", "torch", "flex", "flash", "triton"),
    )

    def validate(self) -> None:
        """Raise ValueError on an inconsistent configuration."""
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.num_kv_blocks < 0:
            raise ValueError("num_kv_blocks must be >= 0")
        try:
            memory = gib_or_auto(self.kv_cache_memory)
        except ValueError as e:
            raise ValueError(f"kv_cache_memory: {e}") from None
        if memory == 0 and self.num_kv_blocks == 0:
            raise ValueError("kv_cache_memory must be > 0 GiB or 'auto' when num_kv_blocks is 0")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        try:
            gib_or_auto(self.swap_space)
        except ValueError as e:
            raise ValueError(f"swap_space: {e}") from None

    def cache_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV tensors are stored in under this compute dtype."""
        return compute_dtype if self.kv_cache_dtype == AUTO else getattr(torch, self.kv_cache_dtype)

    def swap_space_gib(self, device_type: str, preemption_mode: str = "recompute", kv_cache_gib: float = 0) -> float:
        """Host swap pool size in GiB on this device: an explicit value as given, 'auto' resolved (on CPU, a pool
        only when preemption swaps, as large as the `kv_cache_gib` cache up to CUDA_SWAP_SPACE_GIB)."""
        value = gib_or_auto(self.swap_space)
        if value != AUTO:
            return value
        if device_type != "cpu":
            return CUDA_SWAP_SPACE_GIB
        return min(kv_cache_gib, CUDA_SWAP_SPACE_GIB) if preemption_mode == "swap" else 0.0
