"""Drive an LLMEngine through a workload without HTTP, recording per-token times and each step's batch shape."""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.bench.hooks import patched
from sluice.service.bench.stats import BenchResult, RequestRecord, summarize
from sluice.service.bench.workloads import Workload, arrival_offsets, sample_lengths, token_prompts

_run_ids = itertools.count()


@dataclass(slots=True)
class StepShape:
    """One engine step as the model saw it: decodes (with their mean context) and prefill chunks."""

    num_decodes: int = 0
    decode_ctx: float = 0.0  # mean kv length of the decodes, the new token included
    prefills: list[tuple[str, int, int]] = field(default_factory=list)  # (request_id, chunk_len, start_pos)


@dataclass(slots=True)
class OfflineRun:
    """A finished workload: the summary, the prompts, and the batch shapes the engine actually ran."""

    workload: Workload
    result: BenchResult
    prompts: list[list[int]]
    request_ids: list[str]
    steps: list[StepShape]
    prefix_cache_hit_rate: float
    mean_step_ms: float


def prompts_for(engine, w: Workload) -> list[list[int]]:
    """The workload's prompts as token ids in the engine's vocabulary, special tokens excluded."""
    return token_prompts(w, engine.vocab_size, frozenset(engine.tokenizer.all_special_ids))


def warmup(engine, prompt_len: int = 32) -> None:
    """One short run so lazy initialisation and first-call costs stay out of the timed runs."""
    engine.generate(
        [list(range(3, 3 + prompt_len))] * 2, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )


def run_workload(engine, w: Workload, prompts: list[list[int]] | None = None, reset_cache: bool = True) -> OfflineRun:
    """Feed the workload to engine.step(): arrivals, concurrency limit and timings as `bench serve` does over HTTP."""
    w.validate()
    prompts = prompts if prompts is not None else prompts_for(engine, w)
    if reset_cache and not engine.has_unfinished_requests():
        engine.kv_manager.reset_prefix_cache()  # each run starts cold: no hits left over from an earlier one
    offsets = arrival_offsets(len(prompts), w.request_rate, w.seed)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in sample_lengths(w)]
    run = next(_run_ids)
    ids = [f"{w.name}-{run}-{i}" for i in range(len(prompts))]
    index = {rid: i for i, rid in enumerate(ids)}
    records = [RequestRecord(len(p), params[i].max_tokens) for i, p in enumerate(prompts)]
    steps: list[StepShape] = []
    step_times: list[float] = []
    kv = engine.kv_manager
    queries0, hits0 = kv.prefix_cache_queries, kv.prefix_cache_hits

    def record_shapes(schedule):
        def wrapper(*args, **kwargs):
            out = schedule(*args, **kwargs)
            shape = StepShape()
            ctx = 0
            for s in out.scheduled:
                if s.num_tokens == 1 and s.num_output_tokens > 0:  # a decode, not a prompt's last token
                    shape.num_decodes += 1
                    ctx += s.start_pos + 1
                else:
                    shape.prefills.append((s.request_id, s.num_tokens, s.start_pos))
            shape.decode_ctx = ctx / shape.num_decodes if shape.num_decodes else 0.0
            steps.append(shape)
            return out

        return wrapper

    pending = deque(range(len(prompts)))
    in_flight = 0
    with patched(engine.scheduler, "schedule", record_shapes):
        start = time.perf_counter()
        while pending or engine.has_unfinished_requests():
            now = time.perf_counter()
            while pending and (not w.max_concurrency or in_flight < w.max_concurrency) and (
                start + offsets[pending[0]] <= now
            ):
                i = pending.popleft()
                records[i].start = time.perf_counter()
                engine.add_request(ids[i], prompts[i], params[i])
                in_flight += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, start + offsets[pending[0]] - time.perf_counter()))
                continue
            t0 = time.perf_counter()
            outputs = engine.step()
            t = time.perf_counter()
            step_times.append(t - t0)
            for out in outputs:
                i = index.get(out.request_id)
                if i is None:
                    continue
                record = records[i]
                record.token_times.extend([t] * len(out.token_ids))
                record.output_tokens += len(out.token_ids)
                if out.finished:
                    record.end = t
                    record.ok = out.finish_reason in ("stop", "length")
                    record.error = out.error or ("" if record.ok else f"finish_reason={out.finish_reason}")
                    in_flight -= 1
        duration = time.perf_counter() - start
    queries = kv.prefix_cache_queries - queries0
    return OfflineRun(
        workload=w,
        result=summarize(w.name, records, duration),
        prompts=prompts,
        request_ids=ids,
        steps=steps,
        prefix_cache_hit_rate=(kv.prefix_cache_hits - hits0) / queries if queries else 0.0,
        mean_step_ms=1000 * sum(step_times) / max(len(step_times), 1),
    )

