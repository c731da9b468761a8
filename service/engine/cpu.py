"""What this process may really use of the machine: cores (so torch's thread pool matches them), memory (so an
'auto' KV cache fits), and whether the CPU multiplies bf16 natively."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_CPU_MAX = CGROUP_ROOT / "cpu.max"
MEMINFO = Path("/proc/meminfo")
CPUINFO = Path("/proc/cpuinfo")
# cgroup v1 writes "no limit" as the largest page-aligned int64; anything this large means unlimited.
_UNLIMITED = 1 << 60
# CPU flags of a native bf16 matmul: AMX tiles (Sapphire Rapids on) or AVX-512 BF16 (Cooper Lake, Zen 4 on).
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def available_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """Cores allowed by the affinity mask and the cgroup CPU quota (a Kubernetes CPU limit), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = cpu_max.read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def configure_torch_threads() -> int:
    """Size torch's intra-op pool to the usable cores: more threads than cores makes OpenMP spin and stall."""
    import torch

    threads = int(os.environ.get("SLUICE_NUM_THREADS", 0)) or available_cpus()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def cgroup_memory_limit(root: Path = CGROUP_ROOT) -> tuple[int, str] | None:
    """(bytes, file) of the cgroup memory limit: v2 `memory.max`, else v1 `memory/memory.limit_in_bytes`; None
    when no limit is set or none can be read. In a container (cgroup namespace) the root is its own cgroup."""
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            limit = int(text)
        except ValueError:
            continue
        return None if limit >= _UNLIMITED else (limit, str(path))
    return None


def mem_available(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable of /proc/meminfo in bytes (what can be allocated without swapping), None if unreadable."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                value, unit = line.split()[1:3]
                return int(value) * 1024 if unit == "kB" else int(value)
    except (OSError, ValueError, IndexError):
        pass
    return None


def native_bf16_flags(cpuinfo: Path = CPUINFO) -> list[str]:
    """The bf16 matmul flags this CPU has (see BF16_FLAGS), from /proc/cpuinfo, else from torch's own probe."""
    try:
        flags = set()
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags.update(line.partition(":")[2].split())
        return [f for f in BF16_FLAGS if f in flags]
    except OSError:
        pass
    import torch

    probes = {"amx_bf16": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported"}
    found = []
    for flag, probe in probes.items():
        try:
            if getattr(torch.cpu, probe)():
                found.append(flag)
        except (AttributeError, RuntimeError):
            pass
    return found
