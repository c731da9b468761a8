"""Where a few-row C++ kernel stops beating oneDNN's GEMM, timed once on this CPU.

The GEMVs stream each weight once per block of input rows; oneDNN's GEMM pays a fixed cost per call but computes
many rows at the rate of the CPU's matrix units. Where the two cross depends on the CPU, not only its flags: on
a Zen 4 the packed GEMV won up to 16-32 rows, on a Xeon with AMX oneDNN won from 4 (docs/performance.md, "Weight
formats on CPU"). So the limit is measured, on one weight the size of a small model's linear, the first time a
layer asks.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

ROW_STEPS = (1, 2, 4, 8, 16, 32)
PROBE_SHAPE = (2048, 2048)  # out, in: 8-16 MiB, past the L2 caches, as a model's linears are
ROUNDS = 3


def best_time(call: Callable[[], object], rounds: int = ROUNDS) -> float:
    """The shortest of `rounds` timed calls, after one untimed call (first-call allocations, oneDNN's kernel)."""
    call()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def crossover(kernel: Callable[[torch.Tensor], object], gemm: Callable[[torch.Tensor], object], in_features: int,
              dtype: torch.dtype, timer: Callable[[Callable[[], object]], float] = best_time) -> int:
    """The largest count of ROW_STEPS up to which `kernel(x)` beat `gemm(x)` at every step (0: never), x [rows,
    in_features] random in `dtype`. The two are timed in turn ROUNDS times and each keeps its best: a burst of
    other work on a shared machine (a process exiting, a neighbour's job) then slows both or neither, where timing
    one after the other let it land on the kernel alone and send every decode step of the server to oneDNN."""
    limit = 0
    generator = torch.Generator().manual_seed(0)
    for rows in ROW_STEPS:
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        kernel_time = gemm_time = float("inf")
        for _ in range(ROUNDS):
            kernel_time = min(kernel_time, timer(functools.partial(kernel, x)))
            gemm_time = min(gemm_time, timer(functools.partial(gemm, x)))
        if kernel_time >= gemm_time:
            break
        limit = rows
    return limit
