"""Single kernels built for another instruction set than this machine's extension (the tests that check a Zen 3's
AVX2 path, or the portable one, on an AVX-512 machine): cached on disk like the extension (sluice/native.py), so a
variant compiles once per machine, not once per session.

The build folder is keyed by the contents of what it compiles (the kernel's .cpp files, every header of csrc/, the
binding, the flags and torch's version) and holds its own copy of those sources: ninja records absolute paths, so
copies make every checkout (worktrees, CI's fresh clone) share one build, and an edit to an unrelated kernel file
rebuilds nothing. A file lock makes two pytest workers build a variant once.
"""

from __future__ import annotations

import fcntl
import hashlib
import platform

import torch

from sluice import native


def build_variant(name: str, units: list[str], binding: str, cflags: list[str], python_module: bool = True):
    """The extension compiled from csrc/`units` and the `binding` source with `cflags`: a Python module, or with
    `python_module=False` a library of torch ops (TORCH_LIBRARY: a binding that skips torch/extension.h and
    pybind11, a third of the compile time), loaded into the process; returns what torch's `load` returns."""
    from torch.utils.cpp_extension import load

    files = {unit: (native.CSRC / unit).read_bytes() for unit in units}
    files |= {h.name: h.read_bytes() for h in sorted(native.CSRC.glob("*.h"))}
    files[f"{name}_binding.cpp"] = binding.encode()
    digest = hashlib.sha256(repr((sorted(files), cflags, python_module, torch.__version__)).encode())
    for content in files.values():
        digest.update(hashlib.sha256(content).digest())
    key = digest.hexdigest()[:16]
    folder = native.cache_dir() / f"variant-{name}-{key}"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also by a killed process
        for file_name, content in files.items():
            path = folder / file_name
            if not path.exists() or path.read_bytes() != content:  # an unchanged copy keeps its mtime for ninja
                path.write_bytes(content)
        return load(name=f"{name}_{key}", sources=[str(folder / u) for u in [*units, f"{name}_binding.cpp"]],
                    extra_cflags=cflags, extra_ldflags=list(native.OPENMP_FLAGS), extra_include_paths=[str(folder)],
                    build_directory=str(folder), is_python_module=python_module, verbose=False)


def has_avx2() -> bool:
    """Whether this CPU runs x86-64-v3 code (AVX2 and FMA)."""
    return {"avx2", "fma"} <= set(native.cpu_flags().split())



# The x86-64 levels the variant tests build: the portable loops, and AVX2 (a Zen 3) where this CPU runs it.
MARCHES = {"portable": "-march=x86-64", "avx2": "-march=x86-64-v3"}


def integer_kernels(isa: str):
    """The integer-weight linears (int4_linear.cpp, gguf_linear.cpp) built for `isa`
    (a key of MARCHES) as torch ops: `torch.ops.sluice_test_int_<isa>`, with int4_linear, q4_0_linear, q4_k_linear,
    q5_k_linear, iq4_nl_linear, iq4_xs_linear, q5_0_linear, q5_1_linear, q6_k_linear, q3_k_linear,
    q2_k_linear, q8_0_packed_linear, isa, gguf_linear, gguf_dequantize, and the load's packs of blocks: pack_q2_k,
    pack_q3_k, pack_q4_k, pack_q5_k and pack_q6_k."""
    binding = ('#include <torch/library.h>\n#include "cpu_ops.h"\n'
               f'TORCH_LIBRARY(sluice_test_int_{isa}, m) {{ m.def("int4_linear", &int4_linear); '
               'm.def("q4_0_linear", &q4_0_linear); '
               'm.def("q4_k_linear", &q4_k_linear); m.def("q5_0_linear", &q5_0_linear); '
               'm.def("q5_k_linear", &q5_k_linear); m.def("iq4_xs_linear", &iq4_xs_linear); '
               'm.def("iq4_nl_linear", &iq4_nl_linear); '
               'm.def("q5_1_linear", &q5_1_linear); m.def("q6_k_linear", &q6_k_linear); '
               'm.def("q3_k_linear", &q3_k_linear); '
               'm.def("q8_0_packed_linear", &q8_0_packed_linear); '
               'm.def("isa", &int4_linear_isa); m.def("gguf_linear", &gguf_linear); '
               'm.def("gguf_dequantize", &gguf_dequantize); '
               'm.def("pack_q4_k", &pack_q4_k); m.def("pack_q5_k", &pack_q5_k); m.def("pack_q6_k", &pack_q6_k); '
               'm.def("pack_q3_k", &pack_q3_k); m.def("pack_q2_k", &pack_q2_k); '
               'm.def("q2_k_linear", &q2_k_linear); }\n')
    build_variant(f"int_{isa}", ["int4_linear.cpp", "gguf_linear.cpp", "k_quant_pack.cpp"], binding,
                  ["-O3", MARCHES[isa]], python_module=False)
    return getattr(torch.ops, f"sluice_test_int_{isa}")


def greedy_kernels(isa: str):
    """greedy.cpp built for `isa` (a key of MARCHES) as the torch op `torch.ops.sluice_test_greedy_<isa>.argmax`."""
    binding = ('#include <torch/library.h>\n#include "cpu_ops.h"\n'
               f'TORCH_LIBRARY(sluice_test_greedy_{isa}, m) {{ m.def("argmax", &greedy_argmax); }}\n')
    build_variant(f"greedy_{isa}", ["greedy.cpp"], binding, ["-O3", MARCHES[isa]], python_module=False)
    return getattr(torch.ops, f"sluice_test_greedy_{isa}")


def variant_isas() -> list[str]:
    """The keys of MARCHES this CPU can run (none off x86-64)."""
    if platform.machine() != "x86_64":
        return []
    return ["portable", "avx2"] if has_avx2() else ["portable"]
