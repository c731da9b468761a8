"""CUDA graphs of the decode step: one capture per batch size, replayed for every later step of that size.

A decode step of the owned forward launches a few hundred small kernels; launched one by one from Python, the
host's time to issue them is most of the step (a ~1B model's weights stream in well under a millisecond on a
datacenter GPU). A graph captured once per size in `DecodeBuffers.sizes` issues them all in one launch. The
captured forward reads its inputs from the persistent buffers and its attention from the Triton decode kernel
(`service/attention/triton_decode.py`), whose shapes depend on the row count only, so a replay serves any step of its
size once `DecodeBuffers.fill` has copied that step's inputs in. Graphs share one memory pool, captured largest
first (vLLM's order), and their logits stay in the pool: the runner reads them before the next replay.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger("sluice.engine")


class DecodeGraphs:
    """Captured decode forwards by batch size."""

    def __init__(self) -> None:
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # Each size's run(), kept: it holds tensors the graph reads but did not allocate (its row indices, the
        # attention metadata). Freed, their memory goes back to the caching allocator, the next allocation
        # overwrites it, and the replay gathers rows at garbage indices.
        self._runs: dict[int, Callable[[], torch.Tensor]] = {}
        self.capture_s = 0.0
        self._pool = None

    def __contains__(self, size: int) -> bool:
        return size in self.graphs

    def capture(self, size: int, run: Callable[[], torch.Tensor]) -> None:
        """Record run() (the decode forward of `size` rows on the persistent buffers) as the graph of that size."""
        start = time.perf_counter()
        # A warm-up outside the capture, on a side stream as torch advises: lazy initializations (cuBLAS
        # workspaces, Triton's compile of the decode kernel) must not happen while recording.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = run()
        self._pool = graph.pool()
        self.graphs[size] = (graph, logits)
        self._runs[size] = run
        self.capture_s += time.perf_counter() - start

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of `size` on the buffers' current contents; its logits [size, V] (valid until the next
        replay of any size: the graphs share their memory)."""
        graph, logits = self.graphs[size]
        graph.replay()
        return logits


def capture_decode_graphs(runner) -> DecodeGraphs | None:
    """Every capture size of the runner's decode buffers, or None (with the reason logged) where a capture
    fails: the engine then runs its decode steps eagerly, only slower."""
    graphs = DecodeGraphs()
    try:
        runner.capture_decode(graphs.capture)
    except Exception as e:  # a capture that fails must not stop the server: eager steps are correct, only slower
        logger.warning("CUDA graphs: capture failed (%s: %s); decode steps run eagerly", type(e).__name__,
                       str(e)[:300])
        torch.cuda.synchronize()
        return None
    torch.cuda.synchronize()
    sizes = sorted(graphs.graphs)
    logger.info("CUDA graphs: %d decode batch sizes captured (%s) in %.1f s", len(sizes),
                f"{sizes[0]}..{sizes[-1]}" if len(sizes) > 1 else sizes[0], graphs.capture_s)
    return graphs
