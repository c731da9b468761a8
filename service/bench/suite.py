"""One process, one model: Sluice's engine and transformers' baselines on the same workloads, side by side."""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from sluice.service.bench.baselines import hf_generate, hf_generate_batch
from sluice.service.bench.ceiling import RawForward, measure_ceiling, sdpa_copy
from sluice.service.bench.offline import OfflineRun, run_workload
from sluice.service.bench.report import result_lines
from sluice.service.bench.workloads import Workload

BASELINES = ("ceiling", "generate", "generate_batch")


class Suite:
    """Holds the engine and, built on first use, an sdpa twin of its model for the baselines."""

    def __init__(self, engine, verbose: bool = True) -> None:
        self.engine = engine
        self.verbose = verbose
        self.start = time.perf_counter()
        self._hf_model = None
        self._raw: RawForward | None = None

    @property
    def hf_model(self):
        """The engine's model as transformers alone runs it: sdpa attention, torch's own linears (a copy)."""
        if self._hf_model is None:
            self._hf_model = sdpa_copy(self.engine.model, plain_linears=True)
        return self._hf_model

    @property
    def raw(self) -> RawForward:
        """Raw-forward timer over an sdpa copy that keeps the engine's linear kernels."""
        if self._raw is None:
            self._raw = RawForward(sdpa_copy(self.engine.model))
        return self._raw

    def log(self, message: str) -> None:
        """Progress note on stderr with the elapsed time."""
        if self.verbose:
            print(f"[bench {time.perf_counter() - self.start:6.0f}s] {message}", file=sys.stderr, flush=True)

    def evaluate(
        self, w: Workload, baselines=BASELINES, gb_max_prompts: int = 0, engine=None, reset_cache: bool = True
    ) -> tuple[OfflineRun, dict]:
        """Run the workload on the engine, then the baselines on the same prompts (generate_batch on at most
        `gb_max_prompts` of them when > 0: on CPU it is slow enough to blow the time budget); one results entry."""
        engine = engine or self.engine
        self.log(f"{w.name}: Sluice, {w.num_prompts} requests")
        run = run_workload(engine, w, reset_cache=reset_cache)
        entry: dict = {
            "workload": dataclasses.asdict(w),
            "prefix_caching": engine.config.cache.enable_prefix_caching,
            "sluice": run.result,
            "prefix_cache_hit_rate": run.prefix_cache_hit_rate,
            "mean_step_ms": run.mean_step_ms,
            "num_steps": len(run.steps),
        }
        for line in result_lines(run.result):
            self.log(line)
        sluice = run.result.output_throughput
        ratios = {}
        # Wall-clock comparisons only mean something when the engine is never idle waiting for arrivals, and
        # static-batch baselines need one output length for all.
        if baselines and (not math.isinf(w.request_rate) or w.random_range_ratio):
            baselines = ()
            entry["note"] = f"{w.name}: baselines skipped (Poisson arrivals or sampled lengths)."
        if "ceiling" in baselines:
            self.log(f"{w.name}: raw-forward ceiling")
            ceiling = entry["ceiling"] = measure_ceiling(run, self.raw)
            ratios["vs_ceiling"] = sluice / ceiling.tokens_per_s
        if "generate" in baselines:
            self.log(f"{w.name}: transformers generate, {len(run.prompts)} prompts")
            g = entry["generate"] = hf_generate(self.hf_model, run.prompts, w.output_len, _pad_id(engine))
            ratios["vs_generate"] = sluice / g.tokens_per_s
        if "generate_batch" in baselines:
            subset = run.prompts[: gb_max_prompts or None]
            self.log(f"{w.name}: transformers generate_batch, {len(subset)} prompts")
            sched = engine.config.scheduler
            # Fewer concurrent requests favour generate_batch on CPU (its sdpa path attends over every cached
            # token of the batch), so a subset makes the Sluice / generate_batch ratio conservative.
            note = (f"generate_batch timed on the first {len(subset)} of {len(run.prompts)} prompts (same lengths); "
                    "fewer concurrent requests favour it") if len(subset) < len(run.prompts) else ""
            gb = entry["generate_batch"] = hf_generate_batch(
                self.hf_model, subset, w.output_len, sched.max_num_batched_tokens, sched.max_num_seqs, note)
            ratios["vs_generate_batch"] = sluice / gb.tokens_per_s
            if note:
                entry["note"] = f"{w.name}: {note}."
        entry["ratios"] = ratios
        for name, value in ratios.items():
            self.log(f"{w.name}: Sluice {name} = {value:.2f}x")
        return run, entry

    def raw_single_stream(self, run: OfflineRun) -> dict:
        """Batch-1 references for a single-stream run: one decode step, and prefill + one decode step per prompt."""
        ctxs = [s.decode_ctx for s in run.steps if s.num_decodes == 1]
        decode_s = self.raw.decode_step(1, round(statistics.fmean(ctxs))) if ctxs else 0.0
        first = [self.raw.prefill([p]) + self.raw.decode_step(1, len(p)) for p in run.prompts[:3]]
        return {"decode_step_ms": 1000 * decode_s, "prefill_plus_decode_ms": 1000 * statistics.median(first)}


def _pad_id(engine) -> int:
    tok = engine.tokenizer
    return tok.pad_token_id if tok.pad_token_id is not None else (engine.eos_token_id or 0)


def meta(engine) -> dict:
    """Where and with what the run happened, so figures from noisy shared machines can be judged."""
    import transformers

    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        git = None
    return {
        "model": engine.served_model_name,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "loadavg_start": _loadavg(),
        "git": git,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": dataclasses.asdict(engine.config),
    }


def _loadavg() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"
