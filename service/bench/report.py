"""Turning results into files and tables: results.json, a markdown summary, and console output."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import orjson

from sluice.service.bench.stats import BenchResult


def to_jsonable(obj):
    """Dataclasses to dicts, inf/nan to strings (JSON has neither), recursively."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


def write_json(path: str | Path, data) -> Path:
    """Write `data` as indented JSON, creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(to_jsonable(data), option=orjson.OPT_INDENT_2))
    return path


def result_lines(r: BenchResult) -> list[str]:
    """A vLLM-style block of figures for one run."""
    lines = [
        f"{'=' * 16} {r.name} {'=' * max(1, 40 - len(r.name))}",
        f"{'Successful requests:':<34}{r.completed:>12}",
        f"{'Failed requests:':<34}{r.failed:>12}",
        f"{'Duration (s):':<34}{r.duration_s:>12.2f}",
        f"{'Total input tokens:':<34}{r.input_tokens:>12}",
        f"{'Total output tokens:':<34}{r.output_tokens:>12}",
        f"{'Request throughput (req/s):':<34}{r.request_throughput:>12.2f}",
        f"{'Output token throughput (tok/s):':<34}{r.output_throughput:>12.2f}",
        f"{'Total token throughput (tok/s):':<34}{r.total_token_throughput:>12.2f}",
    ]
    for label, d in (("TTFT", r.ttft_ms), ("TPOT", r.tpot_ms), ("ITL", r.itl_ms), ("E2E latency", r.e2el_ms)):
        lines.append(f"{label + ' (ms) mean/p50/p90/p99:':<34}{d.mean:>9.1f}{d.p50:>9.1f}{d.p90:>9.1f}{d.p99:>9.1f}")
    if r.spec:
        rate, per_forward = r.spec["acceptance_rate"], r.spec["tokens_per_forward"]
        lines.append(f"{'Spec drafted / accepted tokens:':<34}"
                     f"{r.spec['draft_tokens']:>9.0f}{r.spec['accepted_tokens']:>9.0f}"
                     f"  (acceptance {_f(rate and 100 * rate)}%, {_f(per_forward, 2)} decode tokens per forward, "
                     f"from {r.spec['source']})")
    lines += [f"  error: {e}" for e in r.errors]
    return lines


def _f(x, digits: int = 1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown(results: dict) -> str:
    """The short markdown report of an offline run (standard or custom)."""
    meta = results.get("meta", {})
    out = [
        "# Sluice benchmark",
        "",
        f"Model {meta.get('model')} on {meta.get('device')} ({meta.get('dtype')}), torch {meta.get('torch')}, "
        f"transformers {meta.get('transformers')}, {meta.get('threads')} torch threads on {meta.get('cpus')} CPUs; "
        f"load average {meta.get('loadavg_start')} at start, {meta.get('loadavg_end')} at end; "
        f"{meta.get('elapsed_s', 0):.0f} s in all. Git {meta.get('git')}.",
        "",
        "| workload | requests | prompt → output | Sluice tok/s | req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| ITL p50 / p99 ms | raw ceiling tok/s | generate_batch tok/s | generate tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, w in results.get("workloads", {}).items():
        r, wl = w["sluice"], w["workload"]
        conc = f", conc {wl['max_concurrency']}" if wl["max_concurrency"] else ""
        prefix = f", prefix {wl['prefix_len']}" if wl["prefix_len"] else ""
        cache = "" if w.get("prefix_caching", True) else ", no prefix caching"
        gb = w.get("generate_batch")
        gb_cell = "–" if gb is None else _f(gb["tokens_per_s"]) + (
            f" ({gb['num_prompts']} prompts)" if gb["num_prompts"] != r["completed"] + r["failed"] else "")
        out.append(
            f"| {name} | {r['completed']}{'' if not r['failed'] else ' (+' + str(r['failed']) + ' failed)'}{conc} "
            f"| {wl['input_len']}{prefix}{cache} → {wl['output_len']} | **{_f(r['output_throughput'])}** "
            f"| {_f(r['request_throughput'], 2)} | {_f(r['ttft_ms']['p50'])} / {_f(r['ttft_ms']['p99'])} "
            f"| {_f(r['tpot_ms']['p50'])} / {_f(r['tpot_ms']['p99'])} "
            f"| {_f(r['itl_ms']['p50'])} / {_f(r['itl_ms']['p99'])} "
            f"| {_f((w.get('ceiling') or {}).get('tokens_per_s'))} | {gb_cell} "
            f"| {_f((w.get('generate') or {}).get('tokens_per_s'))} |"
        )
    notes = [w["note"] for w in results.get("workloads", {}).values() if w.get("note")]
    if notes:
        out += [""] + [f"- {n}" for n in notes]
    if results.get("targets"):
        out += ["", "## Targets", "", "| check | value | target | met |", "|---|---|---|---|"]
        for t in results["targets"]:
            out.append(f"| {t['name']} | {_f(t['value'], 2)} | {t['target']} | {'yes' if t['met'] else '**no**'} |")
    if results.get("profile"):
        profiles = results["profile"]
        out += ["", "## Where a decode step's time goes", "",
                "| phase | " + " | ".join(f"batch {p['batch']} ms (%)" for p in profiles) + " |",
                "|---|" + "---|" * len(profiles)]
        for phase in profiles[0]["phase_ms"]:
            cells = [f"{p['phase_ms'][phase]:.2f} ({100 * p['phase_ms'][phase] / p['step_ms']:.0f}%)" for p in profiles]
            out.append(f"| {phase} | " + " | ".join(cells) + " |")
        out.append("| **step** | " + " | ".join(f"**{p['step_ms']:.2f}**" for p in profiles) + " |")
        out.append("| overhead (all but forward + sampling) | "
                   + " | ".join(f"{100 * p['overhead_share']:.1f}%" for p in profiles) + " |")
        for p in profiles:
            if p.get("top_ops"):
                ops = ", ".join(f"{name} {ms:.1f}" for name, ms in p["top_ops"][:8])
                out += ["", f"Top ops at batch {p['batch']} (self ms per step, torch.profiler): {ops}."]
    if results.get("grammar"):
        g = results["grammar"]
        out += ["", "## Structured outputs: grammar work per decode step", "",
                f"Batch {g['batch']}, median step {g['step_ms']:.1f} ms. {g['constrained_rows']} constrained rows "
                f"(bitmask fill, mask, matcher advance): {g['grammar_ms']:.2f} ms = {100 * g['grammar_share']:.1f}% "
                f"of the step. No constrained row: {g['no_constraint_ms'] * 1e3:.0f} µs = "
                f"{100 * g['no_constraint_share']:.3f}%."]
    if results.get("scheduler"):
        out += ["", "## Scheduler + KV manager alone (no model)", "",
                "| running requests | schedule µs | update µs | per step µs | µs per request |",
                "|---|---|---|---|---|"]
        for s in results["scheduler"]:
            out.append(f"| {s['num_running']} | {s['schedule_us']:.0f} | {s['update_us']:.0f} | {s['step_us']:.0f} "
                       f"| {s['us_per_request']:.1f} |")
    return "\n".join(out) + "\n"
