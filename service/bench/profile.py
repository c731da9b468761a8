"""Where one engine iteration's time goes: timers wrapped around the engine's pieces (no engine edits).

Phases of a step, which add up to the step's wall time:
  scheduling     Scheduler.schedule() + update_from_output()
  input_prep     ModelRunner._prepare: packed ids, positions, slot mapping, attention metadata
  attention      the paged attention function, summed over layers
  forward_rest   the model forward minus attention: matmuls, norms, rotary, lm_head for sampled rows
  sampling       the sampler
  runner_other   the rest of ModelRunner.execute (swaps, logits.float(), output dicts)
  detokenize     IncrementalDetokenizer.update
  fanout         building EngineOutputs, stop checks, stats and stat loggers: the rest of LLMEngine.step()
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.bench.hooks import Timers, all_patched
from sluice.service.bench.workloads import Workload, token_prompts

PHASES = ("scheduling", "input_prep", "attention", "forward_rest", "sampling", "runner_other", "detokenize", "fanout")


@dataclass(slots=True)
class StepProfile:
    """Mean ms per phase over the steady decode steps at one batch size."""

    batch: int
    steps: int
    step_ms: float
    phase_ms: dict[str, float] = field(default_factory=dict)
    overhead_share: float = 0.0  # everything but the forward and sampling, as a fraction of the step
    top_ops: list[tuple[str, float]] = field(default_factory=list)  # (op, self ms per step) from torch.profiler


def _patches(engine, timers: Timers) -> list:
    import sluice.service.attention.attention_backend as attention_backend
    import sluice.service.engine.detokenizer as detokenizer
    import sluice.service.executor.layers.attention as attention_layer
    import sluice.service.executor.model_runner as model_runner

    runner = engine.runner
    return [
        (engine.scheduler, "schedule", timers.wrap("schedule")),
        (engine.scheduler, "update_from_output", timers.wrap("update")),
        (runner, "execute", timers.wrap("execute")),
        (runner, "_prepare", timers.wrap("prepare")),
        (runner, "_forward", timers.wrap("forward")),
        (model_runner, "sample", timers.wrap("sample")),
        (attention_backend, "paged_attention", timers.wrap("attention")),
        (attention_layer, "paged_attention", timers.wrap("attention")),
        (detokenizer.IncrementalDetokenizer, "update", timers.wrap("detok")),
        (engine, "_detokenize", timers.wrap("detokenize_total")),
    ]


def phases(t: dict[str, float], step: float) -> dict[str, float]:
    """Raw timer totals of one step (seconds) → the disjoint phases in PHASES (seconds)."""
    g = t.get
    forward = g("forward", 0.0)
    execute = g("execute", 0.0)
    return {
        "scheduling": g("schedule", 0.0) + g("update", 0.0),
        "input_prep": g("prepare", 0.0),
        "attention": g("attention", 0.0),
        "forward_rest": forward - g("attention", 0.0),
        "sampling": g("sample", 0.0),
        "runner_other": execute - g("prepare", 0.0) - forward - g("sample", 0.0),
        "detokenize": g("detok", 0.0),
        "fanout": step - g("schedule", 0.0) - g("update", 0.0) - execute - g("detok", 0.0),
    }


def profile_decode(
    engine, batch: int, input_len: int = 100, output_len: int = 24, seed: int = 0, op_steps: int = 3
) -> StepProfile:
    """Run `batch` requests and profile the steps where all of them decode (no prefill in the batch)."""
    # With a small step budget the batch fills over several steps; requests must outlive that ramp.
    budget = engine.config.scheduler.max_num_batched_tokens
    ramp = -(-batch * input_len // max(1, budget - batch)) + 2
    w = Workload(f"profile-b{batch}", num_prompts=batch, input_len=input_len,
                 output_len=ramp + output_len + op_steps, seed=seed)
    prompts = token_prompts(w, engine.vocab_size, frozenset(engine.tokenizer.all_special_ids))
    params = SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"{w.name}-{time.monotonic_ns()}-{i}", p, params)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else None
    timers = Timers(sync)
    rows: list[dict[str, float]] = []
    steps: list[float] = []
    top_ops: list[tuple[str, float]] = []
    with all_patched(_patches(engine, timers)):
        while engine.has_unfinished_requests():
            steady = engine.num_running == batch and engine.num_waiting == 0 and _all_decoding(engine)
            if steady and len(rows) >= output_len - 4 and not top_ops and op_steps:
                top_ops = _op_profile(engine, op_steps)
                timers.take()
                continue
            start = time.perf_counter()
            engine.step()
            step = time.perf_counter() - start
            raw = timers.take()
            if steady:
                rows.append(phases(raw, step))
                steps.append(step)
    if not rows:
        raise RuntimeError(f"no steady decode steps at batch {batch}: max_num_seqs below {batch}, or a KV cache "
                           f"too small for {batch} x {input_len + w.output_len} tokens (preemptions)?")
    rows, steps = rows[1:] or rows, steps[1:] or steps  # the first decode step after prefill pays warm-up costs
    mean = {name: 1000 * statistics.fmean(r[name] for r in rows) for name in PHASES}
    step_ms = 1000 * statistics.fmean(steps)
    overhead = step_ms - mean["forward_rest"] - mean["attention"] - mean["sampling"]
    return StepProfile(batch, len(rows), step_ms, mean, overhead / step_ms if step_ms else 0.0, top_ops)


def _all_decoding(engine) -> bool:
    return all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)


def _op_profile(engine, n: int, limit: int = 12) -> list[tuple[str, float]]:
    """torch.profiler over n steps: the ops with the most self time, in ms per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            engine.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:limit]
    return [(e.key, e.self_cpu_time_total / 1000 / n) for e in events]
