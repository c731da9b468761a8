"""The fp32 decode GEMV's memory bandwidth per linear shape of SmolLM2-135M, -360M and -1.7B, beside what a torch
sum reads (the machine's streaming rate) and torch's own linear, in one process.
`python bench/f32_gemv.py --output bench/results/f32-gemv.json`."""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time

import torch
import torch.nn.functional as F

from sluice import native

# [N, K] per model: fused q/k/v, o, fused gate/up, down, and the output head.
SHAPES = {
    "135m": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
    "360m": [(1600, 960), (960, 960), (5120, 960), (960, 2560), (49152, 960)],
    "1.7b": [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (49152, 2048)],
}
STREAM_BYTES = 256 << 20  # copies of a weight enough to read past the caches each call


def median_s(fn, repeats: int) -> float:
    """The median wall time of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def rate(gb: float, op, weights: list[torch.Tensor], repeats: int) -> float:
    """GB/s of weights `op(w)` reads over `weights`, one call each."""
    return round(gb / median_s(lambda: [op(w) for w in weights], repeats), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    kernel = native.load()
    results = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "unit": "GB/s of weights read", "shapes": {}}
    with torch.inference_mode():
        for size, shapes in SHAPES.items():
            for n, k in shapes:
                weights = [torch.randn(n, k) for _ in range(max(1, STREAM_BYTES // (n * k * 4)))]
                gb = n * k * 4 * len(weights) / 1e9
                line = results["shapes"][f"{size} {n}x{k}"] = {"sum": rate(gb, torch.sum, weights, args.repeats)}
                for rows in (int(r) for r in args.rows.split(",")):
                    x = torch.randn(rows, k)
                    line[f"gemv {rows}"] = rate(gb, functools.partial(kernel.f32_linear, x), weights, args.repeats)
                    line[f"torch {rows}"] = rate(gb, functools.partial(F.linear, x), weights, args.repeats)
                print(size, n, k, line, flush=True)
    with open(args.output, "w") as out:
        json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
