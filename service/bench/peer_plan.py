"""What `bench peers` runs: servers per size and weight format, workloads scaled per size, and how long it takes.

Weight formats pair up, Sluice's against llama.cpp's: fp32/F32, f16/F16, bf16/BF16, int4/Q4_1 and Sluice's
GGUF blocks as stored (`--quantization gguf`: "Q4_K", "Q4_0", and when named "Q5_K", "IQ4_XS", "Q3_K", "Q2_K") on the
very Q4_K_M, Q4_0, Q5_K_M, IQ4_XS, Q3_K_M and Q2_K files llama.cpp serves.
Unless the formats are named, the float pair follows the CPU, as Sluice's `--dtype auto` does: bf16/BF16 where it
multiplies bf16 natively, else fp32/F32 and f16/F16 (16-bit weights, the arithmetic widened: Sluice's `--quantization
f16` in float32, llama.cpp's F16 file). Both keep K/V
in 16 bits (llama.cpp's default f16 cache; Sluice's `--kv-cache-dtype float16` where it computes in float32) and get
the same KV capacity: llama.cpp at its best runs A and B with 64 slots (no unified KV: with it, every slot scans the
whole cache) and C with 16 longer slots, a server each; Sluice runs them on one server holding as many KV
tokens as the larger of the two. Workload D (repetitive) runs with and without n-gram speculation on both.
Workload E (one long prompt at a time, its TTFT) runs on one more server each, one slot of 4,096 tokens.

Every workload keeps its shape at every size (A: a burst of 64; B: one at a time; C: 16 at a time, prompts
several times A's; E: prompts of 2,000 tokens, fewer of them) but shrinks its counts as the model grows, so that
a whole run on 2 cores with the CPU's float pair stays under an hour (every pair: about 65 minutes): a 1.7B model
in fp32 streams 6.8 GB per decode step and takes about 40 s to prefill E's prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sluice.cpu import native_bf16_flags
from sluice.service.bench.shapes import ARCHS, SIZES, Shape
from sluice.service.bench.workloads import Workload

# (Sluice, llama.cpp) weight formats, compared line for line (f16: Sluice's `--quantization f16`, 16-bit weights).
PAIRS = (("fp32", "F32"), ("f16", "F16"), ("bf16", "BF16"), ("int4", "Q4_1"), ("Q4_K", "Q4_K_M"), ("Q4_0", "Q4_0"),
         ("Q5_K", "Q5_K_M"), ("IQ4_XS", "IQ4_XS"), ("Q3_K", "Q3_K_M"), ("Q2_K", "Q2_K"))
# Pairs a run compares only where --formats names them: more GGUF files people download, each another 10 minutes.
NAMED_ONLY = (("Q5_K", "Q5_K_M"), ("IQ4_XS", "IQ4_XS"), ("Q3_K", "Q3_K_M"), ("Q2_K", "Q2_K"))
# The float pairs a run compares unless --formats names them: by whether the CPU multiplies bf16 natively.
FLOAT_PAIRS = {True: (("bf16", "BF16"),), False: (("fp32", "F32"), ("f16", "F16"))}
# Sluice's formats served from llama.cpp's own file of that pair (`--quantization gguf`): the GGUF type it needs.
GGUF_SERVED = {"Q4_K": "Q4_K_M", "Q4_0": "Q4_0", "Q5_K": "Q5_K_M", "IQ4_XS": "IQ4_XS", "Q3_K": "Q3_K_M",
               "Q2_K": "Q2_K"}
ALIASES = {"gguf": "Q4_K", "q4k": "Q4_K"}
AB_SLOTS, C_SLOTS = 64, 16
D_SLOT_CTX = 1024  # D's prompts (500-620 tokens) and its 256 output tokens
WORKLOADS = ("A", "B", "C", "D", "E")
E_SLOT_CTX = 4096  # E: llama.cpp's one slot, as the issue sets it (a prompt of 2,000 tokens and 16 more)
SPEC_SLUICE = ("--speculative-method", "ngram", "--num-speculative-tokens", "4")
# llama.cpp's ngram-simple drafts its whole m-gram: once with Sluice's 4 tokens, once with its own defaults.
SPEC_LLAMA = {"ngram k4": ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                           "--spec-ngram-simple-size-m", "4"),
              "ngram": ("--spec-type", "ngram-simple")}


@dataclass(frozen=True, slots=True)
class Scale:
    """One size's workload counts: (requests, prompt tokens, output tokens) for A, B, C, D and E, and llama.cpp's
    tokens per slot for A/B and for C (powers of two that hold the longest request)."""

    a: tuple[int, int, int]
    b: tuple[int, int, int]
    c: tuple[int, int, int]
    d: tuple[int, int] = (4, 256)  # requests, output tokens (the prompts are D's passages)
    e: tuple[int, int, int] = (3, 2000, 16)  # one at a time; Sluice's --max-model-len 2048 holds 2,016 and drift
    ab_ctx: int = 512
    c_ctx: int = 1024


SCALES = {
    "135m": Scale(a=(64, 64, 64), b=(6, 64, 96), c=(32, 256, 32)),
    "360m": Scale(a=(64, 48, 32), b=(4, 48, 64), c=(16, 192, 16), d=(2, 256), e=(2, 2000, 16), ab_ctx=128,
                  c_ctx=256),
    "1.7b": Scale(a=(64, 16, 16), b=(3, 32, 32), c=(16, 96, 8), d=(2, 128), e=(1, 2000, 16), ab_ctx=128, c_ctx=128),
}


def workloads(size: str, spec: bool = False) -> dict[str, Workload]:
    """A, B, C, D and E at `size`'s scale (seeds as the standard workloads')."""
    s = SCALES[size]
    return {"A": Workload("A", *s.a, seed=0), "B": Workload("B", *s.b, max_concurrency=1, seed=1),
            "C": Workload("C", *s.c, max_concurrency=C_SLOTS, seed=2),
            "D": Workload("D", s.d[0], 1, s.d[1], max_concurrency=1, seed=4, dataset="repetitive"),
            "E": Workload("E", *s.e, max_concurrency=1, seed=5)}


def warmup(w: Workload) -> Workload:
    """E's warm-up: a short prompt of its own seed (a warm-up on E's first prompt would hand that prompt to the
    prefix cache of both servers, and E's few TTFTs would lose one to it)."""
    return Workload(f"{w.name} warm-up", 1, 64, 2, seed=w.seed + 100)


def float_pairs(flags: list[str] | None = None) -> tuple[tuple[tuple[str, str], ...], str]:
    """The float pairs this CPU compares and why, by its bf16 matmul flags (None: this machine's)."""
    flags = native_bf16_flags() if flags is None else flags
    if flags:
        return FLOAT_PAIRS[True], f"bf16 / BF16: this CPU multiplies bf16 natively ({', '.join(flags)})"
    return FLOAT_PAIRS[False], ("fp32 / F32 and f16 / F16: this CPU has no native bf16 matmul (neither amx_bf16 "
                                "nor avx512_bf16), so bf16 would be emulated; 16-bit weights widened to float32 "
                                "halve the bytes a decode step reads")


@dataclass(frozen=True, slots=True)
class Launch:
    """One server start: its KV layout (slots x tokens per slot) and the workloads run on it."""

    slots: int
    slot_ctx: int
    workloads: tuple[str, ...]

    @property
    def kv_tokens(self) -> int:
        """KV capacity in tokens."""
        return self.slots * self.slot_ctx


@dataclass(frozen=True, slots=True)
class Line:
    """One row of the results: a server (engine, weight format, speculation) at one size."""

    size: str
    engine: str  # "Sluice", "Sluice@<sha8>" or "llama.cpp"
    fmt: str
    spec: str = ""  # "" or the speculation's label
    launches: tuple[Launch, ...] = ()
    arch: str = "llama"  # another layer layout (shapes.py's ARCHS) of the same size, Sluice only

    @property
    def name(self) -> str:
        """"<size> <engine> <format>[ <arch>][ <speculation>]", the results' key."""
        arch = "" if self.arch == "llama" else self.arch
        return " ".join(p for p in (self.size, self.engine, self.fmt, arch, self.spec) if p)

    @property
    def sluice(self) -> bool:
        """A Sluice server (this commit's or a baseline's)."""
        return self.engine.startswith("Sluice")


def default_pairs(flags: list[str] | None = None) -> tuple[tuple[str, str], ...]:
    """Every pair but the float ones this CPU does not pick (float_pairs) and the NAMED_ONLY ones, in PAIRS' order."""
    floats = {p for pairs in FLOAT_PAIRS.values() for p in pairs}
    chosen = set(float_pairs(flags)[0])
    return tuple(p for p in PAIRS if (p not in floats or p in chosen) and p not in NAMED_ONLY)


def parse_formats(text: str, flags: list[str] | None = None) -> tuple[tuple[str, str], ...]:
    """The pairs a comma list names (either side's name, any case; "gguf" for Q4_K; Sluice's name picks its first
    pair); for "", default_pairs(flags)."""
    if not text.strip():
        return default_pairs(flags)
    names = {ALIASES.get(t.strip().lower(), t.strip().lower()).lower() for t in text.split(",") if t.strip()}
    first: dict[str, tuple[str, str]] = {}
    for pair in PAIRS:
        first.setdefault(pair[0].lower(), pair)
    chosen = tuple(p for p in PAIRS if p[1].lower() in names or (p[0].lower() in names and first[p[0].lower()] == p))
    known = {n.lower() for p in PAIRS for n in p}
    unknown = {n for n in names if n.lower() not in known}
    if unknown or not chosen:
        raise ValueError(f"unknown weight formats {sorted(unknown)}; choose from "
                         f"{', '.join('/'.join(p) for p in PAIRS)} (or gguf)")
    return chosen


def parse_sizes(text: str) -> tuple[str, ...]:
    """Sizes from a comma list, in SIZES' order; all for ""."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()] or list(SIZES)
    unknown = [n for n in names if n not in SIZES or n not in SCALES]
    if unknown:
        raise ValueError(f"unknown sizes {unknown}; choose from {', '.join(SCALES)}")
    return tuple(s for s in SCALES if s in names)


def parse_workloads(text: str) -> tuple[str, ...]:
    """Workload names from a comma list ("E", "a,b"), in WORKLOADS' order; all for ""."""
    names = {t.strip().upper() for t in text.split(",") if t.strip()} or set(WORKLOADS)
    unknown = sorted(names - set(WORKLOADS))
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    return tuple(w for w in WORKLOADS if w in names)


def only(lines: list[Line], workloads: tuple[str, ...]) -> list[Line]:
    """The lines with just `workloads` left on their servers; a server, and a line, left with none goes."""
    out = []
    for line in lines:
        launches = tuple(replace(launch, workloads=kept) for launch in line.launches
                         if (kept := tuple(w for w in launch.workloads if w in workloads)))
        if launches:
            out.append(replace(line, launches=launches))
    return out


def plan(sizes: tuple[str, ...], pairs=PAIRS, d_sizes: tuple[str, ...] = ("135m",), bf16: bool = True,
         baseline: str = "", shapes: tuple[str, ...] = (), workloads: tuple[str, ...] = ()) -> list[Line]:
    """Every server line of a run, in order: per size, Sluice then llama.cpp format by format (a Sluice format
    paired twice runs once), then D's speculation lines, then Sluice alone on A and B in fp32 and bf16 for each of
    `shapes` ("qwen2-135m": another layer layout, random weights). `bf16`: whether Sluice's bf16 runs here (it
    needs avx512_bf16 or AMX). Every server of a pair runs E on a server of its own with one slot of E_SLOT_CTX.
    `workloads`: run only these (all where empty)."""
    out: list[Line] = []
    for spec in shapes:
        arch, _, size = spec.partition("-")
        if size not in SCALES or arch not in ARCHS:
            raise ValueError(f"unknown shape {spec!r}: <{'|'.join(ARCHS)}>-<{'|'.join(SCALES)}>")
    for size in sizes:
        s = SCALES[size]
        with_d = size in d_sizes
        c_ctx = max(s.c_ctx, D_SLOT_CTX) if with_d else s.c_ctx
        ab, c = Launch(AB_SLOTS, s.ab_ctx, ("A", "B")), Launch(C_SLOTS, c_ctx, ("C", "D") if with_d else ("C",))
        kv = max(ab.kv_tokens, c.kv_tokens)
        every = Launch(1, kv, ("A", "B", "C", "D") if with_d else ("A", "B", "C"))  # one Sluice server
        e = Launch(1, E_SLOT_CTX, ("E",))  # alone, so that its RSS compares like with like
        ours_done = set()
        for ours, theirs in pairs:
            if (ours != "bf16" or bf16) and ours not in ours_done:  # llama.cpp's BF16 runs anyway: often its best A
                ours_done.add(ours)
                engines = ([f"Sluice@{baseline[:8]}"] if baseline else []) + ["Sluice"]
                out += [Line(size, engine, ours, launches=(every, e)) for engine in engines]
            out.append(Line(size, "llama.cpp", theirs, launches=(ab, c, e)))
        if with_d:
            ours, theirs = next(p for p in pairs if p[0] == "bf16") if bf16 and ("bf16", "BF16") in pairs else pairs[0]
            spec = Launch(1, c.kv_tokens, ("B", "D"))
            out.append(Line(size, "Sluice", ours, "ngram", (spec,)))
            out += [Line(size, "llama.cpp", theirs, label, (Launch(C_SLOTS, c_ctx, ("B", "D")),))
                    for label in SPEC_LLAMA]
    for spec in shapes:
        arch, _, size = spec.partition("-")
        for fmt in ("fp32", "bf16") if bf16 else ("fp32",):
            engines = ([f"Sluice@{baseline[:8]}"] if baseline else []) + ["Sluice"]
            launch = Launch(1, AB_SLOTS * SCALES[size].ab_ctx, ("A", "B"))
            out += [Line(size, engine, fmt, launches=(launch,), arch=arch) for engine in engines]
    return only(out, workloads) if workloads else out


def params(shape: Shape, vocab: int = 49152) -> float:
    """Parameters in billions (tied embeddings counted once)."""
    return (shape.layers * _layer_params(shape) + vocab * shape.hidden) / 1e9


def _layer_params(shape: Shape) -> int:
    kv = shape.hidden * shape.kv_heads // shape.heads
    return 2 * shape.hidden * shape.hidden + 2 * shape.hidden * kv + 3 * shape.hidden * shape.intermediate


def prefill_flops(size: str, tokens: int, vocab: int = 49152) -> float:
    """Floating-point operations of one prompt's prefill: 2 per weight and token through the layers, causal
    attention (QK^T and AV over half the square), and the head for the last token only (as both servers do)."""
    s = SIZES[size]
    attention = 2 * s.layers * s.hidden * tokens * tokens  # 2 products x 2 FLOPs x tokens^2 / 2 x hidden
    return 2.0 * s.layers * _layer_params(s) * tokens + attention + 2.0 * vocab * s.hidden


# Rough speed on 2 Zen 4 cores, a + b * billions of parameters, fitted to issue 25's runs at 135M and 360M:
# (ms per token of a batch, prefill or batched decode; ms per decode step at batch 1), Sluice's and llama.cpp's
# formats apart (both name a Q4_0). Only for the estimate.
SLUICE_SPEED = {"fp32": ((0.5, 11.0), (5.5, 115.0)), "f16": ((0.6, 13.0), (4.0, 60.0)),  # f16: a guess
                "bf16": ((0.6, 5.6), (4.5, 58.0)),
                "int4": ((0.85, 5.0), (4.7, 26.0)), "Q4_K": ((1.0, 6.0), (5.0, 30.0)),
                "Q4_0": ((0.85, 4.7), (4.7, 24.0)), "Q5_K": ((1.0, 7.0), (5.0, 34.0)),  # Q5_K, IQ4_XS, Q3_K: guesses
                "IQ4_XS": ((1.0, 6.0), (5.0, 30.0)), "Q3_K": ((1.0, 6.0), (5.0, 28.0)),
                "Q2_K": ((1.0, 6.0), (5.0, 26.0))}
LLAMA_SPEED = {"F32": ((0.9, 11.1), (2.0, 115.0)), "F16": ((0.9, 12.0), (2.0, 60.0)),  # F16: a guess
               "BF16": ((0.5, 8.9), (2.0, 58.0)),
               "Q4_1": ((0.7, 21.8), (5.0, 32.0)), "Q4_K_M": ((0.8, 24.0), (5.0, 32.0)),
               "Q4_0": ((0.5, 9.0), (5.0, 30.0)), "Q5_K_M": ((0.8, 26.0), (5.0, 36.0)),  # guesses
               "IQ4_XS": ((0.8, 24.0), (5.0, 32.0)), "Q3_K_M": ((0.8, 24.0), (5.0, 30.0)),
               "Q2_K": ((0.8, 24.0), (5.0, 28.0))}
D_PROMPT = 560  # D's prompts, tokens


def startup_s(line: Line) -> float:
    """Seconds one server of `line` takes to start (Sluice loads, converts or quantizes its weights)."""
    p = params(SIZES[line.size])
    return (6 + 12 * p) if line.sluice else (2 + 3 * p)


def workload_s(line: Line, name: str) -> float:
    """Seconds workload `name` takes on `line`'s server, its warm-up request included."""
    p = params(SIZES[line.size])
    (ba, bb), (da, db) = (SLUICE_SPEED if line.sluice else LLAMA_SPEED)[line.fmt]
    batch_ms, step_ms = ba + bb * p, da + db * p
    w = workloads(line.size)[name]
    if name == "E":  # a short warm-up of its own, then one long prompt at a time: attention's share grows with it
        s, warm = SIZES[line.size], warmup(w)
        longer = prefill_flops(line.size, w.input_len) / (2 * s.layers * _layer_params(s) * w.input_len)
        return (warm.input_len * batch_ms + warm.output_len * step_ms
                + w.num_prompts * (w.input_len * batch_ms * longer + w.output_len * step_ms)) / 1000
    prompt = D_PROMPT if name == "D" else w.input_len
    warm = (prompt * batch_ms + 4 * step_ms) / 1000
    if name in ("A", "C"):
        return warm + w.num_prompts * (prompt + w.output_len) * batch_ms / 1000
    # one at a time; speculation's gain is not counted (the estimate stays on the long side)
    return warm + w.num_prompts * (prompt * batch_ms + w.output_len * step_ms) / 1000


def estimate_s(line: Line) -> float:
    """Seconds `line` takes: its server starts and workloads."""
    return sum(startup_s(line) + sum(workload_s(line, w) for w in x.workloads) for x in line.launches)


def estimate_lines(lines: list[Line]) -> list[str]:
    """The run's expected duration, per size and in all, as printed before it starts."""
    by_size: dict[str, float] = {}
    for line in lines:
        by_size[line.size] = by_size.get(line.size, 0.0) + estimate_s(line)
    total = sum(by_size.values())
    parts = ", ".join(f"{size} {s / 60:.1f}" for size, s in by_size.items())
    return [f"{len(lines)} server lines; expected duration about {total / 60:.0f} min on 2 cores ({parts} min), "
            "model preparation aside"]
