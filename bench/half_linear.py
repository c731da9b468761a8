"""16-bit weights with float32 arithmetic (`--quantization f16`) against float32's packed oneDNN weights, per linear
shape of SmolLM2-135M and -360M, in one process: milliseconds a call for the widening GEMV (packed_linear.cpp's
packed_linear_half on a float16 weight in its 64-column blocks, which takes every call) and float32's two paths on
its packed weight (packed_linear.cpp's GEMV, oneDNN's GEMM), at decode-sized and prefill-sized row counts. Each
weight is read from enough copies to stream past the caches, as a model's linears do.
`python bench/half_linear.py --output bench/results/half-linear.json`."""

from __future__ import annotations

import argparse
import json
import platform

import torch
from f32_gemv import median_s  # bench/ is the script's directory, first on sys.path

from sluice import native
from sluice.service.executor import packed_gemv
from sluice.service.executor.layers.half_linear import pack_half
from sluice.service.executor.layers.linear import PACK_BATCH_HINT, onednn_linear, pad_rows

SHAPES = {
    "135m": [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)],
    "360m": [(1600, 960), (960, 960), (5120, 960), (960, 2560), (49152, 960)],
}
STREAM_BYTES = 128 << 20  # float32 bytes of copies of a weight: enough to read past the caches each round


def timings(kernel, x: torch.Tensor, halves: list[torch.Tensor], packed: list[torch.Tensor],
            layout: tuple[int, int] | None, n: int, repeats: int) -> dict[str, float]:
    """ms a call of each path at x's row count, over every copy of the [n, K] weight."""
    padded = pad_rows(x, x.shape[1])[0]
    calls = {"f16 gemv": lambda: [kernel.packed_linear_half(x, w, n) for w in halves],
             "fp32 packed gemm": lambda: [onednn_linear(padded, p, None) for p in packed]}
    if layout is not None:
        ptrs = [torch.ops.mkldnn.data_ptr(p) for p in packed]
        calls["fp32 packed gemv"] = lambda: [packed_gemv.gemv(x, ptr, n, layout) for ptr in ptrs]
    return {name: round(median_s(call, repeats) * 1e3 / len(halves), 3) for name, call in calls.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", required=True)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", default="1,4,16,64,256,512")
    args = parser.parse_args()
    results = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "unit": "ms a call, the median over the copies' calls", "shapes": {}}
    kernel = native.load()
    with torch.inference_mode():
        for size, shapes in SHAPES.items():
            for n, k in shapes:
                floats = [torch.randn(n, k) * 0.02 for _ in range(max(1, STREAM_BYTES // (n * k * 4)))]
                packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in floats]
                halves = [pack_half(w.half()) for w in floats]
                layout = packed_gemv.gemv_layout(packed[0], floats[0])
                del floats
                line = results["shapes"][f"{size} {n}x{k}"] = {}
                for rows in (int(r) for r in args.rows.split(",")):
                    line[f"{rows} rows"] = timings(kernel, torch.randn(rows, k), halves, packed, layout, n,
                                                           args.repeats)
                print(size, n, k, line, flush=True)
    with open(args.output, "w") as out:
        json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
