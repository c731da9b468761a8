"""`bench offline --standard`: issue 5's workloads A, B and C, their targets, profile and scheduler scaling."""

from __future__ import annotations

import dataclasses
import time

from sluice.service.bench.grammar_overhead import grammar_overhead
from sluice.service.bench.profile import profile_decode
from sluice.service.bench.sched_micro import scheduler_scaling
from sluice.service.bench.suite import Suite, _loadavg, meta
from sluice.service.bench.workloads import Workload

# A and the profile share seed and prompt length, so the profile's prompts are A's and hit its prefix cache.
A = Workload("A", num_prompts=64, input_len=100, output_len=128, seed=0)
B = Workload("B", num_prompts=8, input_len=100, output_len=128, max_concurrency=1, seed=1)
C = Workload("C", num_prompts=64, input_len=400, output_len=64, max_concurrency=16, seed=2)
C_PREFIX = dataclasses.replace(C, name="C-prefix", prefix_len=300, seed=3)


def target(name: str, value: float | None, goal: float, at_most: bool = False) -> dict:
    """One checked figure: value against goal (>= goal, or <= goal when at_most)."""
    met = value is not None and (value <= goal if at_most else value >= goal)
    return {"name": name, "value": value, "target": f"{'<=' if at_most else '>='} {goal:g}", "met": met}


def run_standard(suite: Suite, profile: bool = True) -> dict:
    """Every standard workload, baselines, targets, profile and scheduler micro-benchmark; the results dict."""
    from sluice.service.engine.engine import LLMEngine

    engine = suite.engine
    results: dict = {"meta": meta(engine), "workloads": {}}
    wl = results["workloads"]
    # First, while the process holds what `sluice serve` holds: the baselines' model copies made later add
    # hundreds of thousands of objects that every garbage collection during the micro-benchmark would scan.
    suite.log("scheduler + KV manager micro-benchmark")
    results["scheduler"] = scheduler_scaling()

    suite.log("grammar overhead: 16 constrained rows in a batch of 64")
    results["grammar"] = grammar_overhead(engine)
    _, wl["A"] = suite.evaluate(A, ("ceiling", "generate_batch"))
    if profile:  # right after A, whose prompts are cached: the profile's own prefill costs next to nothing
        suite.log("profile: batch 64 and batch 1 decode steps")
        results["profile"] = [profile_decode(engine, 1), profile_decode(engine, 64)]
    run_b, wl["B"] = suite.evaluate(B, ())
    suite.log("B: raw batch-1 references")
    wl["B"]["raw"] = suite.raw_single_stream(run_b)
    _, wl["C"] = suite.evaluate(C, ())
    _, wl["C-prefix"] = suite.evaluate(C_PREFIX, ())
    suite.log("building an engine with prefix caching off")
    config = dataclasses.replace(
        engine.config, cache=dataclasses.replace(engine.config.cache, enable_prefix_caching=False)
    )
    no_cache = LLMEngine(config, model=engine.model, tokenizer=engine.tokenizer)
    _, wl["C-prefix-nocache"] = suite.evaluate(
        dataclasses.replace(C_PREFIX, name="C-prefix-nocache"), (), engine=no_cache
    )
    del no_cache
    results["targets"] = targets(results)
    results["meta"]["loadavg_end"] = _loadavg()
    results["meta"]["elapsed_s"] = time.perf_counter() - suite.start
    return results


def targets(results: dict) -> list[dict]:
    """Issue 5's acceptance figures, computed from this run only."""
    wl = results["workloads"]
    a, b = wl["A"], wl["B"]
    out = [
        target("A: Sluice / raw-forward ceiling (tok/s)", a["ratios"].get("vs_ceiling"), 0.60),
        target("A: Sluice / generate_batch (tok/s)", a["ratios"].get("vs_generate_batch"), 3.0),
    ]
    raw = b["raw"]
    out.append(target("B: TPOT p50 / raw decode step at batch 1", _div(b["sluice"].tpot_ms.p50, raw["decode_step_ms"]),
                      1.25, at_most=True))
    out.append(target("B: TTFT p50 / (raw prefill + 1 decode step)",
                      _div(b["sluice"].ttft_ms.p50, raw["prefill_plus_decode_ms"]), 1.25, at_most=True))
    out.append(target("C: TTFT p50 without / with prefix caching (shared 300-token prefix)",
                      _div(wl["C-prefix-nocache"]["sluice"].ttft_ms.p50, wl["C-prefix"]["sluice"].ttft_ms.p50), 2.0))
    profiles = {p.batch: p for p in results.get("profile", [])}
    if 64 in profiles:
        out.append(target("batch 64: scheduling share of a decode step", _div(
            profiles[64].phase_ms["scheduling"], profiles[64].step_ms), 0.05, at_most=True))
        out.append(target("batch 64: all but forward + sampling, share of a step", profiles[64].overhead_share, 0.05,
                          at_most=True))
    if results.get("grammar"):
        g = results["grammar"]
        out.append(target("batch 64: 16 grammar-constrained rows, share of a decode step", g["grammar_share"], 0.10,
                          at_most=True))
        out.append(target("batch 64: logits processing with no constrained row, share of a step",
                          g["no_constraint_share"], 0.005, at_most=True))
    sched = {p.num_running: p for p in results.get("scheduler", [])}
    if 64 in sched and 1024 in sched:
        out.append(target("scheduler µs per request, 1024 vs 64 running (1 = linear)",
                          _div(sched[1024].us_per_request, sched[64].us_per_request), 2.0, at_most=True))
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
