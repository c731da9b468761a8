"""The C++ CPU ops (csrc/*.cpp: int8, int4, fp32 and bf16 linears for few rows, RMSNorm,
rotary embedding, a quantized Llama layer's work around its attention), built once into one extension.

Built on first use with ninja and the system compiler into $SLUICE_CACHE_DIR/kernels, keyed by the sources,
flags, torch version and CPU flags: -march=native code runs only on the CPU it was built for. A failed build
is not fatal: `load()` returns None and the callers take their plain torch paths (correct, slower).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from sluice.kvcache.cpu_kernel import cache_dir, cpu_flags

logger = logging.getLogger("sluice.cpu_ops")

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("int8_linear.cpp", "int4_linear.cpp", "f32_linear.cpp", "bf16_linear.cpp", "packed_linear.cpp",
           "rms_norm.cpp", "rotary.cpp", "llama_layer.cpp", "gguf_linear.cpp", "bindings.cpp")
CFLAGS = ("-O3", "-march=native")
# at::parallel_for is a header template around `#pragma omp parallel`: compiled without -fopenmp it runs on one
# thread. Linked with -fopenmp the extension needs libgomp.so.1, which resolves to the copy torch already loaded.
OPENMP_FLAGS = ("-fopenmp",) if torch.backends.openmp.is_available() else ()
# torch's build lock is a bare file that a killed build leaves behind, and every later start then waits on it
# forever. A build takes a minute or two: a lock older than this has no builder left.
BUILD_LOCK_STALE_S = 600.0


@functools.cache
def load():
    """The built extension module, or None where it cannot be built here."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning("no C++ compiler: quantized linears dequantize per call (slower)")
        return None
    try:
        from torch.utils.cpp_extension import load as build

        digest = hashlib.sha256()
        for name in (*SOURCES, "cpu_ops.h", "simd.h", "row_blocks.h"):
            digest.update((CSRC / name).read_bytes())
        # The source folder too: ninja records absolute paths, so two checkouts sharing one cache would rebuild in turn.
        digest.update((repr(CFLAGS + OPENMP_FLAGS) + torch.__version__ + cpu_flags() + str(CSRC)).encode())
        key = digest.hexdigest()[:16]
        directory = cache_dir() / f"cpu_ops-{key}"
        directory.mkdir(parents=True, exist_ok=True)
        wait_for_build_lock(directory / "lock")
        return build(name=f"sluice_cpu_ops_{key}", sources=[str(CSRC / name) for name in SOURCES],
                     extra_cflags=[*CFLAGS, *OPENMP_FLAGS], extra_ldflags=list(OPENMP_FLAGS),
                     build_directory=str(directory), verbose=False)
    except Exception as e:  # a failed build must not stop the server: it only costs speed
        logger.warning("CPU ops unavailable (%s): quantized linears dequantize per call", str(e)[-500:])
        return None


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
