"""One stream's decode time per architecture and weight format: random Llama, Qwen2 and Qwen3 models of one shape
(service/bench/shapes.py), engines built once in one process and timed in turns, so a machine whose speed drifts
moves every architecture alike. Reports ms a token and each architecture as a multiple of the first.
`python bench/arch_decode.py --output bench/results/issue57/arch-decode.json`; run by another checkout's interpreter,
it times that checkout's Sluice the same way."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

FORMATS = {"fp32": ("float32", "none"), "bf16": ("bfloat16", "none"), "int4": ("float32", "int4"),
           "int8": ("float32", "int8"), "f16": ("float32", "f16")}


def engines_of(archs: list[str], size: str, fmt: str) -> tuple[dict, object]:
    """An engine per architecture on its random checkpoint, in weight format `fmt`; and a spare one built first,
    for the caller to keep: the first engine a process builds decodes slower in fp32 here (20 vs 15 ms a token,
    whichever architecture it is), so none of the timed ones is the first."""
    from sluice.service.bench.shapes import random_checkpoint
    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine

    def build(arch: str) -> LLMEngine:
        cfg = SluiceConfig()
        cfg.model.model = str(random_checkpoint(arch, size))
        cfg.model.dtype, cfg.model.quantization = FORMATS[fmt]
        cfg.cache.num_kv_blocks = 64
        return LLMEngine(cfg)

    spare = build(archs[0])
    return {arch: build(arch) for arch in archs}, spare


def ms_per_token(engine, prompt: list[int], tokens: int) -> float:
    """Decode time a token: a run of `tokens` less a run of one (the prompt's prefill, a prefix hit), over the rest."""
    from sluice.scheduling.sampling_params import SamplingParams

    def run(n: int) -> float:
        start = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - start

    run(1)
    return (run(tokens) - run(1)) / (tokens - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="llama,qwen2,qwen3")
    parser.add_argument("--size", default="135m")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    archs = args.archs.split(",")
    prompt = [(i * 37 + 11) % 40000 + 100 for i in range(64)]
    results = {}
    for fmt in args.formats.split(","):
        engines, spare = engines_of(archs, args.size, fmt)
        times: dict[str, list[float]] = {a: [] for a in archs}
        for _ in range(args.rounds):
            for arch in archs:
                times[arch].append(ms_per_token(engines[arch], prompt, args.tokens))
        medians = {a: statistics.median(t) for a, t in times.items()}
        results[fmt] = {a: {"ms_per_token": round(medians[a], 3), "ratio": round(medians[a] / medians[archs[0]], 3),
                            "runs": [round(t, 3) for t in times[a]]} for a in archs}
        print(fmt, "  ".join(f"{a} {medians[a]:.2f} ms ({medians[a] / medians[archs[0]]:.2f}x)" for a in archs),
              flush=True)
        del engines, spare
    if args.output:
        import sluice

        tree = Path(sluice.__file__).parent  # the checkout whose Sluice ran
        git = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        meta = {"size": args.size, "tokens": args.tokens, "rounds": args.rounds, "machine": platform.machine(),
                "git": git}
        with open(args.output, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
