"""The raw-forward ceiling: the model's own transformers forward (sdpa, no Sluice) on the engine's batch shapes.

Prefill: each group of prompts the engine admitted in one step, as one padded batch. Decode: real decode steps
through a DynamicCache filled to the context length, at the batch sizes the engine ran. The time of the whole
run is then the sum over the engine's steps, so ceiling tokens/s is what a zero-overhead engine would reach.
Each shape keeps its best of a few repetitions: on a shared machine the minimum is the stable estimate of
what the hardware can do, and it makes the ceiling stricter, never looser.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from sluice.service.bench.offline import OfflineRun
from sluice.service.executor.models.llama import LlamaForCausalLM
from sluice.service.executor.models.weights import attention_shape


@dataclass(slots=True)
class Ceiling:
    """Raw forward time for a run's shapes, and the throughput it implies."""

    prefill_s: float
    decode_s: float
    output_tokens: int
    tokens_per_s: float
    decode_step_ms: dict[str, float] = field(default_factory=dict)  # "b=64 L=164" -> measured ms per step
    prefill_groups: int = 0


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """A linear's weight [N, K] as plain values, whatever its format."""
    from sluice.service.executor.layers.gguf_linear import GgufLinear, MergedLinear
    from sluice.service.executor.layers.packed_linear import PackedLinear

    if isinstance(linear, MergedLinear):
        return torch.cat([dense_weight(part) for part in linear.parts])
    if isinstance(linear, PackedLinear):
        return linear.dense_weight()
    if isinstance(linear, GgufLinear):
        return linear.dequantized()
    return linear.weight.detach()


def checkpoint_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The owned model's weights under transformers' names, plain (the inverse of `build`, for a transformers twin)."""
    embed = model.embed_tokens  # GGUF blocks under --quantization: dequantized
    embedding = embed.weight if hasattr(embed, "weight") else embed.table.dequantized()
    state = {"model.embed_tokens.weight": embedding, "model.norm.weight": model.norm.weight,
             "lm_head.weight": dense_weight(model.lm_head)}

    def split(prefix: str, linear: nn.Module, parts: list[str], sizes: list[int]) -> None:
        biases = [None] * len(parts) if linear.bias is None else linear.bias.split(sizes)
        for part, weight, bias in zip(parts, dense_weight(linear).split(sizes), biases, strict=True):
            state[f"{prefix}{part}.weight"] = weight
            if bias is not None:
                state[f"{prefix}{part}.bias"] = bias

    for i, layer in enumerate(model.layers):
        p, attn, mlp = f"model.layers.{i}.", layer.self_attn, layer.mlp
        state[f"{p}input_layernorm.weight"] = layer.input_layernorm.weight
        state[f"{p}post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        if attn.q_norm is not None:
            state[f"{p}self_attn.q_norm.weight"], state[f"{p}self_attn.k_norm.weight"] = attn.q_norm.weight, \
                attn.k_norm.weight
        kv = attn.num_kv_heads * attn.head_dim
        split(f"{p}self_attn.", attn.qkv_proj, ["q_proj", "k_proj", "v_proj"], [attn.num_heads * attn.head_dim, kv, kv])
        split(f"{p}self_attn.", attn.o_proj, ["o_proj"], [attn.o_proj.out_features])
        split(f"{p}mlp.", mlp.gate_up_proj, ["gate_proj", "up_proj"], [mlp.intermediate_size] * 2)
        split(f"{p}mlp.", mlp.down_proj, ["down_proj"], [mlp.down_proj.out_features])
    return {name: t.detach().clone() for name, t in state.items()}


def sdpa_copy(model, plain_linears: bool = False):
    """A copy of the engine's model on transformers' own sdpa attention. Sluice's own model becomes the transformers
    model of its config with its weights, plain (what transformers' generate runs; `plain_linears` is moot). A
    transformers model (the fallback path) is copied as it runs."""
    if isinstance(model, LlamaForCausalLM):
        from transformers import AutoConfig, AutoModelForCausalLM

        values = {k: v for k, v in model.config.to_dict().items() if k != "model_type"}  # a base config's is ""
        config = AutoConfig.for_model(model.config.model_type, **values)  # transformers' own class (see config_json)
        twin = AutoModelForCausalLM.from_config(config, dtype=model.dtype, attn_implementation="sdpa")
        twin.load_state_dict(checkpoint_state(model), strict=False)  # strict=False: rotary buffers are not weights
        twin.generation_config = model.generation_config or twin.generation_config
        return twin.to(model.device).eval()
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("sdpa")
    return twin.eval()


class RawForward:
    """Times the plain model: prefill batches and single decode steps at (batch, context length)."""

    def __init__(self, model, reps: int = 3) -> None:
        self.model = model
        self.reps = reps
        cfg = model.config.get_text_config()
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        _, self.num_kv_heads, self.head_dim = attention_shape(cfg)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # transformers 5 renamed past_key_values to cache; use whichever this version's forward takes.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._warm = False

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], reps: int = 2) -> float:
        """Best of `reps` forwards over the prompts as one right-padded batch (logits of one position each)."""
        self._warmup()
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
            mask[i, : len(p)] = 1
        kwargs = {} if bool(mask.all()) else {"attention_mask": mask.to(self.device)}
        ids = ids.to(self.device)
        best = math.inf
        for _ in range(reps):
            start = time.perf_counter()
            self.model(ids, use_cache=False, logits_to_keep=1, **kwargs)
            self._sync()
            best = min(best, time.perf_counter() - start)
        return best

    @torch.inference_mode()
    def decode_step(self, batch: int, context: int) -> float:
        """Best-of-reps seconds of one decode step for `batch` sequences that each hold `context` tokens of KV."""
        from transformers import DynamicCache

        self._warmup()
        cache = DynamicCache(config=self.model.config)
        shape = (batch, self.num_kv_heads, context, self.head_dim)
        for layer in range(self.num_layers):  # the values do not matter for timing, only the shapes
            cache.update(torch.randn(shape, dtype=self.dtype, device=self.device),
                         torch.randn(shape, dtype=self.dtype, device=self.device), layer)
        ids = torch.randint(0, self.config.vocab_size, (batch, 1), device=self.device)
        pos = torch.full((batch, 1), context, device=self.device)
        times = []
        for _ in range(self.reps + 1):
            start = time.perf_counter()
            self.model(ids, position_ids=pos, use_cache=True, logits_to_keep=1, **{self._cache_kw: cache})
            self._sync()
            times.append(time.perf_counter() - start)
            cache.crop(-1)  # back to `context` tokens for the next repetition
        return min(times[1:])

    def _warmup(self) -> None:
        if not self._warm:
            self._warm = True
            with torch.inference_mode():
                self.model(torch.zeros(1, 8, dtype=torch.long, device=self.device), use_cache=False, logits_to_keep=1)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def matmul_gflop_s(dtype: torch.dtype, threads: int, n: int = 2048, reps: int = 5) -> float:
    """The machine's matmul rate for `dtype` in GFLOP/s (int8: GOP/s, int32 sums): the best of `reps` n x n x n
    products on `threads` threads (torch.mm; torch._int_mm for int8) on CPU; the rate a compute-bound prefill
    approaches, the reference `bench peers` sets E's prefill against."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        if dtype == torch.int8:
            a, b = (torch.randint(-127, 128, (n, n), generator=gen, dtype=torch.int8) for _ in range(2))
            mm = torch._int_mm
        else:
            a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
            mm = torch.mm
        mm(a, b)  # the first call picks and caches the kernel
        best = math.inf
        for _ in range(reps):
            start = time.perf_counter()
            mm(a, b)
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return 2 * n**3 / best / 1e9


def prefill_groups(run: OfflineRun) -> list[list[int]]:
    """Indices of the prompts whose prefill began in the same engine step, in step order."""
    index = {rid: i for i, rid in enumerate(run.request_ids)}
    seen: set[int] = set()
    groups = []
    for step in run.steps:
        group = []
        for rid, _, _ in step.prefills:
            i = index.get(rid)
            if i is not None and i not in seen:
                seen.add(i)
                group.append(i)
        if group:
            groups.append(group)
    return groups


def measure_ceiling(
    run: OfflineRun, raw: RawForward, max_batch_sizes: int = 6, max_group_tokens: int = 4096
) -> Ceiling:
    """Raw time for the run's shapes: every prefill group once, decode steps interpolated from a small grid."""
    prefill_s = 0.0
    groups = prefill_groups(run)
    seen: dict[tuple[int, ...], float] = {}  # identical shapes cost the same: time each shape once

    def timed(chunk: list[list[int]]) -> float:
        key = tuple(sorted(map(len, chunk)))
        if key not in seen:
            seen[key] = raw.prefill(chunk)
        return seen[key]

    for group in groups:
        chunk: list[list[int]] = []
        for p in (run.prompts[i] for i in group):  # keep activations bounded, as the engine's token budget does
            if chunk and sum(map(len, chunk)) + len(p) > max_group_tokens:
                prefill_s += timed(chunk)
                chunk = []
            chunk.append(p)
        prefill_s += timed(chunk)

    by_batch: dict[int, list[float]] = defaultdict(list)
    for step in run.steps:
        if step.num_decodes:
            by_batch[step.num_decodes].append(step.decode_ctx)
    # Measure the most frequent batch sizes, at the shortest and longest context each saw.
    chosen = sorted(sorted(by_batch, key=lambda b: -len(by_batch[b]))[:max_batch_sizes])
    grid: dict[int, tuple[float, float, float, float]] = {}  # b -> (L_lo, t_lo, L_hi, t_hi)
    points: dict[str, float] = {}
    for b in chosen:
        lo, hi = round(min(by_batch[b])), round(max(by_batch[b]))
        t_lo = raw.decode_step(b, lo)
        t_hi = raw.decode_step(b, hi) if hi - lo >= 8 else t_lo
        grid[b] = (lo, t_lo, hi, t_hi)
        points[f"b={b} L={lo}"] = 1000 * t_lo
        if hi - lo >= 8:
            points[f"b={b} L={hi}"] = 1000 * t_hi
    decode_s = sum(_estimate(grid, b, ctx) for b, ctxs in by_batch.items() for ctx in ctxs)
    total = prefill_s + decode_s
    tokens = run.result.output_tokens
    return Ceiling(prefill_s, decode_s, tokens, tokens / total if total else 0.0, points, len(groups))


def _estimate(grid: dict[int, tuple[float, float, float, float]], b: int, ctx: float) -> float:
    """Step time at (b, ctx): linear in context for a measured b, else linear between the nearest measured b."""

    def at(bb: int) -> float:
        lo, t_lo, hi, t_hi = grid[bb]
        return t_lo if hi == lo else t_lo + (t_hi - t_lo) * (ctx - lo) / (hi - lo)

    if b in grid:
        return at(b)
    below = [x for x in grid if x < b]
    above = [x for x in grid if x > b]
    if below and above:
        b1, b2 = max(below), min(above)
        return at(b1) + (at(b2) - at(b1)) * (b - b1) / (b2 - b1)
    return at(max(below) if below else min(above))
