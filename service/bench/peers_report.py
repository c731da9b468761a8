"""`bench peers` results as ratios and Markdown: weight format for weight format per size, A against llama.cpp's
best, workload D with speculation on and off, and E's prefill against the machine's matmul rate."""

from __future__ import annotations

from sluice.service.bench.peer_plan import PAIRS

FIELDS = {"A": ("A", "output_tok_s"), "B": ("B", "tpot_p50_ms"), "C": ("C", "ttft_p50_ms"), "E": ("E", "ttft_p50_ms")}
# The matmul rate each format's prefill is set against: bf16 formats multiply in bf16; the quantized ones (both
# servers) in int8 dot products, on activations rounded to int8 (Sluice's packed kernels, llama.cpp's q8 rows);
# the rest in fp32 (Sluice's f16 and llama.cpp's F16 widen 16-bit weights on a CPU without fp16 arithmetic).
PEAK_DTYPES = {"bf16": "bfloat16", "BF16": "bfloat16", "int4": "int8", "Q4_1": "int8", "Q4_K": "int8",
               "Q4_K_M": "int8", "Q4_0": "int8", "Q5_K": "int8", "Q5_K_M": "int8", "IQ4_XS": "int8",
               "Q3_K": "int8", "Q3_K_M": "int8", "Q2_K": "int8"}
WORKLOADS = "ABCDE"


def _get(line: dict | None, workload: str, field: str) -> float | None:
    value = ((line or {}).get(workload) or {}).get(field)
    return value if isinstance(value, (int, float)) and value > 0 else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(servers: dict, sizes: list[str]) -> dict:
    """Sluice over llama.cpp per size: each weight-format pair (A tok/s, B TPOT, C and E TTFT, RSS after A-D and
    after E), every Sluice line's A over llama.cpp's best A, each line over its baseline, and D's speculation
    figures."""
    out: dict = {}
    for size in sizes:
        for ours, theirs in PAIRS:
            a, b = servers.get(f"{size} Sluice {ours}"), servers.get(f"{size} llama.cpp {theirs}")
            if a and b:
                r = {w: _div(_get(a, *FIELDS[w]), _get(b, *FIELDS[w])) for w in FIELDS}
                r["rss"] = _div(a.get("rss_mib"), b.get("rss_mib"))
                r["rss_E"] = _div(_get(a, "E", "rss_mib"), _get(b, "E", "rss_mib"))
                out[f"{size} {ours} / {theirs}"] = r
        peers_a = {n: _get(s, "A", "output_tok_s") for n, s in servers.items()
                   if n.startswith(f"{size} llama.cpp ") and _get(s, "A", "output_tok_s")}
        if peers_a:
            best = max(peers_a, key=peers_a.get)
            for name, s in servers.items():
                if name.startswith(f"{size} Sluice ") and _get(s, "A", "output_tok_s"):
                    out[f"{name} A / best llama.cpp"] = {"A": _get(s, "A", "output_tok_s") / peers_a[best],
                                                         "best": best.removeprefix(f"{size} ")}
        for name, s in servers.items():
            if name.startswith(f"{size} Sluice@"):
                ours = servers.get(f"{size} Sluice {name.split(' ', 2)[2]}")
                if ours:
                    r = {w: _div(_get(ours, *FIELDS[w]), _get(s, *FIELDS[w])) for w in FIELDS}
                    r["rss"] = _div(ours.get("rss_mib"), s.get("rss_mib"))
                    out[f"{size} Sluice {name.split(' ', 2)[2]} / {name.removeprefix(size + ' ')}"] = r
        d = d_ratios(servers, size)
        if d:
            out[f"{size} D"] = d
    return out


def d_ratios(servers: dict, size: str) -> dict:
    """Workload D at `size`: Sluice's speculation against its own decoding and against llama.cpp's n-gram."""
    spec = {n: s for n, s in servers.items() if n.startswith(f"{size} ") and n.endswith(("ngram", "ngram k4"))}
    ours_on = next((s for n, s in spec.items() if " Sluice " in n), None)
    if ours_on is None or "D" not in ours_on:
        return {}
    fmt = next(n for n, s in spec.items() if s is ours_on).split(" ")[2]
    ours_off = servers.get(f"{size} Sluice {fmt}")
    theirs_on = [s for n, s in spec.items() if " llama.cpp " in n and _get(s, "D", "tpot_p50_ms")]
    best_on = min((_get(s, "D", "tpot_p50_ms") for s in theirs_on), default=None)
    on_tpf = (ours_on["D"].get("spec") or {}).get("tokens_per_forward")
    return {"D_tpot_off_over_on": _div(_get(ours_off, "D", "tpot_p50_ms"), _get(ours_on, "D", "tpot_p50_ms")),
            "D_tokens_per_forward": on_tpf,
            "D_tpot_on_over_llama_best_on": _div(_get(ours_on, "D", "tpot_p50_ms"), best_on),
            "B_tpot_on_over_off": _div(_get(ours_on, "B", "tpot_p50_ms"), _get(ours_off, "B", "tpot_p50_ms"))}


def _c(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(results: dict) -> str:
    """The Markdown report: per size the pairs table, A against the best peer, D; then every line's figures."""
    meta, servers, r = results["meta"], results["servers"], results["ratios"]
    out = ["# Sluice beside llama.cpp (same machine, one server at a time, same KV capacity)", "",
           f"CPU features used by the llama.cpp build: {', '.join(meta.get('cpu_flags', []))}. "
           f"{meta.get('threads', '?')} threads. Started {meta.get('started', '?')}.",
           "Ratios are Sluice / llama.cpp: above 1 is better for A (tok/s), below 1 for B (TPOT), C and E (TTFT) "
           "and RSS. RSS: what the server holds, its resident set and its child processes' private memory, after its "
           "last workload of A-D; E's after E, on a server of its own (one slot of 4,096 tokens). Peak: the server "
           "process's largest resident set, its load included."]
    if meta.get("isa_cap"):
        out.append(f"**{meta['isa_cap'][0].upper()}{meta['isa_cap'][1:]}.**")
    if meta.get("float_pair"):
        out.append(f"Float pair: {meta['float_pair']}" + (f"; formats run: {', '.join(meta['formats'])}."
                                                          if meta.get("formats") else "."))
    if meta.get("rounds", 1) > 1:
        out.append(f"Each figure is the median of {meta['rounds']} rounds: every server line ran once a round, the "
                   "order reversed each round.")
    for size in meta.get("sizes", []):
        out += ["", f"## {size} ({meta.get('models', {}).get(size, '')})", "",
                "| weights (Sluice / llama.cpp) | A tok/s | A ratio | B TPOT p50 ms | B ratio | C TTFT p50 ms | "
                "C ratio | E TTFT p50 ms | E ratio | RSS MiB | RSS ratio | RSS after E MiB | ratio |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for ours, theirs in PAIRS:
            a, b = servers.get(f"{size} Sluice {ours}"), servers.get(f"{size} llama.cpp {theirs}")
            if not (a or b):
                continue
            pr = r.get(f"{size} {ours} / {theirs}", {})

            def pair(w: str, fmt: str, a=a, b=b) -> str:
                return f"{_c(_get(a, *FIELDS[w]), fmt)} / {_c(_get(b, *FIELDS[w]), fmt)}"

            rss = f"{_c((a or {}).get('rss_mib'), '.0f')} / {_c((b or {}).get('rss_mib'), '.0f')}"
            rss_e = f"{_c(_get(a, 'E', 'rss_mib'), '.0f')} / {_c(_get(b, 'E', 'rss_mib'), '.0f')}"
            out.append(f"| {ours} / {theirs} | {pair('A', '.1f')} | {_c(pr.get('A'), '.2f')} | {pair('B', '.1f')} | "
                       f"{_c(pr.get('B'), '.2f')} | {pair('C', '.0f')} | {_c(pr.get('C'), '.2f')} | "
                       f"{pair('E', '.0f')} | {_c(pr.get('E'), '.2f')} | {rss} | {_c(pr.get('rss'), '.2f')} | "
                       f"{rss_e} | {_c(pr.get('rss_E'), '.2f')} |")
        best = [(n.split(" ")[2], v) for n, v in r.items()
                if n.startswith(f"{size} Sluice ") and n.endswith("best llama.cpp")]
        if best:
            out += ["", f"A against llama.cpp's best ({best[0][1]['best']}): "
                    + ", ".join(f"{fmt} {v['A']:.2f}×" for fmt, v in best) + "."]
        out += _d_section(servers, r.get(f"{size} D"), size)
        out += _e_section(servers, meta, size)
    out += ["", "## Every line", "", "| server | A tok/s | B TPOT p50 ms | C tok/s | C TTFT p50 ms | D TPOT p50 ms | "
            "D tokens/forward | E TTFT p50 ms | RSS MiB | RSS MiB after each workload | peak RSS MiB | failed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in servers.items():
        if "skipped" in s:
            out.append(f"| {name} | skipped: {s['skipped']} |" + " |" * 10)
            continue
        failed = "/".join(str(s[w].get("failed", 0)) for w in WORKLOADS if w in s)
        tpf = ((s.get("D") or {}).get("spec") or {}).get("tokens_per_forward")
        after = ", ".join(f"{w} {_get(s, w, 'rss_mib'):.0f}" for w in WORKLOADS if _get(s, w, "rss_mib")) or "-"
        out.append(f"| {name} | {_c(_get(s, 'A', 'output_tok_s'), '.1f')} | {_c(_get(s, 'B', 'tpot_p50_ms'), '.1f')} | "
                   f"{_c(_get(s, 'C', 'output_tok_s'), '.1f')} | {_c(_get(s, 'C', 'ttft_p50_ms'), '.0f')} | "
                   f"{_c(_get(s, 'D', 'tpot_p50_ms'), '.1f')} | {_c(tpf, '.2f')} | "
                   f"{_c(_get(s, 'E', 'ttft_p50_ms'), '.0f')} | {_c(s.get('rss_mib'), '.0f')} | {after} | "
                   f"{_c(s.get('peak_rss_mib'), '.0f')} | {failed} |")
    return "\n".join(out) + "\n"


def rate_unit(dtype: str) -> str:
    """The unit of a matmul rate in `dtype`: integer products are operations, not floating-point ones."""
    return "GOP/s" if dtype == "int8" else "GFLOP/s"


def _e_section(servers: dict, meta: dict, size: str) -> list[str]:
    """E's prefill per line: prompt tokens / TTFT p50, and its FLOP rate as a share of the format's matmul peak."""
    lines = [(n, s) for n, s in servers.items() if n.startswith(f"{size} ") and _get(s, "E", "ttft_p50_ms")]
    if not lines:
        return []
    peaks = meta.get("peak_gflop_s") or {}
    measured = ", ".join(f"{dtype} {rate:.0f} {rate_unit(dtype)}" for dtype, rate in sorted(peaks.items())) \
        or "not measured"
    out = ["", f"Workload E (one prompt of about 2,000 tokens at a time, 16 output tokens): prefill rate = prompt "
           f"tokens / TTFT p50, FLOPs = 2 x weights x tokens + causal attention, against the machine's matmul rate "
           f"(2048^3 products on {meta.get('threads', '?')} threads, torch.mm and for int8 torch._int_mm: "
           f"{measured}; bf16 formats against bf16's, the quantized ones against int8's: both servers prefill them "
           "on activations rounded to int8; the rest against fp32's):", "",
           "| server | E TTFT p50 ms | prompt tokens | prefill tok/s | GFLOP/s | share of peak |",
           "|---|---|---|---|---|---|"]
    for name, s in lines:
        e = s["E"]
        fmt = name.removeprefix(f"{size} ").split(" ")[1]
        peak = peaks.get(PEAK_DTYPES.get(fmt, "float32"))
        share = _div(e.get("prefill_gflop_s"), peak)
        out.append(f"| {name.removeprefix(size + ' ')} | {_c(_get(s, 'E', 'ttft_p50_ms'), '.0f')} | "
                   f"{_c(e.get('prompt_tokens'), '.0f')} | {_c(e.get('prefill_tok_s'), '.0f')} | "
                   f"{_c(e.get('prefill_gflop_s'), '.1f')} | {'-' if share is None else format(share, '.0%')} |")
    return out


def _d_section(servers: dict, d: dict | None, size: str) -> list[str]:
    lines = [(n, s) for n, s in servers.items() if n.startswith(f"{size} ") and "D" in s]
    if not lines:
        return []
    out = ["", "Workload D (return a passage with small edits, 1 at a time), n-gram speculation off and on:", "",
           "| server | D TPOT p50 ms | decode tokens per forward | acceptance | B TPOT p50 ms |",
           "|---|---|---|---|---|"]
    for name, s in lines:
        spec = s["D"].get("spec") or {}
        rate = spec.get("acceptance_rate")
        out.append(f"| {name.removeprefix(size + ' ')} | {_c(_get(s, 'D', 'tpot_p50_ms'), '.1f')} | "
                   f"{_c(spec.get('tokens_per_forward'), '.2f')} | {'-' if rate is None else format(rate, '.0%')} | "
                   f"{_c(_get(s, 'B', 'tpot_p50_ms'), '.1f')} |")
    if d:
        out += ["", f"Sluice's speculation: D TPOT {_c(d['D_tpot_off_over_on'], '.2f')}× lower than without, "
                f"{_c(d['D_tokens_per_forward'], '.2f')} tokens per forward, "
                f"TPOT {_c(d['D_tpot_on_over_llama_best_on'], '.2f')}× llama.cpp's best n-gram; "
                f"B with it on costs {_c(d['B_tpot_on_over_off'], '.2f')}× its TPOT off."]
    return out
