"""The `sluice bench` subcommands: flags, and the functions that run them."""


from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path


def add_bench_subcommands(subparsers) -> argparse.ArgumentParser:
    """Add `bench` (with serve / offline / scheduler) to the `sluice` subparsers; returns the bench parser."""
    bench = subparsers.add_parser("bench", help="Benchmark a server or the engine.", description=(
        "Throughput and latency benchmarks: `serve` loads any OpenAI-compatible server over HTTP, `offline` runs "
        "the engine in-process next to transformers' generate / generate_batch and the raw forward."))
    commands = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])

    serve = commands.add_parser("serve", help="Load-test an OpenAI-compatible server (Sluice, vLLM, llama.cpp).")
    _add_workload_flags(serve)
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="Server root URL (default: %(default)s).")
    serve.add_argument("--endpoint", default="/v1/completions",
                       help="/v1/completions or /v1/chat/completions (default: %(default)s).")
    serve.add_argument("--model", default="", help="Model name to send (default: the first of GET /v1/models).")
    serve.add_argument("--tokenizer", default="",
                       help="HF tokenizer dir/id ('default': Sluice's embedded model) for token-exact random prompts; "
                            "without one, prompts are random words.")
    serve.add_argument("--api-key", default="", help="Bearer token, if the server wants one.")
    serve.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                       help="Let requests stop at EOS (default: ignore_eos=true, so outputs have the set length).")
    serve.add_argument("--extra-body", default="{}", help="JSON merged into every request body.")
    serve.add_argument("--num-warmups", type=int, default=0, help="Untimed requests sent first (default: 0).")
    serve.add_argument("--timeout", type=float, default=3600.0, help="Per-request timeout in seconds.")
    serve.add_argument("--result-file", default="", help="Write the figures as JSON here.")
    serve.add_argument("--no-progress", dest="progress", action="store_false", help="No progress bar.")
    _add_mixed_flags(serve)
    serve.set_defaults(func=_serve_command)

    offline = commands.add_parser("offline", help="Run the engine without HTTP, next to transformers' baselines.",
                                  description="Engine flags below are the same as `sluice serve`'s.")
    _add_workload_flags(offline)
    offline.add_argument("--standard", action="store_true",
                         help="Run the standard workloads (A, B, C) with targets, profile and scheduler "
                              "micro-benchmark; workload flags are ignored.")
    offline.add_argument("--profile", action="store_true",
                         help="Only profile decode steps at batch 1 and 64, prompts of --input-len tokens "
                              "(phases and top torch ops).")
    offline.add_argument("--baselines", default="ceiling,generate,generate_batch",
                         help="Comma list of ceiling, generate, generate_batch, or 'none' (default: %(default)s).")
    offline.add_argument("--generate-batch-max-prompts", type=int, default=0,
                         help="Time generate_batch on the first N prompts only (0: all; default: %(default)s).")
    offline.add_argument("--threads", type=int, default=0,
                         help="torch threads for the engine and the baselines alike (0: leave torch's choice).")
    offline.add_argument("--output", default="", help="Write results JSON here (and a .md table next to it).")
    from sluice.service.config import add_config_flags

    add_config_flags(offline)
    offline.set_defaults(func=_offline_command)

    sched = commands.add_parser("scheduler", help="Scheduler + KV manager cost per step, model-free.")
    sched.add_argument("--sizes", default="64,256,1024", help="Running-request counts (default: %(default)s).")
    sched.add_argument("--steps", type=int, default=30, help="Timed steps per size (default: %(default)s).")
    sched.set_defaults(func=_scheduler_command)

    peers = commands.add_parser("peers", help="Sluice beside llama.cpp's server (built from PyPI's sdist): A, B, C, D, "
                                "E per model size and weight format.")
    peers.add_argument("--output", default="bench/results/peers.json", help="JSON result; a .md table beside it.")
    peers.add_argument("--sizes", default="135m,360m,1.7b",
                       help="Model sizes: 135m (SmolLM2-135M-Instruct), 360m, 1.7b (random weights of SmolLM2's "
                            "shapes) (default: %(default)s).")
    peers.add_argument("--formats", default="", help="Weight format pairs, by either side's name: fp32/F32, bf16/BF16, "
                       "int4/Q4_1, Q4_K/Q4_K_M (gguf), Q4_0/Q4_0, f16/F16, and only when named Q5_K/Q5_K_M, "
                       "IQ4_XS/IQ4_XS, Q3_K/Q3_K_M and Q2_K/Q2_K (default: the float pair this CPU runs best, "
                       "bf16/BF16 where it multiplies bf16 natively, else fp32/F32 and f16/F16; and every other "
                       "quantized pair).")
    peers.add_argument("--d-sizes", default="135m", help="Sizes that also run workload D (repetitive) with n-gram "
                       "speculation off and on, or 'none' (default: %(default)s; random weights accept few drafts).")
    peers.add_argument("--resume", action="store_true", help="Keep the lines --output already holds with the same "
                       "plan, run only the rest.")
    peers.add_argument("--estimate", action="store_true", help="Print the plan and its expected duration; run nothing.")
    peers.add_argument("--baseline", default="", help="A git ref whose Sluice runs beside this one, alternating.")
    peers.add_argument("--rounds", type=int, default=1, help="Run every server line this many times, the order "
                       "reversed each round; figures are each line's median (a machine whose speed drifts).")
    peers.add_argument("--shapes", default="", help="Random models served by Sluice on A and B too, e.g. "
                       "qwen2-135m,qwen3-135m (architectures llama, qwen2, qwen3; sizes 135m, 360m, 1.7b).")
    peers.add_argument("--workloads", default="", help="Run only these workloads, e.g. E (default: all of A, B, C, "
                       "D and E).")
    peers.add_argument("--isa", default="native", help="native, or avx2: both servers held to AVX2 and FMA (llama.cpp "
                       "built without AVX-512, Sluice's kernels for x86-64-v3, torch's capped), another machine's "
                       "code paths on this one's cores (default: %(default)s).")
    peers.set_defaults(func=_peers_command)

    grammar = commands.add_parser("grammar", help="Grammar-constrained rows' share of a batch-64 decode step.")
    grammar.add_argument("--constrained", type=int, default=16, help="Constrained rows (default: %(default)s).")
    add_config_flags(grammar)
    grammar.set_defaults(func=_grammar_command)

    protocol = commands.add_parser("protocol", help="Request-body validation time per body, beside its JSON decode.")
    protocol.add_argument("--baseline", default="", help="A git ref whose validation is timed too, alternating.")
    protocol.add_argument("--number", type=int, default=200, help="Parses per timed round (default: %(default)s).")
    protocol.add_argument("--rounds", type=int, default=7, help="Rounds; the least is kept (default: %(default)s).")
    protocol.set_defaults(func=_protocol_command)

    quant = commands.add_parser(
        "quant", help="int8 and int4 vs fp32 on the default model: perplexity, greedy agreement."
    )
    quant.add_argument("--output", default="", help="Also write the result as JSON here.")
    quant.set_defaults(func=_quant_command)
    return bench


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=64, help="Requests to send (default: %(default)s).")
    g.add_argument("--input-len", type=int, default=100,
                   help="Prompt tokens, shared prefix included (default: %(default)s).")
    g.add_argument("--output-len", type=int, default=128, help="Output tokens per request (default: %(default)s).")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="Draw lengths uniformly from [len*(1-r), len*(1+r)] (default: fixed).")
    g.add_argument("--prefix-len", type=int, default=0, help="Leading tokens shared by every prompt.")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="Requests per second, Poisson arrivals (default: inf, all at once).")
    g.add_argument("--max-concurrency", type=int, default=0, help="Requests in flight at most (0: no limit).")
    g.add_argument("--seed", type=int, default=0, help="Seed for prompts and arrivals (default: %(default)s).")
    g.add_argument("--name", default="custom", help="Workload label in the output.")
    g.add_argument("--dataset-name", default="random", choices=("random", "repetitive"),
                   help="random: prompts of random tokens (or words); repetitive (workload D): passages of code and "
                        "JSON to return with small edits, --input-len unused (default: %(default)s).")


def _add_mixed_flags(p: argparse.ArgumentParser) -> None:
    from sluice.service.bench.workloads import LARGE_KINDS

    g = p.add_argument_group("mixed", "--mixed: streams decoding while long prompts arrive (the workload flags above "
                             "are unused; --endpoint is the streams')")
    g.add_argument("--mixed", action="store_true", help="Run the mixed workload: streams' ITL idle and loaded, the "
                   "long prompts' TTFT and completion time, a one-line chat's TTFT.")
    g.add_argument("--mixed-streams", type=int, default=2, help="Streams decoding throughout (default: %(default)s).")
    g.add_argument("--mixed-long-prompts", type=int, default=32, help="Long prompts sent (default: %(default)s).")
    g.add_argument("--mixed-long-len", type=int, default=1024, help="Tokens per long prompt (default: %(default)s).")
    g.add_argument("--mixed-large", default="prompts", choices=LARGE_KINDS,
                   help="The large request: one completions call with a prompt list, the prompts as separate "
                        "requests (any OpenAI-compatible server), one embeddings call with them as inputs, or a prompt "
                        "list under a small grammar (default: %(default)s).")
    g.add_argument("--mixed-long-output", type=int, default=1, help="Tokens generated per long prompt.")
    g.add_argument("--mixed-alone", action="store_true", help="First time the long prompts alone (the slowdown).")
    g.add_argument("--mixed-idle", type=float, default=3.0, help="Seconds the streams decode alone first.")
    g.add_argument("--mixed-tenant-header", default="", help="Send the large request as tenant 'bulk' and the streams "
                   "and the chat as tenant 'interactive' in this header (the server's --tenant-header): two tenants.")


def _workload(args):
    from sluice.service.bench.workloads import Workload

    return Workload(args.name, args.num_prompts, args.input_len, args.output_len, args.random_range_ratio,
                    args.prefix_len, args.max_concurrency, args.request_rate, args.seed, args.dataset_name)


def _serve_command(args) -> int:
    import asyncio

    import orjson

    from sluice.service.bench.report import result_lines, write_json
    from sluice.service.bench.serve import ServeConfig, run_serve, serve_report

    try:
        extra = orjson.loads(args.extra_body)
        cfg = ServeConfig(_workload(args), args.base_url, args.endpoint, args.model, args.tokenizer, args.api_key,
                          args.ignore_eos, extra, args.timeout, args.num_warmups, args.progress)
        cfg.workload.validate()
        mixed = _mixed(args)
    except (ValueError, orjson.JSONDecodeError) as e:
        print(f"sluice bench serve: error: {e}", file=sys.stderr)
        return 2
    if mixed is not None:
        from sluice.service.bench.mixed import mixed_lines, run_mixed

        outcome = asyncio.run(run_mixed(cfg, mixed))
        print("\n".join(mixed_lines(outcome)))
        if args.result_file:
            write_json(args.result_file, {"kind": "mixed", "workload": mixed, "result": outcome,
                                          "rate_ratio": outcome.rate_ratio, "slowdown": outcome.slowdown})
        return 0 if not outcome.errors else 1
    result = asyncio.run(run_serve(cfg))
    print("\n".join(result_lines(result)))
    if args.result_file:
        write_json(args.result_file, serve_report(cfg, result))
    return 0 if result.completed else 1


def _mixed(args):
    """The mixed workload the flags describe, or None without --mixed."""
    if not args.mixed:
        return None
    from sluice.service.bench.mixed import MixedWorkload

    w = MixedWorkload(streams=args.mixed_streams, long_prompts=args.mixed_long_prompts,
                      long_input_len=args.mixed_long_len, long_output_len=args.mixed_long_output,
                      large=args.mixed_large, idle_s=args.mixed_idle, alone=args.mixed_alone, seed=args.seed,
                      tenant_header=args.mixed_tenant_header)
    w.validate()
    return w


def _offline_command(args) -> int:

    from sluice.service.bench.offline import warmup
    from sluice.service.bench.report import markdown, to_jsonable, write_json
    from sluice.service.bench.suite import BASELINES, Suite, _loadavg, meta
    from sluice.service.config import config_from_args
    from sluice.service.engine.engine import LLMEngine, freeze_startup_objects

    baselines = () if args.baselines == "none" else tuple(b.strip() for b in args.baselines.split(",") if b.strip())
    unknown = set(baselines) - set(BASELINES)
    try:
        if unknown:
            raise ValueError(f"unknown baselines {sorted(unknown)}; choose from {', '.join(BASELINES)}")
        config = config_from_args(args)
        config.validate()
        workload = _workload(args)
        workload.validate()
        if workload.dataset != "random":  # offline prompts are token ids, drawn without a text source
            raise ValueError("--dataset-name repetitive runs with `sluice bench serve` only")
    except ValueError as e:
        print(f"sluice bench offline: error: {e}", file=sys.stderr)
        return 2
    suite = Suite(LLMEngine(config))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    suite.log(f"engine ready: {suite.engine.served_model_name}, {suite.engine.num_kv_blocks} KV blocks; warming up")
    warmup(suite.engine)
    freeze_startup_objects()  # as `sluice serve` does once its engine is up
    if args.standard:
        from sluice.service.bench.standard import run_standard

        results = run_standard(suite)
    else:
        results = {"meta": meta(suite.engine), "workloads": {}}
        if args.profile:
            from sluice.service.bench.profile import profile_decode

            batches = sorted({1, min(64, config.scheduler.max_num_seqs)})
            results["profile"] = [profile_decode(suite.engine, b, args.input_len) for b in batches]
        else:
            _, results["workloads"][workload.name] = suite.evaluate(
                workload, baselines, args.generate_batch_max_prompts
            )
        results["meta"]["loadavg_end"] = _loadavg()
        results["meta"]["elapsed_s"] = time.perf_counter() - suite.start
    results = to_jsonable(results)
    text = markdown(results)
    print(text)
    if args.output:
        path = write_json(args.output, results)
        Path(path).with_suffix(".md").write_text(text)
        suite.log(f"wrote {path} and {Path(path).with_suffix('.md')}")
    return 0


def _peers_command(args) -> int:

    from sluice.service.bench.isa_cap import bf16_flags, check
    from sluice.service.bench.llama_cpp import cpu_flags
    from sluice.service.bench.peer_plan import estimate_lines, parse_formats, parse_sizes, parse_workloads, plan
    from sluice.service.bench.peers import check_rounds, round_order, run_peers

    shapes = tuple(s for s in args.shapes.split(",") if s)
    try:
        check(args.isa, cpu_flags())
        bf16 = bf16_flags(args.isa)
        sizes, pairs, d_sizes = parse_sizes(args.sizes), parse_formats(args.formats, bf16), (
            parse_sizes(args.d_sizes) if args.d_sizes.strip().lower() not in ("", "none") else ())
        workloads = parse_workloads(args.workloads) if args.workloads.strip() else ()
        lines = plan(sizes, pairs, d_sizes, bf16=bool(bf16), shapes=shapes, workloads=workloads)
        check_rounds(args.rounds, args.resume)
    except ValueError as e:
        print(f"sluice bench peers: error: {e}", file=sys.stderr)
        return 2

    if args.estimate:
        runs = [line for line, _ in round_order(lines, args.rounds)]
        print("\n".join([*(line.name for line in runs), *estimate_lines(runs)]))
        return 0

    run_peers(Path(args.output), sizes, pairs, d_sizes, args.baseline, shapes, args.resume, args.rounds, workloads,
              args.isa)
    return 0


def _grammar_command(args) -> int:
    from sluice.service.bench.grammar_overhead import grammar_overhead
    from sluice.service.config import config_from_args
    from sluice.service.engine.engine import LLMEngine

    g = grammar_overhead(LLMEngine(config_from_args(args)), constrained=args.constrained)
    print(f"batch {g['batch']}: step {g['step_ms']:.1f} ms; {g['constrained_rows']} constrained rows "
          f"{g['grammar_ms']:.2f} ms ({100 * g['grammar_share']:.1f}%); no constrained row "
          f"{g['no_constraint_ms'] * 1e3:.0f} us ({100 * g['no_constraint_share']:.3f}%)")
    return 0


def _quant_command(args) -> int:
    import json

    import torch

    from sluice.service.bench.quant_quality import quant_quality
    from sluice.service.config import ModelConfig
    from sluice.service.executor.model_loader import ensure_default_model, load_model

    model, tokenizer = load_model(str(ensure_default_model()), torch.device("cpu"), torch.float32,
                                  settings=ModelConfig(owned_model=False))  # transformers' model: its generate
    model.set_attn_implementation("sdpa")  # transformers' own attention: no paged cache outside the engine
    q = quant_quality(model, tokenizer)
    print(f"perplexity fp32 {q['perplexity']['fp32']:.3f}")
    for method, g in q["greedy"].items():
        print(f"{method}: perplexity {q['perplexity'][method]:.3f}; greedy against fp32: {g['identical']}/"
              f"{q['greedy_prompts']} prompts identical over {q['greedy_tokens']} tokens, mean agreeing prefix "
              f"{100 * g['mean_agreeing_prefix']:.0f}%")
    if args.output:
        Path(args.output).write_text(json.dumps(q, indent=2))
    return 0


def _scheduler_command(args) -> int:
    from sluice.service.bench.sched_micro import scheduler_scaling

    points = scheduler_scaling(tuple(int(s) for s in args.sizes.split(",")), args.steps)
    print(f"{'running':>8} {'schedule us':>12} {'update us':>10} {'step us':>10} {'us/request':>11}")
    for p in points:
        print(f"{p.num_running:>8} {p.schedule_us:>12.0f} {p.update_us:>10.0f} {p.step_us:>10.0f} "
              f"{p.us_per_request:>11.1f}")
    return 0


def _protocol_command(args) -> int:
    from sluice.service.bench.protocol_parse import compare, report_lines

    print("\n".join(report_lines(compare(args.baseline, args.number, args.rounds))))
    return 0
