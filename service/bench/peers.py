"""`bench peers` (`make bench-peers`): Sluice beside llama.cpp's server, same machine, same workloads, one table.

Per model size (135m: SmolLM2-135M-Instruct; 360m, 1.7b: random models of SmolLM2's shapes, peer_models.py) and
weight format pair (peer_plan.py), each server runs alone, measured on workloads A, B, C (and D, repetitive, with
n-gram speculation off and on) scaled to the size, and on E (one long prompt at a time) on a server of its own;
the server's resident memory is read after every workload. E's prefill rate is set against the machine's matmul
rate, measured once per run before any server starts. The results file is rewritten after every server, so a run
cut short keeps what it measured, and `resume` skips the lines it already holds with the same plan. With `rounds`
above one every line runs that many times, the order reversed each round (S, L, ..., L, S): a machine whose speed
drifts over minutes then weighs on every line alike, and each figure is the median of the line's rounds.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import sluice.service.bench.isa_cap as isa_cap
from sluice.machine import cache_root
from sluice.service.bench.llama_cpp import ISA, build_llama_server, cpu_flags
from sluice.service.bench.peer_models import disk_mib, prepare
from sluice.service.bench.peer_plan import (
    GGUF_SERVED,
    SPEC_LLAMA,
    SPEC_SLUICE,
    Launch,
    Line,
    default_pairs,
    estimate_lines,
    float_pairs,
    plan,
    prefill_flops,
    warmup,
)
from sluice.service.bench.peer_plan import workloads as scaled_workloads
from sluice.service.bench.peers_report import PEAK_DTYPES, rate_unit, ratios, table
from sluice.service.bench.serve import ServeConfig, run_serve
from sluice.service.bench.server_process import ServerProcess, neutral_cwd
from sluice.service.bench.shapes import random_checkpoint

NO_SPEC_FLAG = "this sluice serve has no --speculative-method (n-gram speculation not built yet)"


def run_peers(output: Path, sizes: tuple[str, ...] = ("135m", "360m", "1.7b"), pairs=None,
              d_sizes: tuple[str, ...] = ("135m",), baseline: str = "", shapes: tuple[str, ...] = (),
              resume: bool = False, rounds: int = 1, workloads: tuple[str, ...] = (), isa: str = "native",
              log=print) -> dict:
    """Build what is missing, run every line of the plan in turn, rewrite JSON and Markdown after each one.

    `pairs`: the weight format pairs (None: default_pairs, the float pair by this CPU).

    `baseline`: a git ref whose Sluice runs right before this one on every Sluice line ("Sluice@<sha8> ...").
    `shapes`: other layer layouts ("qwen2-135m", see shapes.py) served by Sluice alone on A and B.
    `rounds`: times every line runs, in alternating order; each figure is the median of its rounds.
    `workloads`: run only these ("E": time to first token of long prompts and the memory they leave; all where
    empty).
    `isa`: "native", or a cap both servers are held to (isa_cap.py: "avx2", another machine's code paths here).
    """
    check_rounds(rounds, resume)
    machine_flags = cpu_flags()
    isa_cap.check(isa, machine_flags)
    flags = isa_cap.capped(machine_flags, isa)
    bf16_flags = isa_cap.bf16_flags(isa)
    pairs = default_pairs(bf16_flags) if pairs is None else pairs
    cache = cache_root() / "peers"
    server = build_llama_server(cache, log, isa)
    pythons = {"Sluice": sys.executable}
    sha = ""
    if baseline:
        from sluice.service.bench.baseline import baseline_python, resolve

        sha = resolve(baseline)
        pythons[f"Sluice@{sha[:8]}"] = str(baseline_python(sha, cache, log))
    lines = plan(sizes, pairs, d_sizes, bf16=bool(bf16_flags), baseline=sha, shapes=shapes, workloads=workloads)
    served = (GGUF_SERVED[ours] for ours, _ in pairs if ours in GGUF_SERVED)  # the files Sluice's gguf lines read
    kinds = tuple(dict.fromkeys([*(theirs for _, theirs in pairs), *served]))
    log("preparing models: " + ", ".join(sizes))
    models = prepare(cache, sizes, kinds, log)
    threads = str(len(os.sched_getaffinity(0)))
    results = {"meta": {"cpu_flags": sorted(f for f, _ in ISA if f in flags), "threads": threads,
                        "isa_cap": isa_cap.describe(isa, machine_flags),
                        "sizes": list(sizes), "baseline": sha, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "rounds": rounds, "float_pair": float_pairs(bf16_flags)[1],
                        "formats": ["/".join(p) for p in pairs],
                        "models": {s: ("SmolLM2-135M-Instruct" if s == "135m"
                                       else f"random weights, SmolLM2-{s.upper()}'s shape") for s in sizes},
                        "disk_mib": disk_mib(models.values())}, "servers": {}}
    if resume and output.is_file():
        old = json.loads(output.read_text())
        results["servers"] = old.get("servers", {})
        results["meta"]["sizes"] = list(dict.fromkeys([*old.get("meta", {}).get("sizes", []), *sizes]))
        results["meta"]["models"] = {**old.get("meta", {}).get("models", {}), **results["meta"]["models"]}
    for text in estimate_lines([line for line, _ in round_order(lines, rounds)]):
        log(text)
    log(f"float pair: {results['meta']['float_pair']}")
    dtypes = sorted({PEAK_DTYPES.get(line.fmt, "float32") for line in lines if "E" in _workloads_of(line)})
    peaks = {d: machine_peak(d, int(threads), log, isa) for d in dtypes}
    results["meta"]["peak_gflop_s"] = {d: rate for d, rate in peaks.items() if rate is not None}
    spec_ok = _has_spec_flag(sys.executable)
    measured: dict[str, list[dict]] = {}
    for line, turn in round_order(lines, rounds):
        done = results["servers"].get(line.name)
        if resume and done and done.get("plan") == _plan_of(line) and not {"error", "skipped"} & set(done):
            log(f"--- {line.name}: in {output} already")
            continue
        log(f"--- {line.name}" + (f" (round {turn + 1} of {rounds})" if rounds > 1 else ""))
        if line.sluice and line.spec and not spec_ok:
            log(f"skipped: {NO_SPEC_FLAG}")
            results["servers"][line.name] = {"skipped": NO_SPEC_FLAG, "plan": _plan_of(line)}
        else:
            cmds = [command(line, launch, models, server, pythons, threads) for launch in line.launches]
            env = isa_cap.server_env(isa) if line.sluice else None
            measured.setdefault(line.name, []).append(_measure(line, cmds, log, env))
            results["servers"][line.name] = median_of_rounds(measured[line.name])
        results["ratios"] = ratios(results["servers"], results["meta"]["sizes"])
        _write(output, results)
    log(f"wrote {output} and {output.with_suffix('.md')}")
    return results


def check_rounds(rounds: int, resume: bool) -> None:
    """Refuses a round count the run cannot honour: below one, or several with `resume` (which skips whole lines)."""
    if rounds < 1 or (resume and rounds > 1):
        raise ValueError("--rounds must be at least 1, and --resume keeps single-round lines only")


def round_order(lines: list[Line], rounds: int) -> list[tuple[Line, int]]:
    """(line, round) in run order: the plan's order, then reversed, and so on."""
    return [(line, turn) for turn in range(rounds) for line in (lines if turn % 2 == 0 else lines[::-1])]


MEDIAN_FIELDS = ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms", "duration_s", "rss_mib", "prefill_tok_s",
                 "prefill_gflop_s")


def median_of_rounds(runs: list[dict]) -> dict:
    """One line's result from its rounds: the last round's, with each workload's speeds and latencies and each
    resident-memory figure the median over the rounds that measured it, failures and completions summed, and the
    rounds themselves kept under "rounds" (one round: that round as it is)."""
    if len(runs) == 1:
        return runs[0]
    out = copy.deepcopy(runs[-1])
    for key, value in runs[-1].items():
        if key.startswith(("rss_mib", "peak_rss_mib")):
            out[key] = statistics.median(r[key] for r in runs if r.get(key) is not None)
        elif key in ("A", "B", "C", "D", "E") and isinstance(value, dict):
            present = [r[key] for r in runs if isinstance(r.get(key), dict)]
            for field in MEDIAN_FIELDS:
                values = [w[field] for w in present if w.get(field) is not None]
                if values:
                    out[key][field] = statistics.median(values)
            for field in ("completed", "failed"):
                out[key][field] = sum(w.get(field, 0) for w in present)
    out["rounds"] = runs
    return out


def command(line: Line, launch: Launch, models: dict, server: Path, pythons: dict, threads: str) -> list[str]:
    """The server command line of one launch of `line`."""
    if not line.sluice:
        cmd = [str(server), "-m", str(models[line.size, line.fmt]), "-t", threads, "--parallel", str(launch.slots),
               "-c", str(launch.kv_tokens), "--no-kv-unified"]
        return [*cmd, *SPEC_LLAMA.get(line.spec, ())]
    model = models[line.size, "hf"] if line.arch == "llama" else random_checkpoint(line.arch, line.size)
    python = pythons[line.engine]
    return sluice_command(python, line.fmt, model, models.get((line.size, GGUF_SERVED.get(line.fmt))), launch.kv_tokens,
                          spec=bool(line.spec), kv16="--kv-cache-dtype" in _serve_help(python))


def sluice_command(python: str, fmt: str, model: Path, gguf_file: Path | None, kv_tokens: int, spec: bool = False,
                   kv16: bool = True) -> list[str]:
    """`sluice serve` for one weight format with `kv_tokens` of KV cache (blocks of 16), stored in float16 where
    `kv16` and the compute dtype is float32, as llama.cpp's default f16 cache whatever its weights (a commit from
    before --kv-cache-dtype keeps its cache in the compute dtype). `gguf_file`: llama.cpp's own file, whose blocks
    the GGUF_SERVED formats serve as stored."""
    if fmt in GGUF_SERVED:
        model = gguf_file
    dtype = "bfloat16" if fmt == "bf16" else "float32"
    cmd = [python, "-m", "sluice.service.cli", "serve", "--model", str(model), "--dtype", dtype,
           "--max-model-len", "2048", "--block-size", "16", "--num-kv-blocks", str(kv_tokens // 16)]
    quant = "gguf" if fmt in GGUF_SERVED else fmt if fmt in ("int4", "f16") else None
    kv = ["--kv-cache-dtype", "float16"] if kv16 and fmt != "bf16" else []
    return [*cmd, *(["--quantization", quant] if quant else []), *kv, *(SPEC_SLUICE if spec else ())]


@functools.cache
def _serve_help(python: str) -> str:
    """`sluice serve --help` of that interpreter's Sluice (the flags a baseline commit knows)."""
    return subprocess.run([python, "-m", "sluice.service.cli", "serve", "--help"], capture_output=True,
                          cwd=neutral_cwd(), text=True).stdout


def _has_spec_flag(python: str) -> bool:
    return "--speculative-method" in _serve_help(python)


def _workloads_of(line: Line) -> set[str]:
    return {w for launch in line.launches for w in launch.workloads}


def machine_peak(dtype: str, threads: int, log=print, isa: str = "native") -> float | None:
    """GFLOP/s (int8: GOP/s) of a large matmul in `dtype` ("float32", "bfloat16", "int8") on `threads` threads: the
    machine's rate, under an `isa` cap that cap's (None where this torch has no such product on CPU: the report then
    gives no share)."""
    import torch

    from sluice.service.bench.ceiling import matmul_gflop_s

    try:
        rate = matmul_gflop_s(getattr(torch, dtype), threads) if isa == "native" else isa_cap.matmul_peak(
            dtype, threads, isa)
    except (AttributeError, RuntimeError, NotImplementedError) as e:  # torch._int_mm absent or CUDA-only
        log(f"matmul peak, {dtype}: not measured ({type(e).__name__}: {str(e)[:80]})")
        return None
    log(f"matmul peak, {dtype} on {threads} threads: {rate:.0f} {rate_unit(dtype)}")
    return rate


def _plan_of(line: Line) -> dict:
    """What a line measured: its launches and each workload's settings (resume compares it)."""
    ws = scaled_workloads(line.size)
    return {"launches": [{"slots": x.slots, "slot_ctx": x.slot_ctx,
                          "workloads": {w: {k: str(v) for k, v in dataclasses.asdict(ws[w]).items()}
                                        for w in x.workloads}}
                         for x in line.launches]}


def _measure(line: Line, cmds: list[list[str]], log, env: dict[str, str] | None = None) -> dict:
    out: dict = {"plan": _plan_of(line), "commands": [" ".join(c) for c in cmds]}
    ws = scaled_workloads(line.size)
    for i, (launch, cmd) in enumerate(zip(line.launches, cmds, strict=True)):
        try:
            with ServerProcess(cmd, "/ready" if line.sluice else "/health", env=env) as server:
                for name in launch.workloads:
                    out[name] = _workload(server.base, ws[name], log, warmup(ws[name]) if name == "E" else None)
                    out[name]["rss_mib"] = server.rss_mib()  # what the workload left resident
                    if name == "E":
                        out[name].update(prefill_rate(line.size, out[name]))
                out["rss_mib" if i == 0 else f"rss_mib_{''.join(launch.workloads)}"] = server.rss_mib()
                out["peak_rss_mib"] = max(out.get("peak_rss_mib", 0.0), server.peak_rss_mib())  # load included
        except RuntimeError as e:  # a server that would not start: the line says so, the run goes on
            log(f"failed: {e}")
            out["error"] = str(e)[:500]
    if not line.spec and "D" in out and not out["D"]["spec"]:  # nothing drafted: one token per forward
        out["D"]["spec"] = {"source": "speculation off", "tokens_per_forward": 1.0}
    return out


def prefill_rate(size: str, e: dict) -> dict:
    """E's prefill: prompt tokens over TTFT p50, in tokens/s and in GFLOP/s (peer_plan.prefill_flops)."""
    tokens, ttft_s = e.get("prompt_tokens") or 0, (e.get("ttft_p50_ms") or 0) / 1000
    if not (tokens and ttft_s > 0):
        return {}
    return {"prefill_tok_s": tokens / ttft_s, "prefill_gflop_s": prefill_flops(size, round(tokens)) / ttft_s / 1e9}


def _workload(base: str, w, log, warm=None) -> dict:
    """`w` against the server at `base` after one warm-up request: `w`'s first prompt, or the `warm` workload."""
    chat = w.dataset == "repetitive"  # D asks for an edit: through the chat template, as a user would

    def config(workload, warmups: int) -> ServeConfig:
        return ServeConfig(workload=dataclasses.replace(workload), base_url=base, tokenizer="default",
                           progress=False, num_warmups=warmups,
                           endpoint="/v1/chat/completions" if chat else "/v1/completions")

    if warm is not None and (warmed := asyncio.run(run_serve(config(warm, 0)))).failed:
        raise RuntimeError(f"warm-up request failed: {'; '.join(warmed.errors)}")
    r = asyncio.run(run_serve(config(w, 0 if warm is not None else 1)))
    spec = r.spec.get("tokens_per_forward")
    log(f"{w.name}: {r.output_throughput:.1f} tok/s, TPOT p50 {r.tpot_ms.p50:.1f} ms, TTFT p50 {r.ttft_ms.p50:.0f} ms"
        + (f", {spec:.2f} tokens per forward" if spec else "") + f", failed {r.failed}")
    return {"output_tok_s": r.output_throughput, "tpot_p50_ms": r.tpot_ms.p50, "ttft_p50_ms": r.ttft_ms.p50,
            "completed": r.completed, "failed": r.failed, "errors": r.errors, "duration_s": r.duration_s,
            "prompt_tokens": r.input_tokens / r.completed if r.completed else None, "spec": r.spec}


def _write(output: Path, results: dict) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    staged = output.with_name(f".{output.name}.partial")
    staged.write_text(json.dumps(results, indent=2))
    os.replace(staged, output)
    output.with_suffix(".md").write_text(table(results))
