"""How many KV cache blocks the model runner allocates.

In order of precedence: `--num-kv-blocks`; an explicit `--kv-cache-memory` in GiB; else `auto`:

- CPU: the smallest of CPU_KV_CACHE_GIB (a default that leaves the machine usable, as vLLM's 4 GiB), what the
  configured limits can use (max_num_seqs sequences of the context length: --max-model-len, else the model's own;
  not the engine's capped max_model_len, which is derived from this cache), and a fraction (CPU_KV_FRACTION) of
  the memory the process may still use once the model is loaded: the smaller of the cgroup memory limit less the
  weights, and MemAvailable (read after the load, so the weights are already out of it).
- CUDA (vLLM's `--gpu-memory-utilization`): one forward at the largest step (max_num_batched_tokens tokens in one
  sequence, the worst case for attention) measures peak activation memory; the cache gets
  `utilization * total - (weights + peak activations)`, and never more than is free beside the activations.

Every CUDA memory query goes through `cuda_memory`, so tests replace that one function.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.cpu import CGROUP_ROOT, MEMINFO, PROC_CGROUP, cgroup_memory_limit, mem_available
from sluice.kvcache.config import AUTO, CPU_KV_CACHE_GIB, CacheConfig, gib_or_auto
from sluice.kvcache.kv_tensors import KVTensors, kv_block_bytes
from sluice.service.attention.paged_attention import AttentionMetadata
from sluice.service.executor.forward_context import ForwardContext, set_forward_context
from sluice.service.executor.models.packed import packed_logits
from sluice.service.executor.models.weights import attention_shape

GiB = 1 << 30
# Half of what is left: the rest covers activations, the tokenizer, Python, other tenants and page cache.
CPU_KV_FRACTION = 0.5
RAISE_HINT = "raise it with --kv-cache-memory GiB or --num-kv-blocks N"


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one KV block is made of."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def of(cls, model, block_size: int, dtype: torch.dtype) -> KVShape:
        """The blocks of `model` (its transformers config) at this block size and cache dtype."""
        config = model.config.get_text_config()
        _, num_kv_heads, head_dim = attention_shape(config)
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, block_size, dtype)

    @property
    def block_bytes(self) -> int:
        return kv_block_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype)

    def allocate(self, num_blocks: int, device: torch.device, num_host_blocks: int = 0) -> KVTensors:
        """KV tensors of `num_blocks` blocks of this shape on `device` (and a host pool of `num_host_blocks`)."""
        return KVTensors(num_blocks, self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.dtype,
                         device, num_host_blocks=num_host_blocks)


@dataclass(frozen=True, slots=True)
class KVBudget:
    """Bytes for the KV cache, and where the figure came from (for the start-up log)."""

    num_bytes: int
    source: str


def format_bytes(n: float) -> str:
    """Bytes for a log line: GiB, or MiB below one GiB."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / (1 << 20):.1f} MiB"


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (each storage once), prepacked oneDNN weights included."""
    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [m.packed for m in model.modules() if isinstance(getattr(m, "packed", None), torch.Tensor)]
    for t in tensors:
        key = id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size() if t.is_mkldnn else t.untyped_storage().nbytes()
    return total


def cpu_kv_budget(
    weight_bytes: int,
    fraction: float = CPU_KV_FRACTION,
    cgroup_root: Path = CGROUP_ROOT,
    meminfo: Path = MEMINFO,
    proc_cgroup: Path = PROC_CGROUP,
) -> KVBudget:
    """`fraction` of the memory left to the process after the model is loaded (see the module docstring)."""
    left: list[tuple[int, str]] = []
    limit = cgroup_memory_limit(cgroup_root, proc_cgroup)
    if limit is not None:
        text = f"cgroup memory limit {format_bytes(limit[0])} ({limit[1]}) less {format_bytes(weight_bytes)} weights"
        left.append((limit[0] - weight_bytes, text))
    available = mem_available(meminfo)
    if available is not None:
        left.append((available, f"MemAvailable {format_bytes(available)} ({meminfo}) with the model loaded"))
    if not left:
        raise ValueError("--kv-cache-memory auto: no cgroup memory limit and no MemAvailable in "
                         f"{meminfo}; pass --kv-cache-memory in GiB or --num-kv-blocks")
    usable, source = min(left)
    usable = max(usable, 0)
    return KVBudget(int(usable * fraction), f"auto: {fraction:g} x {format_bytes(usable)} left, from {source}")


def model_context_length(model) -> int:
    """The model's own context length, from its config (2048 when it names none)."""
    cfg = model.config
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def cpu_auto_budget(left: KVBudget, shape: KVShape, max_num_seqs: int, context_len: int) -> KVBudget:
    """The CPU 'auto' cache: the smallest of CPU_KV_CACHE_GIB, max_num_seqs full contexts, and `left`
    (cpu_kv_budget's share of the memory left)."""
    per_seq = -(-context_len // shape.block_size) * shape.block_bytes
    limits = max_num_seqs * per_seq
    bounds = [
        (int(CPU_KV_CACHE_GIB * GiB), f"the CPU default {CPU_KV_CACHE_GIB:g} GiB"),
        (limits, f"{format_bytes(limits)} for {max_num_seqs} sequences x {context_len} tokens"),
        (left.num_bytes, left.source.removeprefix("auto: ")),
    ]
    num_bytes, why = min(bounds)
    others = "; ".join(text for n, text in bounds if text != why)
    return KVBudget(num_bytes, f"auto: {why}, the smallest beside {others}; {RAISE_HINT}")


@dataclass(frozen=True, slots=True)
class CudaMemory:
    """Device memory figures in bytes: free and total (driver), allocated and peak allocated (torch)."""

    free: int
    total: int
    allocated: int
    peak: int


def cuda_memory(device: torch.device, reset_peak: bool = False) -> CudaMemory:
    """The one place that asks CUDA about memory; with `reset_peak`, cached blocks are released and the peak is
    restarted first."""
    torch.cuda.synchronize(device)
    if reset_peak:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    return CudaMemory(free, total, torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device))


@torch.inference_mode()
def profile_forward(
    model, shape: KVShape, device: torch.device, num_tokens: int, num_logits: int, backend: str = "auto"
) -> None:
    """One prefill of `num_tokens` tokens as a single sequence on a scratch cache just big enough for it, through
    the attention backend the runner will use."""
    bs = shape.block_size
    num_blocks = -(-num_tokens // bs)
    kv = shape.allocate(num_blocks, device)
    block_table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata.build([num_tokens], [num_tokens], block_table, positions.clone(), bs, backend=backend)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    rows = torch.arange(num_tokens - num_logits, num_tokens, device=device)
    with set_forward_context(ForwardContext(meta, kv.layers)):
        logits = packed_logits(model, input_ids, positions, rows)
        logits.float()  # the sampler's copy
    del kv, logits


def gpu_kv_budget(
    model,
    shape: KVShape,
    device: torch.device,
    utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    backend: str = "auto",
) -> KVBudget:
    """vLLM's sizing: utilization * total - (weights + peak activations of the largest step)."""
    before = cuda_memory(device, reset_peak=True)
    weights = before.allocated  # nothing but the model lives on the device yet
    profile_forward(model, shape, device, max_num_batched_tokens, min(max_num_seqs, max_num_batched_tokens), backend)
    peak = cuda_memory(device).peak
    after = cuda_memory(device, reset_peak=True)  # the scratch cache and activations released
    activations = max(0, peak - weights)
    wanted = int(utilization * before.total) - weights - activations
    what = (f"{utilization:g} x {format_bytes(before.total)} less {format_bytes(weights)} of weights and "
            f"{format_bytes(activations)} of peak activations at {max_num_batched_tokens} tokens")
    if wanted <= 0:
        raise ValueError(f"the model does not fit: {what} leaves nothing for the KV cache; raise "
                         "--gpu-memory-utilization, lower --max-num-batched-tokens, or use a smaller dtype")
    room = after.free - activations  # other processes may hold memory that utilization assumed was ours
    if room < wanted:
        return KVBudget(max(0, room), f"auto: {format_bytes(after.free)} free on the device less "
                                      f"{format_bytes(activations)} of peak activations (less than {what})")
    return KVBudget(wanted, f"auto: {what}")


def kv_cache_blocks(
    model, cache: CacheConfig, device: torch.device, shape: KVShape, max_num_batched_tokens: int, max_num_seqs: int,
    max_model_len: int = 0, backend: str | None = None,
) -> tuple[int, str]:
    """(number of KV blocks, where the figure came from); ValueError when not even one block fits.
    `max_model_len`: the configured one (0: the model's own context length), for the CPU 'auto' size; `backend`:
    the resolved attention backend the CUDA profile runs (default: the configured one)."""
    if cache.num_kv_blocks:
        return cache.num_kv_blocks, "--num-kv-blocks"
    memory = gib_or_auto(cache.kv_cache_memory)
    if memory != AUTO:
        budget = KVBudget(int(memory * GiB), f"--kv-cache-memory {memory:g} GiB")
    elif device.type == "cpu":
        context_len = max_model_len or model_context_length(model)
        budget = cpu_auto_budget(cpu_kv_budget(model_weight_bytes(model)), shape, max_num_seqs, context_len)
    elif device.type == "cuda":
        budget = gpu_kv_budget(model, shape, device, cache.gpu_memory_utilization, max_num_batched_tokens,
                               max_num_seqs, backend or cache.attention_backend)
    else:
        raise ValueError(f"--kv-cache-memory auto is not supported on {device.type}; pass it in GiB")
    num_blocks = budget.num_bytes // shape.block_bytes
    if num_blocks < 1:
        raise ValueError(f"KV cache budget too small for a single block of {shape.block_bytes} bytes "
                         f"({budget.source}); raise --kv-cache-memory or pass --num-kv-blocks")
    return int(num_blocks), budget.source
