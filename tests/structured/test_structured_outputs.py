"""Grammar-constrained decoding: every constrained output satisfies its constraint, whatever the batching,
chunking, preemption or n; unconstrained neighbours are untouched; bad constraints are 400s naming the
parameter. The engine tests use a tiny random model (its free output is noise, so a match is the grammar's
doing); the server tests use the real SmolLM2 through the official `openai` client."""

from __future__ import annotations

import json
import re

import pytest

from sluice.scheduling.sampling_params import SamplingParams, StructuredOutput


@pytest.fixture(scope="module")
def engine(model_dir):
    from tests.support.tiny import tiny_engine

    return tiny_engine(model_dir, 12, max_num_batched_tokens=32, preemption_mode="swap")


def constrained(kind: str, spec: str = "", **kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 60), temperature=kw.pop("temperature", 0.0),
                          structured_output=StructuredOutput(kind, spec, "test"), **kw)


def test_constraints_hold_under_chunking_preemption_and_n(engine):
    """Long prompts (chunked prefill), a cache too small for all of them (preemption by swap), sampled and
    greedy rows, constrained and free rows in one batch: every constrained reply matches."""
    jsonschema = pytest.importorskip("jsonschema")
    regex = r"[0-9]{3}-[a-z]{2,4}"  # bounded languages: a random model babbles in an unbounded string
    cases = [
        ("regex", regex, lambda t: re.fullmatch(regex, t)),
        ("choice", json.dumps(["yes", "no", "maybe later"]), lambda t: t in ("yes", "no", "maybe later")),
        ("grammar", 'root ::= "(" [a-c] [a-c]? [a-c]? ")" | "none"', lambda t: re.fullmatch(r"\([a-c]{1,3}\)|none", t)),
        ("json", json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 7}},
                             "required": ["n"], "additionalProperties": False}),
         lambda t: jsonschema.validate(json.loads(t), {"properties": {"n": {"minimum": 3, "maximum": 7}},
                                                       "required": ["n"]}) is None),
    ]
    prompts, params, checks = [], [], []
    for i, (kind, spec, check) in enumerate(cases):
        for temperature in (0.0, 1.0):
            prompts.append("The capital of France is Paris. " * (3 + i))
            params.append(constrained(kind, spec, temperature=temperature, seed=i))
            checks.append(check)
    free = len(prompts)
    prompts += ["Hello world, how are you today?"] * 3
    params += [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 3
    preempted = []
    engine.stat_loggers.append(lambda s: preempted.append(s.num_preemptions_swap + s.num_preemptions_recompute))
    try:
        results = engine.generate(prompts, params)
    finally:
        engine.stat_loggers.pop()
    assert sum(preempted) > 0, "the cache was meant to be too small: no preemption happened"
    for r, check in zip(results[:free], checks, strict=True):
        assert r.finish_reason == "stop", (r.text, r.finish_reason)
        assert check(r.text), f"{r.text!r} breaks its constraint"
    assert all(len(r.token_ids) == 40 for r in results[free:])  # free rows: unconstrained, full length
    assert not engine.grammar.matchers, "matchers of finished requests leaked"


def test_free_rows_are_untouched_by_constrained_neighbours(engine):
    free = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    alone = engine.generate(["Streaming tokens over server-sent events"], free)[0].token_ids
    mixed = engine.generate(["Streaming tokens over server-sent events", "Hello"],
                            [free, constrained("regex", "[a-z]{5}")])
    assert mixed[0].token_ids == alone


def test_max_tokens_cuts_a_constrained_reply_with_length(engine):
    (r,) = engine.generate(["Hello"], [constrained("regex", "[a-z]{50}", max_tokens=5)])
    assert r.finish_reason == "length" and re.fullmatch("[a-z]*", r.text) and len(r.token_ids) == 5


@pytest.mark.parametrize("kind,spec", [("regex", "(unclosed"), ("grammar", "root ::= "),
                                       ("json", '{"type": "nonsense"}'), ("json", "not json")])
def test_a_bad_constraint_is_refused_before_it_reaches_a_step(engine, kind, spec):
    from sluice.service.structured.grammar import GrammarError

    with pytest.raises(GrammarError) as info:
        engine.add_request("bad", "Hello", constrained(kind, spec))
    assert info.value.param == "test" and "bad" not in engine.scheduler.requests


def test_compiled_grammars_are_cached_by_their_text(engine):
    compiler = engine.grammar.compiler
    c = StructuredOutput("regex", "[0-9]{4}", "x")
    assert compiler.compile(c) is compiler.compile(StructuredOutput("regex", "[0-9]{4}", "other param"))


def test_grammar_overhead_bench_reports_shares_of_a_step(engine):
    from sluice.service.bench.grammar_overhead import grammar_overhead

    g = grammar_overhead(engine, batch=8, constrained=4, steps=2, repeats=5)
    assert g["step_ms"] > 0 and 0 <= g["grammar_share"] < 1 and 0 <= g["no_constraint_share"] < 1
    assert not engine.has_unfinished_requests() and not engine.grammar.matchers


def test_length_bounded_strings_refuse_control_characters(engine):
    """xgrammar lets a maxLength string hold raw control characters (invalid JSON); Sluice's rewrite must not."""
    import xgrammar as xgr

    spec = json.dumps({"type": "object", "properties": {"a": {"type": "string", "minLength": 1, "maxLength": 3}},
                       "required": ["a"], "additionalProperties": False})
    compiled = engine.grammar.compiler.compile(StructuredOutput("json", spec, "x"))

    def accepts(text):
        return xgr.GrammarMatcher(compiled).accept_string(text)

    assert accepts('{"a": "ab"}') and accepts('{"a": "é😀"')
    assert not accepts('{"a": "a\x01') and not accepts('{"a": "abcd') and not accepts('{"a": ""}')


def test_bitmask_bits_set_and_clear_in_signed_words_including_the_sign_bit():
    import torch

    from sluice.service.structured.grammar import _set_bit

    row = torch.zeros(2, dtype=torch.int32)
    for token in (0, 31, 33, 63):
        _set_bit(row, token, True)
    assert row.tolist() == [1 - 2**31, 2 - 2**31]  # bits 0 and 31, then bits 1 and 31 of the second word
    _set_bit(row, 31, False)
    _set_bit(row, 63, True)  # already set: unchanged
    assert row.tolist() == [1, 2 - 2**31]
