"""The models `bench peers` serves, per size and weight format, made once and cached.

135m is SmolLM2-135M-Instruct itself; 360m and 1.7b are random models of SmolLM2's shapes (shapes.py) on its
tokenizer and chat template. llama.cpp gets each as F32, F16 and BF16 GGUFs from its own converter and as Q4_0, Q4_1,
Q4_K_M, Q5_K_M, IQ4_XS, Q3_K_M and Q2_K from its own `llama-quantize` of the F32 file (135m's Q4_1 is the GGUF the
default model ships as).
"""

from __future__ import annotations

from pathlib import Path

from sluice.service.bench.llama_cpp import CONVERTED, convert, quantize
from sluice.service.bench.shapes import RECIPE, SIZES, random_checkpoint
from sluice.service.executor.model_loader import ensure_default_model, fetch_default_gguf

GGUF_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M", "IQ4_XS", "Q3_K_M", "Q2_K")


def hf_dir(size: str) -> Path:
    """The safetensors checkpoint Sluice serves for `size`."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; one of {', '.join(SIZES)}")
    return ensure_default_model() if size == "135m" else random_checkpoint("llama", size)


def gguf_path(cache: Path, size: str, kind: str) -> Path:
    """Where the `kind` GGUF of `size` lives (made or not)."""
    stem = "SmolLM2-135M-Instruct" if size == "135m" else f"random-llama-{size}-{RECIPE}"
    folder = cache if kind in CONVERTED else cache / "kquant"
    return folder / f"{stem}-{kind}.gguf"


def gguf(cache: Path, size: str, kind: str, log=print) -> Path:
    """The `kind` GGUF of `size` for llama.cpp (and for Sluice's --quantization gguf), made once."""
    if kind not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {kind!r}; one of {', '.join(GGUF_TYPES)}")
    if size == "135m" and kind == "Q4_1":
        found = [p for p in sorted(cache.glob("*.gguf")) if p.name.endswith("Instruct.Q4_1.gguf")]
        return found[0] if found else fetch_default_gguf(cache)
    target = gguf_path(cache, size, kind)
    if kind in CONVERTED:
        return convert(cache, hf_dir(size), kind.lower(), target, log)
    return quantize(cache, gguf(cache, size, "F32", log), kind, target, log)


def prepare(cache: Path, sizes: tuple[str, ...], kinds: tuple[str, ...] = GGUF_TYPES, log=print) -> dict:
    """Every checkpoint and GGUF the run needs, made now (before any clock starts); {(size, kind): path}."""
    out = {}
    for size in sizes:
        out[size, "hf"] = hf_dir(size)
        for kind in kinds:
            out[size, kind] = gguf(cache, size, kind, log)
    return out


def disk_mib(paths) -> dict[str, float]:
    """Size on disk of each file or checkpoint folder, MiB."""
    def size(p: Path) -> int:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size

    return {str(p): size(p) / 2**20 for p in paths}
