"""n-gram speculation through the engine: greedy output equals transformers' and the engine's own without
speculation, under chunking, prefix hits and both preemption modes; processors, stops and seeds hold."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from sluice.scheduling.sampling_params import SamplingParams
from tests.support.parity import build_pair, hf_greedy, make_engine, mixed_prompts

MAX_NEW = 40
CYCLING = (1, 3, 6)  # prompts whose output soon repeats itself: most of their drafts are accepted


@functools.cache
def copying_pair():
    """The tiny Llama with its blocks' outputs damped: the next token depends mostly on the current one, so the
    output soon repeats itself and n-gram drafts are accepted (attention still shapes it: KV errors show)."""
    reference, ours = build_pair("llama")
    with torch.no_grad():
        for model in (reference, ours):
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.05)
                layer.mlp.down_proj.weight.mul_(0.05)
    prompts = mixed_prompts(12)
    return ours, prompts, [hf_greedy(reference, p, MAX_NEW) for p in prompts], reference


def spec_counts(engine) -> dict:
    """Totals of the engine's speculation stats and preemptions, accumulated per step; chunked prefills and
    cross-request prefix hits, counted by spies on the runner and the KV manager."""
    totals = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "steps": 0, "recompute": 0, "swap": 0, "chunks": 0,
              "prefix_hits": 0, "generated": 0}

    def record(stats):
        totals["drafts"] += stats.spec_num_drafts
        totals["draft_tokens"] += stats.spec_num_draft_tokens
        totals["accepted"] += stats.spec_num_accepted_tokens
        totals["recompute"] += stats.num_preemptions_recompute
        totals["swap"] += stats.num_preemptions_swap
        totals["generated"] += stats.num_generation_tokens
        totals["steps"] += 1

    engine.stat_loggers.append(record)
    execute, lookup = engine.runner.execute, engine.kv_manager.get_computed_blocks

    def spy_execute(out):
        totals["chunks"] += sum(1 for s in out.scheduled if not s.sample)
        return execute(out)

    def spy_lookup(request):
        hits = lookup(request)
        totals["prefix_hits"] += bool(hits) and request.num_preemptions == 0
        return hits

    engine.runner.execute, engine.kv_manager.get_computed_blocks = spy_execute, spy_lookup
    return totals


def greedy(max_tokens=MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_parity_with_speculation_under_chunking_prefix_hits_and_preemption(mode):
    ours, prompts, expected, reference = copying_pair()
    engine = make_engine(ours, mode, num_blocks=24, speculative_method="ngram", num_speculative_tokens=4)
    counts = spec_counts(engine)
    results = engine.generate(prompts, greedy())
    for i, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert got.token_ids == want, f"prompt {i} diverged"
    assert counts[mode] > 0 and counts["chunks"] > 0 and counts["prefix_hits"] > 0, counts  # the paths it claims
    assert counts["accepted"] > 0 and counts["draft_tokens"] > counts["accepted"], counts  # both outcomes ran
    kv = engine.kv_stats()
    assert kv["free_blocks"] == kv["total_blocks"] and kv["free_host_blocks"] == kv["total_host_blocks"]


def test_speculation_takes_fewer_steps_on_repetitive_output_and_changes_nothing_without_it():
    ours, prompts, expected, reference = copying_pair()
    steps, want = {}, hf_greedy(reference, prompts[CYCLING[0]], 80)
    for method in ("none", "ngram"):
        engine = make_engine(ours, "recompute", num_blocks=256, speculative_method=method)
        counts = spec_counts(engine)
        assert engine.generate([prompts[CYCLING[0]]], greedy(80))[0].token_ids == want
        steps[method] = counts["steps"]
    assert steps["ngram"] < 0.6 * steps["none"], steps  # measured: 35 steps against 80
    # A random model's own text seldom repeats: drafts are rare and mostly rejected, the output is unchanged.
    plain_reference, plain = build_pair("llama")
    prompt = mixed_prompts(1, seed=5)[0]
    engine = make_engine(plain, "recompute", num_blocks=64, speculative_method="ngram")
    assert engine.generate([prompt], greedy())[0].token_ids == hf_greedy(plain_reference, prompt, MAX_NEW)


def run_both(params: SamplingParams, **sched):
    """(results without speculation, results with it, the speculating engine's counts)."""
    ours, all_prompts, _, _ = copying_pair()
    prompts = [all_prompts[i] for i in (*CYCLING, 0, 2)]
    off = make_engine(ours, "recompute", num_blocks=128, **sched).generate(prompts, params)
    engine = make_engine(ours, "recompute", num_blocks=128, speculative_method="ngram", **sched)
    counts = spec_counts(engine)
    return off, engine.generate(prompts, params), counts


@pytest.mark.parametrize("controls", [
    {"repetition_penalty": 0.8},  # penalties that favour repeats, so that drafts are accepted under them
    {"frequency_penalty": -0.6, "presence_penalty": 0.4},
    {"logit_bias": {141: 3.0, 59: 2.0}, "min_tokens": 30},
], ids=["repetition", "frequency_presence", "bias_min_tokens"])
def test_processors_see_the_accepted_drafts_before_each_position(controls):
    off, on, counts = run_both(greedy(**controls))
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert counts["accepted"] > 0, counts


def test_stops_and_max_tokens_cut_a_run_where_one_token_steps_stop():
    ours, prompts, expected, reference = copying_pair()
    tok_engine = make_engine(ours, "recompute", num_blocks=128)
    # A stop token, a stop string and max_tokens, each landing inside a run of accepted drafts.
    repeated = [t for t in expected[0][10:] if expected[0].count(t) > 2][0]
    stop_text = tok_engine.tokenizer.decode(expected[1][20:22])
    for params in (greedy(stop_token_ids=[repeated]), greedy(stop=[stop_text]), greedy(max_tokens=23),
                   greedy(stop=[stop_text], include_stop_str_in_output=True)):
        off, on, counts = run_both(params)
        for a, b in zip(off, on, strict=True):
            assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), params
        # The generated-tokens counter counts what was reported, not the drafts a stop string cut away.
        assert counts["generated"] == sum(len(r.token_ids) for r in on), params


def test_seeded_sampling_is_the_same_with_and_without_drafts():
    """A seed's text is a function of the request: each position draws with its (seed, position) uniform, with
    drafts proposed or not (and so whatever logprobs, which turns drafts off, says)."""
    ours, prompts, _, _ = copying_pair()
    params = [SamplingParams(max_tokens=40, temperature=0.3, top_p=0.95, seed=100 + i) for i in range(3)]
    with_logprobs = [dataclasses.replace(p, logprobs=1) for p in params]

    def run(method, sampling):
        engine = make_engine(ours, "recompute", num_blocks=128, speculative_method=method)
        counts = spec_counts(engine)
        return [r.token_ids for r in engine.generate([prompts[i] for i in CYCLING], sampling)], counts

    (first, counts), (second, _) = run("ngram", params), run("ngram", params)
    assert first == second and counts["drafts"] > 0 and counts["accepted"] > 0, counts
    assert run("none", params)[0] == first
    logprobs_on, counts = run("ngram", with_logprobs)
    assert counts["drafts"] == 0 and logprobs_on == first


def test_requests_with_logprobs_decode_without_drafts():
    off, on, counts = run_both(greedy(logprobs=2))
    assert counts["drafts"] == 0
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert all(len(r.logprobs) == len(r.token_ids) for r in on)


def _stop_inside_a_run(engine, prompt) -> tuple[str, int] | None:
    """A stop string that first completes on the first token of a step emitting several (verified drafts), and
    how many tokens come before it; None if this prompt's output has no such step."""
    engine.add_request("probe", prompt, greedy())
    text, num_before = "", 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            upto = text + engine.tokenizer.decode(out.token_ids[:1])
            # the shortest tail of the text up to the run's first token that the output has not shown before
            stop = next((upto[-j:] for j in range(1, len(upto) + 1) if upto[-j:] not in upto[:-1]), "")
            if len(out.token_ids) > 1 and len(upto) > len(text) and stop and "\ufffd" not in stop:
                engine.abort_request("probe")
                return stop, num_before
            text, num_before = text + out.text, num_before + len(out.token_ids)
    return None


def test_a_stop_string_inside_a_run_of_drafts_cuts_the_run_and_its_count():
    ours, prompts, _, _ = copying_pair()
    found = [(i, hit) for i in CYCLING if (hit := _stop_inside_a_run(
        make_engine(ours, "recompute", num_blocks=128, speculative_method="ngram"), prompts[i])) is not None]
    assert found, "no prompt's output has a multi-token step to cut"
    i, (stop, num_before) = found[0]
    params = greedy(stop=[stop])
    off = make_engine(ours, "recompute", num_blocks=128).generate([prompts[i]], params)[0]
    engine = make_engine(ours, "recompute", num_blocks=128, speculative_method="ngram")
    counts = spec_counts(engine)
    on = engine.generate([prompts[i]], params)[0]
    assert len(on.token_ids) == num_before + 1  # the run was cut after its first token
    assert (on.token_ids, on.text, on.finish_reason) == (off.token_ids, off.text, off.finish_reason)
    assert counts["generated"] == len(on.token_ids), counts  # the cut tokens are not counted as generated
