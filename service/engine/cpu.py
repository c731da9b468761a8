"""How many cores this process may really use, so torch's thread pool matches them."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


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
