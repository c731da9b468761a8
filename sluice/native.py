"""The one native extension: every C/C++ kernel in csrc/ (paged decode attention, the few-row linears, RMSNorm,
rotary, a quantized layer's ops), built on first use into one torch extension.

It lives in the root package because two rooms call it: the attention (decode attention) and the executor (linears,
layer ops, greedy sampling); every room may import the root, and the kernels belong to neither. Built with ninja
and the system C++ compiler into $SLUICE_CACHE_DIR/kernels (default ~/.cache/sluice/kernels), keyed by the
sources, flags, torch version and CPU flags: -march=native code runs only on the CPU it was built for. Optional by
design: without a compiler, or when the build fails, `load()` returns None after one warning, and every caller
takes its pure-torch path (correct, slower).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import torch

from sluice.machine import cache_root, cpu_flags_line

logger = logging.getLogger("sluice.native")

CSRC = Path(__file__).with_name("csrc")
# -march: this CPU's own instruction sets, or the x86-64 level $SLUICE_NATIVE_MARCH names (x86-64-v3: AVX2 and FMA),
# for kernels another machine will run or a benchmark of that machine's code paths here.
MARCH_ENV = "SLUICE_NATIVE_MARCH"
# GCC's first instruction scheduling pass, aware of register pressure (off by default on x86). Without it the int4
# kernel's AVX2 passes hoist every pmaddubsw of a group and spill their sums to the stack. Clang has no such pass.
GCC_FLAGS = ("-fschedule-insns", "-fsched-pressure")
# at::parallel_for is a header template around `#pragma omp parallel`, and the decode kernel's own pragmas need it
# too: compiled without -fopenmp both run on one thread. Linked with -fopenmp the extension needs libgomp.so.1,
# which resolves to the copy torch already loaded (torch's own threads, not a second runtime). Never -ffast-math:
# a shared object linked with it turns on flush-to-zero for the whole process when it loads.
OPENMP_FLAGS = ("-fopenmp",) if torch.backends.openmp.is_available() else ()
# torch's build lock is a bare file that a killed build leaves behind, and every later start then waits on it
# forever. A build takes a minute or two: a lock older than this has no builder left.
BUILD_LOCK_STALE_S = 600.0
FALLBACK = "every CPU kernel runs its pure-torch fallback (correct, slower)"


def cflags() -> tuple[str, ...]:
    """-O3 and the -march the kernels are built for (native, or $SLUICE_NATIVE_MARCH)."""
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", march):
        raise ValueError(f"{MARCH_ENV}={march!r} is not an -march name (native, x86-64-v3, ...)")
    return ("-O3", f"-march={march}")


def cache_dir() -> Path:
    """Where built kernels live: the cache root's kernels/."""
    return cache_root() / "kernels"


def cpu_flags() -> str:
    """This CPU's feature flags line (/proc/cpuinfo), or the machine name where there is none."""
    return cpu_flags_line() or os.uname().machine


def sources() -> list[Path]:
    """Every translation unit of the extension: each kernel in its own .cpp file, bindings.cpp exporting them."""
    return sorted(CSRC.glob("*.cpp"))


@functools.cache
def load():
    """The built extension module, or None where it cannot be built here; logs one line either way."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        logger.warning("native kernels: no C++ compiler (%r not found; set CXX): %s", compiler, FALLBACK)
        return None
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        logger.warning("native kernels: no ninja to build them with (pip install ninja): %s", FALLBACK)
        return None
    start, wall_start = time.monotonic(), time.time()
    try:
        ops = build(cflags() + (GCC_FLAGS if is_gcc(compiler) else ()))
    except Exception as e:  # a failed build must not stop the server: it only costs speed
        logger.warning("native kernels: the build failed (%s): %s", str(e)[-500:], FALLBACK)
        return None
    made = "built" if os.path.getmtime(ops.__file__) >= wall_start else "loaded"
    logger.info("native kernels: %s %s in %.1f s (%s): decode attention %s, int4 %s, bf16 linears %s",
                made, ops.__name__, time.monotonic() - start, ops.__file__, ops.paged_decode_isa(),
                ops.int4_linear_isa(), "AVX512_BF16" if ops.bf16_linear_is_native() else "not native")
    return ops


def is_gcc(compiler: str) -> bool:
    """Whether `compiler` is GCC (clang answers `--version` with its own name, even when called gcc or c++)."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "clang" not in version.lower() and (
        "gcc" in version.lower() or "free software foundation" in version.lower()
    )


def build(cflags: tuple[str, ...]):
    """The extension built with these flags (cached on disk by them; tests build other instruction sets so);
    raises where it cannot be built."""
    from torch.utils.cpp_extension import load as build_extension

    units = sources()
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    # The source folder too: ninja records absolute paths, so two checkouts sharing one cache would rebuild in turn.
    digest.update((repr(cflags + OPENMP_FLAGS) + torch.__version__ + cpu_flags() + str(CSRC)).encode())
    key = digest.hexdigest()[:16]
    directory = cache_dir() / f"native-{key}"
    directory.mkdir(parents=True, exist_ok=True)
    wait_for_build_lock(directory / "lock")
    return build_extension(name=f"sluice_native_{key}", sources=[str(p) for p in units],
                           extra_cflags=[*cflags, *OPENMP_FLAGS], extra_ldflags=list(OPENMP_FLAGS),
                           build_directory=str(directory), verbose=False)


def wait_for_build_lock(lock: Path, stale_after: float = BUILD_LOCK_STALE_S, poll: float = 0.5) -> None:
    """Wait while another process builds; remove the lock once it is older than any build takes."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > stale_after:
            logger.warning("removing a build lock %.0f s old, left by a build that never finished: %s", age, lock)
            lock.unlink(missing_ok=True)
            return
        time.sleep(poll)
