"""Another machine's instruction set on this one: `sluice bench peers --isa avx2` holds both servers to AVX2 and FMA
(x86-64-v3: Zen 1 to Zen 3 and most laptops). llama.cpp is built without its AVX-512 paths; Sluice's kernels are
built for x86-64-v3 (`SLUICE_NATIVE_MARCH`), and torch's own (ATen, oneDNN, MKL) are held to AVX2 by their
environment variables. The cores, caches and memory stay this machine's, so a capped run says how each server's
AVX2 code does here, not what an AVX2 machine measures.
"""

from __future__ import annotations

import os
import subprocess
import sys

from sluice.cpu import native_bf16_flags

ISAS = ("native", "avx2")
# The CPU flags each cap keeps (llama.cpp's build options and the float pair follow them).
KEPT_FLAGS = {"avx2": frozenset({"avx", "avx2", "fma", "f16c"})}
SERVER_ENV = {"avx2": {"SLUICE_NATIVE_MARCH": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2",
                       "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def check(isa: str, flags: set[str]) -> None:
    """Refuses an unknown cap, or one this CPU cannot run."""
    if isa not in ISAS:
        raise ValueError(f"unknown --isa {isa!r}; choose from {', '.join(ISAS)}")
    missing = sorted(KEPT_FLAGS.get(isa, frozenset()) - flags)
    if missing:
        raise ValueError(f"--isa {isa} needs a CPU with {', '.join(missing)}")


def capped(flags, isa: str) -> list[str]:
    """The CPU flags a server may use under `isa` (all of them for "native")."""
    keep = KEPT_FLAGS.get(isa)
    return sorted(f for f in flags if keep is None or f in keep)


def bf16_flags(isa: str) -> list[str]:
    """This CPU's native bf16 matmul flags that `isa` keeps (they choose the float pair)."""
    return capped(native_bf16_flags(), isa)


def server_env(isa: str) -> dict[str, str]:
    """The environment variables that hold a Sluice server to `isa`."""
    return dict(SERVER_ENV.get(isa, {}))


def describe(isa: str, flags: set[str]) -> str:
    """What a capped run measures, for the report ("" for "native")."""
    if isa == "native":
        return ""
    dropped = sorted(f for f in flags if f.startswith(("avx512", "amx")))
    return (f"instruction sets capped at {isa.upper()} on a CPU that has more ({', '.join(dropped) or 'none'}): "
            f"llama.cpp built without them, Sluice's kernels for x86-64-v3, torch's held to {isa.upper()} by "
            f"{', '.join(k for k in SERVER_ENV[isa] if not k.startswith('SLUICE'))}; this machine's cores and memory")


def matmul_peak(dtype: str, threads: int, isa: str) -> float:
    """`ceiling.matmul_gflop_s` measured in a child process held to `isa` (its torch reads the caps at start)."""
    code = ("import sys, torch; from sluice.service.bench.ceiling import matmul_gflop_s; "
            "print(matmul_gflop_s(getattr(torch, sys.argv[1]), int(sys.argv[2])))")
    out = subprocess.run([sys.executable, "-c", code, dtype, str(threads)], capture_output=True, text=True,
                         env={**os.environ, **server_env(isa)}, timeout=600)
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "matmul failed")
    return float(out.stdout.split()[-1])
