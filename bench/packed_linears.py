"""The linears of a 1.7B Llama (SmolLM2-1.7B's shapes, 24 layers; with --head its 49,152-row output head too) on
random GGUF blocks of each type, timed in process: as the file stores them (csrc/gguf_linear.cpp's GEMV up to 32
rows, dequantized tiles + GEMM past them) against regrouped for csrc/int4_linear.cpp (quant_types.py's Packing).
`python bench/packed_linears.py --types Q4_K,Q5_0,Q8_0 --output bench/results/packed-linears.json`."""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from sluice import native
from sluice.service.executor.layers.gguf_blocks import GgufBlocks
from sluice.service.executor.layers.gguf_linear import GgufLinear
from sluice.service.executor.layers.quant_types import BY_NAME

HIDDEN, INNER, LAYERS, VOCAB = 2048, 8192, 24, 49152
SHAPES = {"qkv": (3 * HIDDEN, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INNER, HIDDEN), "down": (HIDDEN, INNER)}
# float16 fields of a block
SCALES = {"Q4_0": (0,), "Q4_K": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_1": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, row_bytes]: random codes (and 6-bit scales), small finite float16 scales."""
    t = BY_NAME[qtype]
    blocks = torch.randint(0, 256, (n * k // t.block_size, t.block_bytes), dtype=torch.uint8, generator=gen)
    for at in SCALES[qtype]:
        scale = (torch.rand(len(blocks), generator=gen) * 1e-4).half()
        blocks[:, at:at + 2] = scale.view(torch.uint8).view(-1, 2)
    return blocks.view(n, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--types", default="Q4_K")
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--head", action="store_true", help="the output head alone instead of the layers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    kernel, gen = native.load(), torch.Generator().manual_seed(0)
    shapes = [(VOCAB, HIDDEN)] if args.head else [shape for _ in range(args.layers) for shape in SHAPES.values()]
    results = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "isa": kernel.int4_linear_isa(), "shapes": "head" if args.head else f"{args.layers} layers", "ms": {}}
    for qtype in args.types.split(","):
        stored, packed = [], []
        for n, k in shapes:
            blocks = GgufBlocks(random_blocks(qtype, n, k, gen), qtype, k)
            stored.append(GgufLinear(blocks, None, kernel, repack=False))
            packed.append(GgufLinear(blocks, None, kernel))
        results["ms"][qtype] = {}
        with torch.inference_mode():
            for rows in (int(r) for r in args.rows.split(",")):
                xs = {k: torch.randn(rows, k) for _, k in shapes}
                times = results["ms"][qtype][f"{rows}"] = {"stored": [], "packed": []}
                for _ in range(args.repeats):  # alternating
                    for name, linears in (("stored", stored), ("packed", packed)):
                        started = time.perf_counter()
                        for linear in linears:
                            linear(xs[linear.in_features])
                        times[name].append(round((time.perf_counter() - started) * 1e3, 1))
                print(qtype, rows, times, flush=True)
        del stored, packed
    with open(args.output, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
