"""`make gpu-check`: the GPU path in one run, on random-weight models (no downloads), written to one JSON.

1. Parity: tiny random Llama / Qwen2 / Qwen3 / Mistral (windowed) models, greedy Sluice against transformers'
   `generate` on the same device, under chunked prefill, shared prefixes and preemption, for each attention
   backend that runs here.
   fp32 must match token for token; bf16 agreement is reported (rounding may legitimately diverge late).
2. Sampler: one mixed batch (greedy, seeded, top-k/top-p/min-p, logprobs) under CUDA's sync debug mode set to
   'error', the one designated read-back excepted.
3. Benchmark: a ~1.1B-parameter Llama-shaped random model (TinyLlama's shape) in bf16: A, 64 requests at once;
   B, one stream; beside transformers' static-batch `generate` on the same prompts in the same process.

The benchmark runs first, on a fresh compile state; each stage runs in its own try under its own share of
`--budget-s` (`service/bench/stages.py`), with compile state reset before it, its traceback and torch's recompile
reasons kept, and the JSON rewritten after every stage, so a run cut short still says what it saw.

`--tiny` runs all of it on CPU on a tiny config in well under a minute (what CI runs). The launcher is
`bench/gpu_check.py`, which also works from a bare checkout (no install).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import time

import torch

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.bench.baselines import hf_generate
from sluice.service.bench.gpu_attention import backends_here, check_attention
from sluice.service.bench.offline import run_workload, warmup
from sluice.service.bench.stages import Stage, run_stages
from sluice.service.bench.workloads import Workload

MISTRAL_WINDOW = 64
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# TinyLlama-1.1B's shape: 1.1B parameters with a 32000-token vocabulary.
ONE_B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer with exactly `vocab_size` ids (id 0 is EOS), built in-process."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<pad>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def model_config(arch: str, shape: dict, vocab_size: int):
    import transformers

    # Tiny models get large weights so greedy choices are decisive (as tests/test_parity.py); the 1B the usual 0.02.
    init = 0.2 if shape["hidden_size"] <= 256 else 0.02
    common = dict(vocab_size=vocab_size, max_position_embeddings=4096, initializer_range=init, eos_token_id=None,
                  bos_token_id=None, pad_token_id=1, tie_word_embeddings=False, **shape)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=shape["hidden_size"] // shape["num_attention_heads"], **common)
    if arch == "mistral":  # a window shorter than the longer prompts: the kernels' window rule is exercised
        return transformers.MistralConfig(sliding_window=MISTRAL_WINDOW, **common)
    return {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch](**common)


def random_model(arch: str, shape: dict, vocab_size: int, dtype: torch.dtype, device: torch.device, seed: int = 1234):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(arch, shape, vocab_size), attn_implementation="sdpa",
                                                 dtype=dtype)
    return model.eval()


# Each stage's share of --budget-s (normalized over the stages that run), the benchmark first: fresh compile state.
SHARES = {"bench": 0.45, "attention": 0.04, "attention_flex": 0.08, "parity": 0.35, "sampler_syncs": 0.08}
ENFORCE_EAGER = False  # --enforce-eager: every engine of the run without CUDA graphs


def make_engine(model, tokenizer, device, dtype, backend: str, sched: dict | None = None, **cache):
    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine

    cfg = SluiceConfig()
    cfg.model.device, cfg.model.dtype = str(device), str(dtype).removeprefix("torch.")
    cfg.model.enforce_eager = ENFORCE_EAGER
    cfg.cache.attention_backend = backend
    for k, v in cache.items():
        setattr(cfg.cache, k, v)
    for k, v in (sched or {}).items():
        setattr(cfg.scheduler, k, v)
    return LLMEngine(cfg, model=model, tokenizer=tokenizer)


def parity_prompts(vocab_size: int, n: int = 12, seed: int = 0) -> list[list[int]]:
    """Half of them share a 48-token prefix (cross-request prefix hits); lengths 1..89 past it."""
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(48)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(3, vocab_size) for _ in range(rng.randrange(1, 90))]
        prompts.append(shared + tail if i % 2 == 0 else tail)
    return prompts


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=1)  # the configs have no EOS: exactly max_new_tokens, as ignore_eos
    return out[0, len(prompt):].tolist()


def check_parity(device: torch.device, archs: list[str], num_prompts: int = 12, max_new: int = 16,
                 deadline: float = math.inf) -> dict:
    """Per backend, dtype and arch: prompts whose greedy output equals generate's, and tokens agreeing.
    fp32 runs first; combinations not started by `deadline` (perf_counter) are listed as skipped."""
    vocab = 512
    tokenizer = word_tokenizer(vocab)
    prompts = parity_prompts(vocab, num_prompts)
    report: dict = {}
    for dtype in (torch.float32, torch.bfloat16):
        for arch in archs:
            if time.perf_counter() > deadline:
                report.setdefault("skipped_for_time", []).append(f"{str(dtype).removeprefix('torch.')}/{arch}")
                continue
            reference = random_model(arch, TINY, vocab, dtype, device)
            expected = [hf_greedy(reference, p, max_new) for p in prompts]
            for backend in backends_here(device):
                model = random_model(arch, TINY, vocab, dtype, device)
                # 24 blocks of 16 for 12 prompts of up to 137 tokens: chunking, prefix hits and preemption.
                sched = dict(max_num_batched_tokens=64, max_num_seqs=16,
                             preemption_mode="swap" if arch == "qwen2" else "recompute")
                engine = make_engine(model, tokenizer, device, dtype, backend, sched, num_kv_blocks=24, swap_space=0.01)
                got = engine.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True))
                same = sum(g.token_ids == e for g, e in zip(got, expected, strict=True))
                agree = sum(_common_prefix(g.token_ids, e) for g, e in zip(got, expected, strict=True))
                key = f"{backend}/{str(dtype).removeprefix('torch.')}/{arch}"
                report[key] = {"prompts_identical": same, "prompts": len(prompts),
                               "token_agreement": round(agree / (max_new * len(prompts)), 4)}
                print(f"gpu-check: parity {key}: {same}/{len(prompts)} identical", flush=True)
                del engine, model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    fp32 = [v for k, v in report.items() if "/float32/" in k]
    report["fp32_exact"] = bool(fp32) and all(v["prompts_identical"] == v["prompts"] for v in fp32)
    return report


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def check_sampler_syncs(device: torch.device) -> dict:
    """The sampler on a mixed batch with CUDA's sync debug mode 'error' outside its one read-back."""
    from sluice.scheduling.output import ScheduledRequest
    from sluice.service.executor import sampler

    if device.type != "cuda":
        return {"skipped": "no CUDA"}
    kinds = [dict(temperature=0.0), dict(seed=7), dict(top_k=5, seed=1), dict(top_p=0.9, seed=2),
             dict(min_p=0.05), dict(top_k=40, top_p=0.8, min_p=0.01, seed=4), dict(temperature=0.0, logprobs=3),
             dict(top_p=0.5, logprobs=0, seed=5)]
    requests = [ScheduledRequest("r", [1], 0, [0], True, SamplingParams(**k), i, eos_token_id=0,
                                 min_tokens_pending=i == 2) for i, k in enumerate(kinds)]
    logits = torch.randn(len(requests), 32000, device=device)
    real = sampler.read_back

    def read_back(values):
        torch.cuda.set_sync_debug_mode(0)
        return real(values)

    sampler.read_back = read_back
    try:
        sampler.sample(logits, requests)
        torch.cuda.set_sync_debug_mode("error")
        out = sampler.sample(logits, requests)
        return {"ok": True, "tokens": out.token_ids}
    except RuntimeError as e:
        return {"ok": False, "error": str(e)[:300]}
    finally:
        torch.cuda.set_sync_debug_mode(0)
        sampler.read_back = real


def run_benchmark(device: torch.device, tiny: bool) -> dict:
    """A: 64 requests at once; B: one stream. transformers' static-batch generate on A's prompts and B's first."""
    dtype = torch.float32 if tiny else torch.bfloat16
    vocab = 512 if tiny else 32000
    shape = TINY if tiny else ONE_B
    input_len, output_len = (32, 16) if tiny else (256, 128)
    tokenizer = word_tokenizer(vocab)
    model = random_model("llama", shape, vocab, dtype, device)
    params = sum(p.numel() for p in model.parameters())
    a = Workload(name="A_64_at_once", num_prompts=64, input_len=input_len, output_len=output_len, seed=1)
    b = Workload(name="B_one_stream", num_prompts=2 if tiny else 4, input_len=input_len, output_len=output_len,
                 max_concurrency=1, seed=2)
    from sluice.service.bench.workloads import token_prompts

    prompts_a, prompts_b = (token_prompts(w, vocab, frozenset({0, 1, 2})) for w in (a, b))
    # The baseline first: the engine switches the model's attention to the paged backend.
    hf_generate(model, prompts_a[:2], 4, pad_token_id=1)  # warm-up
    base_a = hf_generate(model, prompts_a, output_len, pad_token_id=1)
    base_b = hf_generate(model, prompts_b[:1], output_len, pad_token_id=1)
    cache = {"num_kv_blocks": 1024} if tiny else {"kv_cache_memory": 16.0}
    allocated = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    start = time.perf_counter()
    engine = make_engine(model, tokenizer, device, dtype, "auto", **cache)
    runner = engine.runner
    graphs = runner.graphs
    setup = {"engine_start_s": round(time.perf_counter() - start, 2), "kv_cache_bytes": engine.kv_cache_bytes,
             "decode_attention": "triton" if runner.decode_tables else runner.attention_backend,
             "cuda_graph_sizes": sorted(graphs.graphs) if graphs else [],
             "cuda_graph_capture_s": round(graphs.capture_s, 2) if graphs else None}
    if device.type == "cuda":  # what the engine allocated (its copy of the weights, the KV cache, the rest)
        setup["allocated_by_engine_bytes"] = torch.cuda.memory_allocated(device) - allocated
        setup["engine_weights_bytes"] = sum(t.numel() * t.element_size() for t in
                                            (*runner.model.parameters(), *runner.model.buffers()))
        setup["kv_tensor_bytes"] = runner.kv.num_bytes  # the logged cache and the decode steps' scratch block
    warmup(engine)
    run_workload(engine, Workload(name="warmup", num_prompts=8, input_len=input_len, output_len=8, seed=3))
    run_a = run_workload(engine, a, prompts_a)
    # One sequence alone first: batch 1's shapes (and on CUDA its compiled kernels) are warm before B is timed.
    one = Workload(name="warmup_one", num_prompts=1, input_len=input_len, output_len=8, seed=4, max_concurrency=1)
    run_workload(engine, one)
    run_b = run_workload(engine, b, prompts_b)
    report = {
        "model": {"shape": shape, "vocab_size": vocab, "parameters": params, "dtype": str(dtype)},
        "attention_backend": runner.attention_backend, "setup": setup,
        "A": _summary(run_a) | {"hf_generate_tokens_per_s": round(base_a.tokens_per_s, 1),
                                "hf_generate_duration_s": round(base_a.duration_s, 2)},
        "B": _summary(run_b) | {"hf_generate_tpot_ms": round(1000 * base_b.duration_s / output_len, 2)},
    }
    if graphs:  # the same single stream with every step eager: what the graphs save
        runner.graphs = None
        run_workload(engine, one)
        report["B_eager"] = _summary(run_workload(engine, b, prompts_b))
        runner.graphs = graphs
        # The GPU's own time for one decode step (a replay on padding rows): the floor under B's TPOT and A's step.
        report["graph_replay_ms"] = {size: replay_ms(runner, size) for size in (1, a.num_prompts) if size in graphs}
    return report


def replay_ms(runner, size: int, repeats: int = 20) -> float:
    """Mean milliseconds of one replay of the decode graph of `size`, on padding rows (they touch only the
    scratch block), timed by CUDA events."""
    runner.decode_buffers.padding_step(size)
    runner.graphs.replay(size)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        runner.graphs.replay(size)
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / repeats, 3)


def _summary(run) -> dict:
    r = run.result
    return {"requests": r.completed, "failed": r.failed, "output_tokens": r.output_tokens,
            "duration_s": round(r.duration_s, 2), "output_tokens_per_s": round(r.output_throughput, 1),
            "tpot_ms_p50": round(r.tpot_ms.p50, 2), "ttft_ms_p50": round(r.ttft_ms.p50, 2),
            "mean_step_ms": round(run.mean_step_ms, 2), "errors": r.errors}


def log_engine_lines() -> None:
    """The engine's start-up lines (KV cache size, CUDA graphs captured) into the run's log: for the script only,
    since a caller's process keeps its own logging."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger("sluice").addHandler(handler)
    logging.getLogger("sluice").setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> dict:
    """Run every stage (the benchmark first, on a fresh compile state) into the JSON at --output."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny config: a quick self-test (CI)")
    parser.add_argument("--output", default="gpu_check.json", help="the JSON, rewritten after every stage")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--only-bench", action="store_true", help="the benchmark stage alone")
    parser.add_argument("--enforce-eager", action="store_true", help="engines without CUDA graphs")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the whole run's seconds, shared among the stages that run in the proportions of "
                             "SHARES; default 450 on a GPU; with --tiny, no budget but the caller's")
    args = parser.parse_args(argv)
    global ENFORCE_EAGER
    ENFORCE_EAGER = args.enforce_eager
    if not args.tiny and not torch.cuda.is_available():
        parser.error("no CUDA device here; --tiny runs the CPU self-test")
    device = torch.device("cpu" if args.tiny else "cuda")
    import transformers

    report: dict = {
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "device": str(device), "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "tiny": args.tiny,
    }
    archs = ["llama"] if args.tiny else ["llama", "qwen2", "qwen3", "mistral"]
    budget = args.budget_s or (math.inf if args.tiny else 450.0)
    chosen = [name for name in SHARES if not (args.skip_bench and name == "bench")
              and not (args.only_bench and name != "bench")]
    part = {name: budget * SHARES[name] / sum(SHARES[c] for c in chosen) for name in chosen}
    runs = {"bench": lambda: run_benchmark(device, args.tiny),
            "attention": lambda: check_attention(device, tiny=args.tiny),
            "attention_flex": lambda: check_attention(device, tiny=args.tiny, flex=True),
            # new combinations start only in the first 6/7 of parity's share: one more must still fit
            "parity": lambda: check_parity(device, archs, num_prompts=6 if args.tiny else 12,
                                           deadline=time.perf_counter() + part["parity"] * 6 / 7),
            "sampler_syncs": lambda: check_sampler_syncs(device)}
    stages = [Stage(name, runs[name], part[name]) for name in chosen]
    run_stages(stages, report, lambda r: _write(args.output, r))
    checks = args.only_bench or (bool(report["attention"].get("ok")) and bool(report["attention_flex"].get("ok"))
                                 and bool(report["parity"].get("fp32_exact"))
                                 and report["sampler_syncs"].get("ok", True))
    report["ok"] = checks and (args.skip_bench or "error" not in report["bench"])
    _write(args.output, report)
    print(json.dumps(report, indent=2, default=str))
    return report


def _write(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))


if __name__ == "__main__":
    log_engine_lines()
    raise SystemExit(0 if main().get("ok") else 1)
