"""What this process may really use of the machine: cores (so torch's thread pool matches them), memory (so an
'auto' KV cache fits), and whether the CPU multiplies bf16 natively."""

from __future__ import annotations

import logging
import math
import os
import threading
from pathlib import Path

from sluice.machine import CPUINFO, cpu_flags_line

logger = logging.getLogger("sluice.cpu")

CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_CPU_MAX = CGROUP_ROOT / "cpu.max"
MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned int64; anything this large means unlimited.
_UNLIMITED = 1 << 60
# Work done for one request beside the step (preparing a body, compiling a grammar) runs this many nice levels
# below the server's own (SERVER_NICENESS; lower_priority). On a machine with as many busy cores as the step has
# threads, equal priority takes a core from the step's threads and the step waits for its slowest thread: every
# stream slows by more than that request's share. At +5 the kernel gives the step's threads about three quarters of
# a shared core (CFS weights 1024 : 335) and the work still ends.
BACKGROUND_NICENESS = 5
# A grammar compile runs for up to its CPU limit (--grammar-compile-timeout) beside every stream's step, on each
# of the compile workers at once: at +5 two of them take a quarter of both cores' time. At +10 (1024 : 110) the step
# keeps about nine tenths; the limit counts the compile's own CPU time, so a slower compile under load is not
# refused for it.
COMPILE_NICENESS = 10
MAX_NICENESS = 19  # Linux's lowest priority: a relative level past it is cut to it
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


def configure_torch_threads(threads: int = 0) -> int:
    """Size torch's intra-op pool to `threads`, or (0) to the usable cores: more threads than cores makes OpenMP
    spin and stall."""
    import torch

    threads = threads or available_cpus()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def own_cgroups(proc_cgroup: Path = PROC_CGROUP) -> tuple[str, str]:
    """(v2 path, v1 memory-controller path) of this process's cgroup, from /proc/self/cgroup; "/" when unknown."""
    v2 = v1 = "/"
    try:
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                v2 = path
            elif "memory" in controllers.split(","):
                v1 = path
    except (OSError, ValueError):
        pass
    return v2, v1


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
        return None if text == "max" or int(text) >= _UNLIMITED else int(text)
    except (OSError, ValueError):
        return None


def cgroup_memory_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> tuple[int, str] | None:
    """(bytes, file) of the tightest cgroup memory limit over this process's cgroup and its ancestors: v2
    `memory.max`, v1 `memory/.../memory.limit_in_bytes`; None when no limit is set or none can be read. In a
    container with its own cgroup namespace the root itself is the container's cgroup."""
    v2, v1 = own_cgroups(proc_cgroup)
    found = []
    for base, own, name in ((root, v2, "memory.max"), (root / "memory", v1, "memory.limit_in_bytes")):
        parts = [p for p in own.split("/") if p]
        for depth in range(len(parts), -1, -1):  # own cgroup first, then each parent up to the root
            path = base.joinpath(*parts[:depth], name)
            limit = _read_limit(path)
            if limit is not None:
                found.append((limit, str(path)))
    return min(found) if found else None


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
    line = cpu_flags_line(cpuinfo)
    if line is not None:
        flags = set(line.partition(":")[2].split())
        return [f for f in BF16_FLAGS if f in flags]
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


def release_freed_memory() -> bool:
    """Hand memory the allocator keeps after frees back to the OS (glibc's malloc_trim); False where unsupported.

    Replacing weights at load (prepacking, int8) frees hundreds of MiB that glibc keeps in its heap, so the
    process would report them as resident and the auto KV size (sized from MemAvailable) would not see them.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # no such library, or a libc without it (musl)
        return False
    trim(0)
    return True


def resident_bytes(pid: int | str = "self") -> int:
    """A process's resident set now (/proc/PID/statm), 0 where there is none (gone, or not Linux)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def descendants(pid: int | str = "self") -> list[int]:
    """The pids of a process's children, theirs, and so on (/proc/PID/task/*/children); [] where unreadable."""
    found: list[int] = []
    todo = [str(pid)]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            try:
                kids = [int(c) for c in children.read_text().split()]
            except (OSError, ValueError):  # the thread or process ended meanwhile
                continue
            found += kids
            todo += map(str, kids)
    return found


def private_bytes(pid: int | str = "self") -> int:
    """The memory only this process maps (/proc/PID/smaps_rollup's private pages); 0 where unreadable."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0
    return 1024 * sum(int(line.split()[1]) for line in rollup if line.startswith(("Private_Clean:", "Private_Dirty:")))


def helpers_private_bytes(pid: int | str = "self") -> int:
    """What a process's descendants hold that no other process maps (their private pages), summed.

    A child forked from the server (the grammar compile zygote and its workers) shares the server's pages until
    either side writes one; the pages that diverged are the child's own cost, and its resident set, shared pages
    included, would count the server twice. With the server's resident set this is what the process tree holds.
    """
    return sum(private_bytes(child) for child in descendants(pid))


def tree_resident_bytes(pid: int | str = "self") -> int:
    """A process's resident set plus its descendants' private memory: what the server costs, helpers included."""
    return resident_bytes(pid) + helpers_private_bytes(pid)


def thread_niceness() -> int | None:
    """The calling thread's nice value (Linux: nice is per thread); None where it cannot be read."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return None


# The server's own nice value: read when this module is first imported, by the server's main thread before it
# lowers any thread. The work below is lowered relative to it, never to an absolute level: a server started at nice
# 5 still gets its separation, and one started above 5 is not asked to raise a thread's priority (which needs a
# privilege and would fail). Forked children (the compile zygote and its workers) inherit it with the memory, so a
# worker forked from the already lowered zygote still lands at the server's level + COMPILE_NICENESS.
SERVER_NICENESS = thread_niceness()


def lower_priority(niceness: int = BACKGROUND_NICENESS, base: int | None = None) -> int | None:
    """Set the calling thread's nice value to `niceness` above `base` (default: SERVER_NICENESS, else the thread's
    own), at most MAX_NICENESS; a thread already lower stays where it is (Linux: threads it starts inherit it).
    Returns the thread's nice value after the call; None where nice values cannot be read (not Linux)."""
    current = thread_niceness()
    if current is None:
        return None
    if base is None:
        base = current if SERVER_NICENESS is None else SERVER_NICENESS
    target = min(MAX_NICENESS, base + niceness)
    if target > current:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), target)
        except OSError:  # e.g. a seccomp profile that forbids it: the work runs at the server's priority
            logger.warning("could not lower a worker thread's priority to nice %d", target)
            return current
    return thread_niceness()
