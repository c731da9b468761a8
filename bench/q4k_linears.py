"""The linears of a 1.7B Llama (SmolLM2-1.7B's shapes, 24 layers) on random Q4_K blocks, timed in process: as the
file stores them (csrc/gguf_linear.cpp, dequantized tiles + GEMM past 32 rows) against repacked for
csrc/int4_linear.cpp's q4_k_linear. `python bench/q4k_linears.py --output bench/q4k-linears.json`."""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from sluice import native
from sluice.service.engine.layers.gguf_blocks import GgufBlocks
from sluice.service.engine.layers.gguf_linear import GgufLinear

HIDDEN, INNER, LAYERS = 2048, 8192, 24
SHAPES = {"qkv": (3 * HIDDEN, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INNER, HIDDEN), "down": (HIDDEN, INNER)}


def random_q4_k(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, k / 256 * 144]: random codes and 6-bit scales, small finite d and dmin."""
    blocks = torch.randint(0, 256, (n * k // 256, 144), dtype=torch.uint8, generator=gen)
    for at in (0, 2):
        scale = (torch.rand(len(blocks), generator=gen) * 1e-4).half()
        blocks[:, at:at + 2] = scale.view(torch.uint8).view(-1, 2)
    return blocks.view(n, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    kernel, gen = native.load(), torch.Generator().manual_seed(0)
    stored, packed = [], []
    for _ in range(LAYERS):
        for n, k in SHAPES.values():
            blocks = GgufBlocks(random_q4_k(n, k, gen), "Q4_K", k)
            stored.append(GgufLinear(blocks, None, kernel, repack=False))
            packed.append(GgufLinear(blocks, None, kernel))
    results = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "isa": kernel.int4_linear_isa(), "ms": {}}
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for _, k in SHAPES.values()}
            times = results["ms"][f"{rows}"] = {"stored": [], "packed": []}
            for _ in range(args.repeats):  # alternating
                for name, linears in (("stored", stored), ("packed", packed)):
                    started = time.perf_counter()
                    for linear in linears:
                        linear(xs[linear.in_features])
                    times[name].append(round((time.perf_counter() - started) * 1e3, 1))
            print(rows, times, flush=True)
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
