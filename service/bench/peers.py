"""`bench peers` (`make bench-peers`): Sluice beside llama.cpp's server, same machine, same workloads, one table.

llama.cpp is built from the source PyPI ships (the llama-cpp-python sdist vendors the whole tree, its server
included), with the CPU features this machine reports turned on one by one (`GGML_NATIVE=OFF`: a
`-march=native` build once died with SIGILL on a VM whose flags promised AMX, so AMX stays off). The build, the
F32 GGUF made with llama.cpp's own converter, its Q4_K_M made by llama.cpp's `llama-quantize`, and the wheel's Q4_1
GGUF are cached outside the repository.
Servers run one at a time, each measured on workloads A, B and C of the standard benchmark.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from sluice import native
from sluice.machine import cache_root
from sluice.service.bench.serve import ServeConfig, run_serve
from sluice.service.bench.server_process import ServerProcess
from sluice.service.bench.standard import A, B, C
from sluice.service.engine.model_loader import ensure_default_model, fetch_default_gguf

SDIST = "llama-cpp-python"
# (cpuinfo flag, ggml CMake option): turned on only where the CPU reports the flag.
ISA = [("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
       ("avx512f", "GGML_AVX512"), ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
       ("avx512_bf16", "GGML_AVX512_BF16")]


def cpu_flags() -> set[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where there is none)."""
    return set(native.cpu_flags().partition(":")[2].split())


def cmake_isa_options(flags: set[str]) -> list[str]:
    """-D options for a portable build using exactly the features this CPU has."""
    return ["-DGGML_NATIVE=OFF", *(f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in ISA)]


def build_llama_server(cache: Path, log=print) -> Path:
    """The llama-server binary, built once from the PyPI sdist (about 10 minutes on 2 cores)."""
    binary = cache / "llama-server"
    if binary.is_file():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        log(f"downloading the {SDIST} sdist")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(cache)])
        sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    tree = cache / sdists[-1].name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    if not tree.is_dir():
        with tarfile.open(sdists[-1]) as archive:
            archive.extractall(cache, filter="data")
    build = tree / "build"
    log("configuring llama.cpp: " + " ".join(cmake_isa_options(cpu_flags())))
    _run(["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
          "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DGGML_OPENMP=OFF",
          *cmake_isa_options(cpu_flags())])
    log("building llama-server")
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)])
    shutil.copy2(build / "bin" / "llama-server", binary)
    return binary


def llama_tree(cache: Path) -> Path:
    """The vendored llama.cpp source tree of the cached sdist."""
    return next(cache.glob("llama_cpp_python-*/vendor/llama.cpp"))


def f32_gguf(cache: Path, log=print) -> Path:
    """The default model converted to an F32 GGUF by llama.cpp's own converter."""
    target = cache / "SmolLM2-135M-Instruct-F32.gguf"
    if not target.is_file():
        tree = llama_tree(cache)
        log("converting the default model to F32 GGUF")
        # The converter imports sentencepiece before it finds the model's BPE tokenizer.json.
        if subprocess.run([sys.executable, "-c", "import sentencepiece"], capture_output=True).returncode:
            _run([sys.executable, "-m", "pip", "install", "-q", "sentencepiece"])
        env = {**os.environ, "PYTHONPATH": str(tree / "gguf-py"), "NO_LOCAL_GGUF": ""}
        _run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(ensure_default_model()), "--outtype", "f32",
              "--outfile", str(target)], env=env)
    return target


def kquant_gguf(cache: Path, kind: str = "Q4_K_M", log=print) -> Path:
    """The F32 GGUF quantized by llama.cpp's own `llama-quantize` (built beside the server, once)."""
    target = cache / "kquant" / f"SmolLM2-135M-Instruct-{kind}.gguf"
    if target.is_file():
        return target
    quantize = cache / "llama-quantize"
    if not quantize.is_file():
        log("building llama-quantize")
        build = llama_tree(cache) / "build"
        _run(["cmake", "--build", str(build), "--target", "llama-quantize", "-j", str(os.cpu_count() or 2)])
        shutil.copy2(build / "bin" / "llama-quantize", quantize)
    target.parent.mkdir(exist_ok=True)
    staged = target.with_name(f".{target.name}.{os.getpid()}")
    _run([str(quantize), str(f32_gguf(cache, log)), str(staged), kind])
    os.replace(staged, target)  # whole or absent
    return target


def q4_1_gguf(cache: Path) -> Path:
    """The wheel's own GGUF (Q4_1), as llama.cpp serves it."""
    found = [p for p in sorted(cache.glob("*.gguf")) if "F32" not in p.name]
    return found[0] if found else fetch_default_gguf(cache)


def run_peers(output: Path, context: int = 16384, parallel: int = 16, baseline: str = "",
              shapes: tuple[str, ...] = (), log=print) -> dict:
    """Build what is missing, run A/B/C on each server in turn, write JSON and a Markdown table.

    `baseline`: a git ref whose Sluice runs right before this one on every Sluice line ("Sluice@<ref> ...").
    `shapes`: random models ("qwen2-135m", see shapes.py) served by Sluice fp32 and bf16 on workloads A and B.
    """
    cache = cache_root() / "peers"
    server = build_llama_server(cache, log)
    models = {"llama.cpp F32": f32_gguf(cache, log), "llama.cpp Q4_1": q4_1_gguf(cache)}
    results = {"meta": {"cpu_flags": sorted(f for f, _ in ISA if f in cpu_flags()), "context": context,
                        "parallel": parallel, "started": time.strftime("%Y-%m-%d %H:%M:%S")}, "servers": {}}
    threads = str(len(os.sched_getaffinity(0)))
    pythons = {"": sys.executable}
    if baseline:
        from sluice.service.bench.baseline import baseline_python, resolve

        sha = results["meta"]["baseline"] = resolve(baseline)
        pythons = {f"@{sha[:8]}": str(baseline_python(sha, cache, log)), "": sys.executable}
    commands: dict[str, tuple[list[str], tuple]] = {}
    for tag, python in pythons.items():  # the baseline's line right before this commit's, format by format
        for name, cmd in sluice_commands(python, context).items():
            commands[f"Sluice{tag} {name}"] = (cmd, (A, B, C))
    for spec in shapes:
        from sluice.service.bench.shapes import random_checkpoint

        arch, _, size = spec.partition("-")
        model = str(random_checkpoint(arch, size))
        for tag, python in pythons.items():
            for name, cmd in sluice_commands(python, context, model).items():
                if name in ("fp32", "bf16"):
                    commands[f"Sluice{tag} {name} {spec}"] = (cmd, (A, B))
    commands = dict(sorted(commands.items(), key=lambda kv: _pair_key(kv[0])))
    kquant = kquant_gguf(cache, "Q4_K_M", log)  # GGUF blocks as stored, weight format for weight format
    commands["Sluice Q4_K_M"] = ([*sluice_commands(sys.executable, context, str(kquant))["fp32"],
                                  "--quantization", "gguf"], (A, B, C))
    models["llama.cpp Q4_K_M"] = kquant
    for name, gguf in models.items():
        cmd = [str(server), "-m", str(gguf), "-t", threads, "--parallel", str(parallel), "-c", str(context)]
        commands[name] = (cmd, (A, B, C))
    for name, (cmd, workloads) in commands.items():
        log(f"--- {name}")
        results["servers"][name] = _measure(cmd, name.startswith("Sluice"), log, workloads)
    results["ratios"] = ratios(results["servers"])
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2))
    output.with_suffix(".md").write_text(table(results))
    log(f"wrote {output} and {output.with_suffix('.md')}")
    return results


def sluice_commands(python: str, context: int, model: str = "") -> dict[str, list[str]]:
    """`sluice serve` per weight format, with the same KV capacity as llama.cpp's -c tokens (blocks of 16)."""
    base = [python, "-m", "sluice.service.cli", "serve", "--dtype", "float32", "--max-model-len", "2048",
            "--block-size", "16", "--num-kv-blocks", str(context // 16), *(["--model", model] if model else [])]
    commands = {"fp32": base, "int8": [*base, "--quantization", "int8"], "int4": [*base, "--quantization", "int4"]}
    if {"avx512_bf16", "amx_bf16"} & cpu_flags():  # where --dtype auto picks bf16
        commands["bf16"] = ["bfloat16" if a == "float32" else a for a in base]
    return commands


def _pair_key(name: str) -> tuple[str, int]:
    """Sort "Sluice@abc fp32" right before "Sluice fp32"."""
    variant = name.split(" ", 1)[1]
    return (variant, 0 if name.startswith("Sluice@") else 1)


def _measure(cmd: list[str], sluice: bool, log, workloads=(A, B, C)) -> dict:
    with ServerProcess(cmd, "/ready" if sluice else "/health") as server:
        out = {}
        for w in workloads:
            cfg = ServeConfig(workload=dataclasses.replace(w), base_url=server.base, tokenizer="default",
                              progress=False, num_warmups=1)
            r = asyncio.run(run_serve(cfg))
            log(f"{w.name}: {r.output_throughput:.1f} tok/s, TPOT p50 {r.tpot_ms.p50:.1f} ms, "
                f"TTFT p50 {r.ttft_ms.p50:.0f} ms, failed {r.failed}")
            out[w.name] = {"output_tok_s": r.output_throughput, "tpot_p50_ms": r.tpot_ms.p50,
                           "ttft_p50_ms": r.ttft_ms.p50, "completed": r.completed, "failed": r.failed,
                           "errors": r.errors}
        out["rss_mib"] = server.rss_mib()
        return out


def ratios(servers: dict) -> dict:
    """Each Sluice variant over each peer, and over the baseline's same line: A throughput, B TPOT (lower is
    better), C TTFT, memory.

    Keyed by the peer's name for Sluice fp32, "<variant> / <peer>" for the other Sluice variants, and
    "<line> / <baseline line>" against the baseline.
    """
    out = {}
    ours = {n: s for n, s in servers.items() if n.startswith("Sluice ")}
    peers = {n: s for n, s in servers.items() if not n.startswith("Sluice")}
    for ours_name, line in ours.items():
        base_name = next((n for n in servers if n.startswith("Sluice@") and n.split(" ", 1)[1] ==
                          ours_name.split(" ", 1)[1]), None)
        if base_name:
            out[f"{ours_name} / {base_name}"] = _ratio(line, servers[base_name])
        if "C" not in line:  # a model-shape line: no peer serves that model
            continue
        for name, peer in peers.items():
            out[name if ours_name == "Sluice fp32" else f"{ours_name} / {name}"] = _ratio(line, peer)
    return out


def _ratio(ours: dict, other: dict) -> dict:
    keys = {"A": ("A_throughput_sluice_over_peer", "output_tok_s"), "B": ("B_tpot_sluice_over_peer", "tpot_p50_ms"),
            "C": ("C_ttft_sluice_over_peer", "ttft_p50_ms")}
    out = {key: ours[w][field] / other[w][field] for w, (key, field) in keys.items() if w in ours and w in other}
    out["rss_sluice_over_peer"] = ours["rss_mib"] / other["rss_mib"]
    return out


def table(results: dict) -> str:
    """The Markdown report."""
    def cell(s: dict, w: str, field: str, fmt: str) -> str:
        return format(s[w][field], fmt) if w in s else "-"

    lines = ["# Sluice beside llama.cpp (same machine, one server at a time, same KV capacity)", "",
             f"CPU features used by the llama.cpp build: {', '.join(results['meta']['cpu_flags'])}."]
    if results["meta"].get("baseline"):
        lines.append(f"Baseline: Sluice@{results['meta']['baseline'][:8]}, run right before each of this commit's lines.")
    lines += ["", "| server | A output tok/s | B TPOT p50 ms | C tok/s | C TTFT p50 ms | RSS MiB | failed |",
              "|---|---|---|---|---|---|---|"]
    for name, s in results["servers"].items():
        failed = "/".join(str(s[w].get("failed", 0)) for w in ("A", "B", "C") if w in s)
        lines.append(f"| {name} | {cell(s, 'A', 'output_tok_s', '.1f')} | {cell(s, 'B', 'tpot_p50_ms', '.1f')} | "
                     f"{cell(s, 'C', 'output_tok_s', '.1f')} | {cell(s, 'C', 'ttft_p50_ms', '.0f')} | "
                     f"{s['rss_mib']:.0f} | {failed} |")
    lines += ["", "| Sluice line / other | A tok/s | B TPOT | C TTFT | RSS |", "|---|---|---|---|---|"]
    for name, r in results["ratios"].items():
        cells = [format(r[k], ".2f") if k in r else "-" for k in
                 ("A_throughput_sluice_over_peer", "B_tpot_sluice_over_peer", "C_ttft_sluice_over_peer")]
        lines.append(f"| {name} | {' | '.join(cells)} | {r['rss_sluice_over_peer']:.2f} |")
    return "\n".join(lines) + "\n"


def _run(cmd: list[str], env: dict | None = None) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed:\n{result.stdout[-1500:]}\n{result.stderr[-3000:]}")
