"""Where a few-row C++ kernel stops beating oneDNN's GEMM, timed once per weight shape on this CPU.

The GEMVs stream each weight once per block of input rows; oneDNN's GEMM pays a fixed cost per call but computes
many rows at the rate of the CPU's matrix units. Where the two cross depends on the CPU (its vector and matrix
units, not only its flags), on the shape (oneDNN's cost per call weighs more on a narrow linear), and on where the
weights come from: a model's linears stream from memory one after the other, while one weight timed again and again
sits in the last-level cache. So the limit (a linear method's `max_rows`) is measured the first time a linear of a
given shape asks, on random weights of that shape, enough of them to stream past the caches.

Timing every shape took 2.5 s of SmolLM2's 5 s start. A limit is kept (`kept_limit`) in crossovers.json beside the
built kernels, whose folder changes with their sources, flags, torch and the CPU's flags; within it, each entry is
filed under the CPU's model, its last-level cache and the thread count. A later start on the same machine reads it;
deleting the file times every shape again.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sluice import native
from sluice.machine import cpu_model_line

ROW_STEPS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)  # finer where verify steps (1 + drafts rows) fall
ROUNDS = 3
CACHE_BYTES_DEFAULT = 32 << 20  # where sysfs does not say how large the last-level cache is
SYSFS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
MAX_PROBE_COPIES = 128  # past this many copies a model of such linears would itself live in the caches
MAX_PROBE_BYTES = 96 << 20  # a server CPU's whole cache (a VM's share of it is far less) would slow start-up
KEPT_FILE = "crossovers.json"


def largest_cache_bytes(caches: Path) -> int | None:
    """The size of the largest cache listed under a sysfs cache directory (index*/size: "32768K"), or None."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for path in caches.glob("index*/size"):
        try:
            text = path.read_text().strip()
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text))
        except (ValueError, OSError):
            continue
    return max(sizes, default=None)


@functools.cache
def last_level_cache_bytes() -> int:
    """The size of this CPU's last-level cache, or CACHE_BYTES_DEFAULT where sysfs does not say."""
    return largest_cache_bytes(SYSFS_CACHES) or CACHE_BYTES_DEFAULT


def probe_weights(shape: tuple[int, int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Random weights of `shape` [N, K] that together stream past the last-level cache as a model's linears do:
    about twice its size, at most MAX_PROBE_BYTES. A weight larger than that has its output rows cut to whole
    64-row blocks; one copy where so many would be needed that a model of such linears would fit in the caches."""
    n, k = shape
    itemsize = torch.empty(0, dtype=dtype).element_size()
    stream = min(2 * last_level_cache_bytes(), MAX_PROBE_BYTES)
    n = min(n, -(-stream // (k * itemsize * 64)) * 64)  # whole blocks, one copy at least `stream` bytes
    copies = -(-stream // (n * k * itemsize))
    copies = 1 if copies > MAX_PROBE_COPIES else copies
    base = torch.randn(min(n * k, 1 << 20), generator=torch.Generator().manual_seed(0)).to(dtype)
    # Tiled from one random run: generating every element would take longer than the timing itself.
    return [base.repeat(-(-n * k // base.numel()))[: n * k].view(n, k).roll(i) for i in range(copies)]


def elapsed(call: Callable[[], object]) -> float:
    """Seconds one call takes."""
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def crossover(kernel: Callable[[torch.Tensor], object], gemm: Callable[[torch.Tensor], object], in_features: int,
              dtype: torch.dtype, timer: Callable[[Callable[[], object]], float] = elapsed) -> int:
    """The largest count of ROW_STEPS up to which `kernel(x)` beat `gemm(x)` at every step (0: never), x [rows,
    in_features] random in `dtype`. The two are timed in turn ROUNDS times and each keeps its best: a burst of
    other work on a shared machine (a process exiting, a neighbour's job) then slows both or neither, where timing
    one after the other let it land on the kernel alone and send every decode step of the server to oneDNN."""
    limit = 0
    generator = torch.Generator().manual_seed(0)
    for rows in ROW_STEPS:
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        kernel(x), gemm(x)  # untimed: first-call allocations, oneDNN building its kernel for the shape
        kernel_time = gemm_time = float("inf")
        for _ in range(ROUNDS):
            kernel_time = min(kernel_time, timer(functools.partial(kernel, x)))
            gemm_time = min(gemm_time, timer(functools.partial(gemm, x)))
        if kernel_time >= gemm_time:
            break
        limit = rows
    return limit


def kept_limit(key: str, measure: Callable[[], int], directory: Path | None = None) -> int:
    """The limit kept for `key` on this machine (crossovers.json in `directory`, by default the built kernels'
    folder), else `measure()`'s, kept for the next start. None of it where the kernels are not built."""
    if directory is None:
        ops = native.load()
        if ops is None:
            return measure()
        directory = Path(ops.__file__).parent
    machine = f"{cpu_model_line()}; last-level cache {last_level_cache_bytes()}; threads {torch.get_num_threads()}"
    path = directory / KEPT_FILE
    kept = _read_kept(path).get(machine, {})
    if isinstance(kept.get(key), int):
        return kept[key]
    limit = measure()
    everything = _read_kept(path)  # again: another server may have added its shapes meanwhile
    everything.setdefault(machine, {})[key] = limit
    try:
        with tempfile.NamedTemporaryFile("w", dir=directory, prefix=".crossovers-", delete=False) as out:
            json.dump(everything, out, indent=1, sort_keys=True)
        os.replace(out.name, path)  # whole or not at all: a reader never sees half a file
    except OSError:  # a read-only cache: measured again at the next start
        pass
    return limit


def _read_kept(path: Path) -> dict:
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return kept if isinstance(kept, dict) and all(isinstance(v, dict) for v in kept.values()) else {}
