"""The CPU decode-attention kernel (sluice/csrc/paged_decode.cpp, in the one native extension of sluice.native).

The torch path gathers every decoding sequence's blocks into one padded tensor, then runs SDPA over it: each
step copies the whole KV history of the batch and reads it twice more. The kernel reads K and V where they lie
in the paged cache, once. It is optional: where the extension cannot be built, `load()` returns None and the
torch path runs.
"""

from __future__ import annotations

import torch

from sluice import native

DTYPES = (torch.float32, torch.bfloat16)
CACHE_16 = (torch.bfloat16, torch.float16)  # the caches it reads under float32 queries (--kv-cache-dtype)


def load() -> DecodeKernel | None:
    """The kernel of the built extension, or None where there is none (the torch path is used then)."""
    ops = native.load()
    return None if ops is None else DecodeKernel(ops)


class DecodeKernel:
    """Runs the kernel over the whole batch; it shares the sequences out among torch's thread count."""

    def __init__(self, ops) -> None:
        self.ops = ops  # the extension module (native.load(), or a test's build for another instruction set)
        self.path: str = ops.__file__  # the shared object loaded
        self.isa: str = ops.paged_decode_isa()  # avx512, avx2 or portable

    @staticmethod
    def reads(dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """float32 or bfloat16 queries over a cache of their own type, or float32 ones over a 16-bit cache."""
        return dtype in DTYPES and (kv_dtype == dtype or (dtype == torch.float32 and kv_dtype in CACHE_16))

    def supports(self, query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """CPU tensors of types it reads, in the layouts it reads, and a head grouping it holds."""
        num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
        return (
            query.device.type == "cpu"
            and self.reads(query.dtype, key_cache.dtype)
            and key_cache.is_contiguous()
            and num_heads % num_kv_heads == 0
        )

    def attends_chunks(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                       kv_dtype: torch.dtype) -> bool:
        """Whether whole prompt chunks may come here instead of SDPA: its vector path takes these heads (runs of a
        chunk's rows read the cache once per run), where the portable loop would take a row at a time."""
        return self.reads(dtype, kv_dtype) and bool(self.ops.paged_decode_vector_covers(num_heads, num_kv_heads,
                                                                                        head_dim))

    def plan(self, query, key_cache, block_tables, seq_lens, slot_mapping, scale: float):
        """What every layer of this step shares: block_tables [n, max_blocks], seq_lens [n] and slot_mapping [n]
        (None: the caller stores the new K/V), contiguous int64 on the CPU (the extension checks: RuntimeError)."""
        _, num_heads, head_dim = query.shape
        return self.ops.PagedDecodePlan(block_tables, seq_lens, slot_mapping, num_heads, key_cache.shape[2],
                                        head_dim, key_cache.shape[1], scale, torch.get_num_threads())

    def decode_step(self, plan, query, key, value, key_cache, value_cache) -> torch.Tensor:
        """Store key/value [n, Hkv, D] in the plan's slots (None: already stored), then attend: query [n, H, D] →
        out [n, H, D]. The kernel runs without the GIL and forks its OpenMP threads itself."""
        return plan.step(query, key, value, key_cache, value_cache)
