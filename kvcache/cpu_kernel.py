"""The CPU decode-attention kernel (csrc/paged_decode.c): built once with the system C compiler, called via ctypes.

The torch path gathers every decoding sequence's blocks into one padded tensor, then runs SDPA over it: each
step copies the whole KV history of the batch and reads it twice more. The kernel reads K and V where they lie
in the paged cache, once. It is optional: without a C compiler, or if the build fails, `load()` returns None
and the torch path runs. Built files live in $SLUICE_CACHE_DIR/kernels (default ~/.cache/sluice/kernels),
keyed by source, flags, compiler and CPU, since -march=native code only runs where it was built.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

import sluice

logger = logging.getLogger("sluice.kernel")

SOURCE = Path(sluice.__file__).with_name("csrc") / "paged_decode.c"
# Reassociation lets the compiler vectorise the dot products. Not -ffast-math: linking a shared object with it
# adds crtfastmath.o, which turns on flush-to-zero for the whole process when the library loads (subnormal
# floats everywhere, torch included, would read as 0).
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
          "-std=c99", "-shared", "-fPIC")
# The kernel's threads come from OpenMP. Its libgomp.so.1 resolves to the copy torch has already loaded, so
# they are torch's own threads rather than a second runtime. Without OpenMP in torch, the pragmas are ignored
# and the kernel runs on one thread.
OPENMP_FLAGS = ("-fopenmp",) if torch.backends.openmp.is_available() else ()


def cache_dir() -> Path:
    root = os.environ.get("SLUICE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "sluice")
    return Path(root) / "kernels"


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


@functools.cache
def load() -> DecodeKernel | None:
    """The built kernel, or None where it cannot be built or loaded here (the torch path is used then)."""
    return build(CFLAGS)


def build(cflags: tuple[str, ...]) -> DecodeKernel | None:
    """The kernel built with these flags (cached on disk by them); tests build the AVX2 path this way."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.info("no C compiler: decode attention uses the torch path")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        source = SOURCE.read_bytes() + SOURCE.with_name("paged_decode_body.h").read_bytes()
        flags = repr(cflags + OPENMP_FLAGS)
        key = hashlib.sha256(source + flags.encode() + version.encode() + cpu_flags().encode()).hexdigest()
        target = cache_dir() / f"paged_decode-{key[:16]}.so"
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                subprocess.run([cc, *cflags, *OPENMP_FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True,
                               capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: concurrent builders (test workers, replicas) never see half a file
        return DecodeKernel(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("C decode kernel unavailable (%s %s): using the torch path", e, detail.decode()[-500:])
        return None


class DecodePlan(ctypes.Structure):
    """paged_decode.c's sluice_decode_plan: what every layer of one decode step shares."""

    _fields_ = [("block_tables", ctypes.c_void_p), ("table_stride", ctypes.c_int64), ("seq_lens", ctypes.c_void_p),
                ("slot_mapping", ctypes.c_void_p), ("num_seqs", ctypes.c_int64), ("num_heads", ctypes.c_int64),
                ("num_kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("block_size", ctypes.c_int64),
                ("scale", ctypes.c_float), ("num_threads", ctypes.c_int64)]


class DecodeKernel:
    """Calls the C function over the whole batch; it shares the sequences out among torch's thread count."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.path = lib._name  # the shared object loaded
        lib.sluice_paged_decode_isa.restype = ctypes.c_char_p
        self.isa: str = lib.sluice_paged_decode_isa().decode()  # avx512, avx2 or portable
        self._steps = {}
        for dtype, suffix in ((torch.float32, ""), (torch.bfloat16, "_bf16")):
            step = getattr(lib, "sluice_paged_decode_step" + suffix)
            step.restype = ctypes.c_int
            step.argtypes = [ctypes.POINTER(DecodePlan)] + [ctypes.c_void_p] * 6
            self._steps[dtype] = step

    def supports(self, query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        """float32 or bfloat16 CPU tensors in the layouts the kernel reads, and a head grouping it holds."""
        num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
        return (
            query.device.type == "cpu"
            and query.dtype == key_cache.dtype
            and query.dtype in self._steps
            and key_cache.is_contiguous()
            and num_heads % num_kv_heads == 0
        )

    def plan(self, query, key_cache, block_tables, seq_lens, slot_mapping, scale: float) -> DecodePlan:
        """The arguments every layer of this step shares (the tensors must outlive the step's calls); block_tables
        [n, max_blocks], seq_lens [n] and slot_mapping [n] (None: the caller stores the new K/V) int64 on the CPU."""
        for t in (block_tables, seq_lens, slot_mapping):  # the C side reads them through raw pointers
            if t is not None and (t.dtype != torch.int64 or not t.is_contiguous() or t.device.type != "cpu"):
                raise ValueError("decode plan: block tables, lengths and slots must be contiguous int64 CPU tensors")
        n, num_heads, head_dim = query.shape
        slots = slot_mapping.data_ptr() if slot_mapping is not None else None
        return DecodePlan(block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(), slots,
                          n, num_heads, key_cache.shape[2], head_dim, key_cache.shape[1], scale,
                          torch.get_num_threads())

    def decode_step(self, plan: DecodePlan, query, key, value, key_cache, value_cache):
        """Store key/value [n, Hkv, D] in the plan's slots (None: already stored), then attend: query [n, H, D] →
        out [n, H, D]. ctypes releases the GIL for the call; the C side forks its OpenMP threads itself."""
        if (key is None) != (plan.slot_mapping is None):
            raise ValueError("decode step: new keys and values go with a plan that has their slots")
        query = query.contiguous()
        key_ptr = value_ptr = None
        if key is not None:
            key, value = key.contiguous(), value.contiguous()
            key_ptr, value_ptr = key.data_ptr(), value.data_ptr()
        out = torch.empty_like(query)
        status = self._steps[query.dtype](plan, query.data_ptr(), key_ptr, value_ptr, key_cache.data_ptr(),
                                          value_cache.data_ptr(), out.data_ptr())
        if status != 0:
            raise MemoryError("paged decode kernel: out of memory for its score buffer")
        return out
