"""llama.cpp for `bench peers`: its server and quantizer built from the source PyPI ships, and GGUF files made
with its own converter and quantizer, all cached outside the repository.

The llama-cpp-python sdist vendors the whole llama.cpp tree, its server included. The build turns on the CPU
features this machine reports one by one (`GGML_NATIVE=OFF`: a `-march=native` build once died with SIGILL on a
VM whose flags promised AMX, so AMX stays off).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from sluice import native
from sluice.service.bench.isa_cap import capped

SDIST = "llama-cpp-python"
# (cpuinfo flag, ggml CMake option): turned on only where the CPU reports the flag.
ISA = [("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
       ("avx512f", "GGML_AVX512"), ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
       ("avx512_bf16", "GGML_AVX512_BF16")]
CONVERTED = ("F32", "F16", "BF16")  # written by convert_hf_to_gguf.py; every other type by llama-quantize from F32


def cpu_flags() -> set[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where there is none)."""
    return set(native.cpu_flags().partition(":")[2].split())


def cmake_isa_options(flags: set[str]) -> list[str]:
    """-D options for a portable build using exactly the features this CPU has."""
    return ["-DGGML_NATIVE=OFF", *(f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in ISA)]


def llama_tree(cache: Path) -> Path:
    """The vendored llama.cpp source tree of the cached sdist."""
    return next(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))


def build_llama_server(cache: Path, log=print, isa: str = "native") -> Path:
    """The llama-server binary, built once from the PyPI sdist (about 10 minutes on 2 cores); for an `isa` cap
    (isa_cap.py), with only the instruction sets that cap keeps, into a binary and build folder of its own."""
    suffix = "" if isa == "native" else f"-{isa}"
    binary = cache / f"llama-server{suffix}"
    if binary.is_file():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        log(f"downloading the {SDIST} sdist")
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(cache)])
        sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    tree = cache / sdists[-1].name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not tree.is_dir():
        with tarfile.open(sdists[-1]) as archive:
            archive.extractall(cache, filter="data")
    build = tree / f"build{suffix}"
    flags = set(capped(cpu_flags(), isa))
    log("configuring llama.cpp: " + " ".join(cmake_isa_options(flags)))
    run(["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DGGML_OPENMP=OFF",
         *cmake_isa_options(flags)])
    log("building llama-server")
    run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)])
    shutil.copy2(build / "bin" / "llama-server", binary)
    return binary


def build_llama_quantize(cache: Path, log=print) -> Path:
    """The llama-quantize binary, built beside the server (once)."""
    quantize = cache / "llama-quantize"
    if not quantize.is_file():
        build_llama_server(cache, log)
        log("building llama-quantize")
        build = llama_tree(cache) / "build"
        run(["cmake", "--build", str(build), "--target", "llama-quantize", "-j", str(os.cpu_count() or 2)])
        shutil.copy2(build / "bin" / "llama-quantize", quantize)
    return quantize


def convert(cache: Path, model_dir: Path, outtype: str, target: Path, log=print) -> Path:
    """`model_dir` (safetensors) as a GGUF of `outtype` ("f32", "f16", "bf16") by llama.cpp's own converter, once."""
    if target.is_file():
        return target
    tree = llama_tree(cache)
    log(f"converting {model_dir.name} to {outtype} GGUF")
    # The converter imports sentencepiece before it finds the model's BPE tokenizer.json.
    if subprocess.run([sys.executable, "-c", "import sentencepiece"], capture_output=True).returncode:
        run([sys.executable, "-m", "pip", "install", "-q", "sentencepiece"])
    env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py"), "NO_LOCAL_GGUF": ""}
    staged = _staged(target)
    run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
         "--outfile", str(staged)], env=env)
    os.replace(staged, target)  # whole or absent
    return target


def quantize(cache: Path, source: Path, kind: str, target: Path, log=print) -> Path:
    """`source` (an F32 GGUF) quantized to `kind` ("Q4_1", "Q4_K_M", ...) by llama-quantize, once."""
    if target.is_file():
        return target
    binary = build_llama_quantize(cache, log)
    log(f"quantizing {source.name} to {kind}")
    staged = _staged(target)
    run([str(binary), str(source), str(staged), kind, str(os.cpu_count() or 2)])
    os.replace(staged, target)
    return target


def _staged(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.with_name(f".{target.name}.{os.getpid()}")


def run(cmd: list[str], env: dict | None = None) -> None:
    """Run a build step; RuntimeError with the tail of its output when it fails."""
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed:\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}")
