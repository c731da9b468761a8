"""`bench grammar`: what grammar-constrained rows add to a decode step, measured beside the step itself.

A batch of 64 decoding requests is stepped to measure the step; then, on that batch's real logits, the
per-step grammar work for `constrained` rows (fill the bitmask, mask the logits, advance each matcher by one
token) is timed, and so is the logits processing of a batch with no constrained row. Both are reported as a
share of the step, from the same run.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from sluice.scheduling.output import ScheduledRequest
from sluice.scheduling.sampling_params import SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}},
    "required": ["name", "age", "tags", "address"]}


def grammar_overhead(engine, batch: int = 64, constrained: int = 16, steps: int = 8, repeats: int = 200) -> dict:
    """Step time at `batch` decodes, and the grammar and logits-processing cost per step as its share."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    prompts = [f"Request {i}: describe a person in a few words." for i in range(batch)]
    for i, p in enumerate(prompts):
        engine.add_request(f"grammar-bench-{i}", p, params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()  # prefill until every request decodes
    step_times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    step = statistics.median(step_times)

    vocab = engine.vocab_size
    logits = torch.randn(batch, vocab)
    rows = [ScheduledRequest(f"row-{i}", [0], 0, [0], True, params, 1) for i in range(batch)]
    runner = engine.runner
    # No constrained row: everything the runner's logits processors do for an ordinary batch.
    free = _time(lambda: [p(logits, rows) for p in runner.logits_processors], repeats)

    grammar = engine.grammar
    constraint = StructuredOutput("json", json.dumps(SCHEMA), "bench")
    for i in range(constrained):
        grammar.add(rows[i].request_id, constraint)
    work = logits.clone()

    def constrained_step():
        work.copy_(logits)
        grammar.mask_logits(work, rows)
        picks = work[:constrained].argmax(-1).tolist()
        for i, token in enumerate(picks):  # advance and step back, so every repeat sees the same states
            matcher = grammar.matchers[rows[i].request_id]
            if matcher.accept_token(token):
                matcher.rollback(1)

    masked = _time(constrained_step, repeats) - _time(lambda: work.copy_(logits), repeats)
    for i in range(constrained):
        grammar.remove(rows[i].request_id)
    return {
        "batch": batch, "constrained_rows": constrained, "step_ms": step * 1e3,
        "grammar_ms": masked * 1e3, "grammar_share": masked / step,
        "no_constraint_ms": free * 1e3, "no_constraint_share": free / step,
    }


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
