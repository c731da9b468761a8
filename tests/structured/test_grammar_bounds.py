"""Every grammar a request can ask for is bounded: compile time, queue, cache bytes, per-token work, depth; and
impossible or unsupported constraints are errors, never a silent empty "stop"."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from sluice.scheduling.sampling_params import SamplingParams, StructuredOutput
from sluice.service.config import GrammarConfig
from sluice.service.structured.grammar_checks import TOO_COMPLEX, GrammarError, ambiguous_repeat
from tests.support.procs import children


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.support.tiny import save_tiny_model

    return AutoTokenizer.from_pretrained(save_tiny_model(str(tmp_path_factory.mktemp("tiny-bounds"))))


def compiler_for(tok, **knobs):
    from sluice.service.structured.grammar import GrammarCompiler

    return GrammarCompiler(tok, len(tok), [tok.eos_token_id], GrammarConfig(**knobs))


@pytest.fixture(scope="module")
def compiler(tok):
    return compiler_for(tok)


# ---- pure checks ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,spec,bad", [
    ("regex", "(x*|x*x*)*b", True), ("regex", "(a?)*", True), ("regex", "[0-9]{3}-[a-z]{2,4}", False),
    ("regex", "(ab*)*c", False), ("regex", r"\d+(\.\d*)?", False),
    ("grammar", 'root ::= a* "b"\na ::= "x"* | "x"* "x"*', True), ("grammar", 'root ::= ("a" | "b")+ "c"', False),
])
def test_repeats_of_what_can_match_empty_are_found(kind, spec, bad):
    import xgrammar as xgr

    grammar = xgr.Grammar.from_regex(spec) if kind == "regex" else xgr.Grammar.from_ebnf(spec)
    assert (ambiguous_repeat(str(grammar)) is not None) is bad


# ---- compiles --------------------------------------------------------------------------------------------------

def test_long_bounded_strings_compile_fast_and_refuse_control_characters(compiler):
    import xgrammar as xgr

    compiler.compile(StructuredOutput("json", json.dumps({"type": "string"}), "warm-up"))  # the child's one start
    spec = json.dumps({"type": "string", "minLength": 8000, "maxLength": 8000})
    started = time.perf_counter()
    compiled = compiler.compile(StructuredOutput("json", spec, "response_format"))
    assert time.perf_counter() - started < 5  # was 29 s of compiling as a {m,n} pattern; milliseconds now
    enum = compiler.compile(StructuredOutput("json", json.dumps({"enum": ["a\tb"], "maxLength": 1}), "x"))
    assert not xgr.GrammarMatcher(compiled).accept_string('"ab\x01')
    assert xgr.GrammarMatcher(compiled).accept_string('"' + "é" * 100)
    assert xgr.GrammarMatcher(enum).accept_string('"a\\tb"')  # const/enum literals are untouched


@pytest.mark.parametrize("kind,spec", [("regex", "(x*|x*x*)*b"), ("grammar", 'root ::= a* "b"\na ::= "x"* | "y"*')])
def test_ambiguous_constraints_are_too_complex(compiler, kind, spec):
    with pytest.raises(GrammarError) as info:
        compiler.compile(StructuredOutput(kind, spec, "guided_" + kind))
    assert info.value.code == TOO_COMPLEX and info.value.param == "guided_" + kind


@pytest.mark.parametrize("kind,spec", [("grammar", "root ::= a\na ::= a"), ("regex", "[^\\s\\S]")])
def test_a_constraint_that_accepts_nothing_is_refused(compiler, kind, spec):
    with pytest.raises(GrammarError, match="accepts no text|invalid"):
        compiler.compile(StructuredOutput(kind, spec, "p"))


def slow(n: int) -> str:
    """A schema whose compile takes seconds (a {n} pattern inside a JSON string: quadratic in n)."""
    return json.dumps({"type": "string", "pattern": f"^[a-z]{{{n}}}$"})


@pytest.fixture
def no_starvation(monkeypatch):
    """The limit is CPU time: on a loaded machine (the suite's other worker, the native builds) a low-priority
    compile may take many times its limit in wall time, which tests not about that must not have cut short."""
    monkeypatch.setattr("sluice.service.structured.grammar_compile.GRAMMAR_STARVED_AFTER", 100)


def compiler_with_its_worker(tok, **knobs):
    """(a one-worker compiler whose child has started, the zygote, that child's pid, the zygote's children that
    belong to compilers other tests made in this process)."""
    from sluice.service.structured.grammar_compile import start_zygote

    zygote = start_zygote()
    others = set(children(zygote.pid))
    c = compiler_for(tok, grammar_compile_workers=1, **knobs)
    c.compile(StructuredOutput("regex", "[0-9]", "warm"))
    (worker,) = set(children(zygote.pid)) - others
    return c, zygote, worker, others


def test_a_slow_compile_is_killed_at_its_time_limit_and_the_next_one_works(tok, no_starvation):
    c = compiler_for(tok, grammar_compile_timeout=0.3, grammar_compile_workers=1)
    c.compile(StructuredOutput("regex", "[0-9]", "warm"))  # the child's start is not part of the limit
    with pytest.raises(GrammarError) as info:  # it needs seconds of a core to finish
        c.compile(StructuredOutput("json", slow(4000), "guided_json"))
    assert info.value.code == TOO_COMPLEX and "more than 0.3 s of CPU time" in str(info.value)
    with pytest.raises(GrammarError):  # the refusal is remembered: no second 0.3 s
        c.compile(StructuredOutput("json", slow(4000), "other"))
    assert c.compile(StructuredOutput("regex", "[a-z]+", "after")) is not None


def test_the_limit_counts_cpu_time_and_a_starved_compile_is_busy_not_too_complex(tok):
    from sluice.service.structured.grammar import GrammarBusyError

    c, zygote, worker, _ = compiler_with_its_worker(tok, grammar_compile_timeout=0.3)
    os.kill(worker, signal.SIGSTOP)  # a machine's load at its extreme: the compile gets no CPU at all
    started = time.perf_counter()
    with pytest.raises(GrammarBusyError, match="too busy"):
        c.compile(StructuredOutput("regex", "[a-z]{3}", "guided_regex"))
    assert 4 * 0.3 <= time.perf_counter() - started < 10  # 0.3 s of wall time did not count as 0.3 s of work
    deadline = time.monotonic() + 2
    while worker in children(zygote.pid):  # killed: gone once the kernel has delivered the signal
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert c.compile(StructuredOutput("regex", "[a-z]{3}", "guided_regex")) is not None  # not remembered


def test_workers_and_the_zygote_killed_from_outside_are_replaced(tok):
    from sluice.service.structured.grammar_compile import start_zygote

    c, zygote, worker, others = compiler_with_its_worker(tok)
    os.kill(worker, signal.SIGKILL)  # an idle worker dies (the OOM killer), the next job comes before it is gone
    assert c.compile(StructuredOutput("regex", "[1-9]", "after its worker died")) is not None
    (worker,) = set(children(zygote.pid)) - others
    os.kill(zygote.pid, signal.SIGKILL)  # the zygote dies, then the worker: the next one comes from a new zygote
    os.kill(worker, signal.SIGKILL)
    time.sleep(0.2)
    assert c.compile(StructuredOutput("regex", "[2-9]", "after the zygote died")) is not None
    assert start_zygote() is not zygote and len(children(start_zygote().pid)) == 1


@pytest.mark.parametrize("deaths", [1, 2])
def test_a_worker_killed_mid_compile_is_replaced_once(tok, deaths, no_starvation):
    import threading

    c, zygote, worker, others = compiler_with_its_worker(tok)

    def kill_mid_compile() -> None:
        """SIGKILL the worker 0.2 s into its compile, then the next `deaths - 1` ones (the OOM killer)."""
        victim, seen, deadline = worker, others | {worker}, time.monotonic() + 10
        for killed in range(1, deaths + 1):
            time.sleep(0.2)
            os.kill(victim, signal.SIGKILL)
            while killed < deaths and not (fresh := set(children(zygote.pid)) - seen):
                if time.monotonic() > deadline:  # no fresh worker took the job: the compile has failed
                    return
                time.sleep(0.01)
            if killed < deaths:
                victim = fresh.pop()
                seen.add(victim)

    killer = threading.Thread(target=kill_mid_compile)
    killer.start()
    constraint = StructuredOutput("json", slow(2500), "guided_json")  # well over 0.2 s of a core
    if deaths == 1:  # one death may be the worker's own (killed while idle, seen only now): a fresh one compiles it
        assert c.compile(constraint) is not None
    else:  # two are the constraint's doing
        with pytest.raises(GrammarError, match="ended its compile process") as info:
            c.compile(constraint)
        assert info.value.code == TOO_COMPLEX
    killer.join()


def test_identical_compiles_share_a_job_a_full_queue_is_busy_and_abandoned_jobs_leave_it(tok):
    from sluice.service.structured.grammar import GrammarBusyError

    c = compiler_for(tok, grammar_compile_timeout=2, grammar_compile_workers=1, grammar_compile_queue=1)
    c.compile(StructuredOutput("regex", "[0-9]", "warm"))
    service = c._service
    running = service.submit(StructuredOutput("json", slow(3900), "a"))
    time.sleep(0.2)  # now running
    queued = service.submit(StructuredOutput("regex", "[ab]{2}", "b"))
    assert service.submit(StructuredOutput("regex", "[ab]{2}", "c")) is queued and queued.waiters == 2
    with pytest.raises(GrammarBusyError):
        service.submit(StructuredOutput("regex", "[cd]{2}", "d"))
    service.release(queued)
    service.release(queued)
    assert queued.future.cancelled()
    started = time.perf_counter()
    service.release(running)  # its only waiter left: the running compile is killed, not run to its limit
    with pytest.raises(GrammarError, match="abandoned"):
        running.future.result(timeout=5)
    assert time.perf_counter() - started < 1.5
    assert c.compile(StructuredOutput("regex", "[cd]{2}", "e")) is not None


def test_a_job_waits_in_the_queue_a_bounded_time_then_is_busy(tok, no_starvation):
    from sluice.service.structured.grammar import GrammarBusyError

    c, _, worker, _ = compiler_with_its_worker(tok, grammar_compile_timeout=5, grammar_queue_timeout=0.5)
    service = c._service
    os.kill(worker, signal.SIGSTOP)  # the only worker's compile goes on as long as the test needs
    running = service.submit(StructuredOutput("regex", "[a-z]{4}", "a"))
    time.sleep(0.2)
    started = time.perf_counter()
    queued = [service.submit(StructuredOutput("json", slow(3901 + i), f"q{i}")) for i in range(3)]
    assert service.submit(StructuredOutput("json", slow(3901), "joined")) is queued[0]  # one job, one deadline
    for job in queued:
        with pytest.raises(GrammarBusyError, match=r"waited more than 0.5 s .*--grammar-queue-timeout"):
            job.future.result(timeout=10)
    waited = time.perf_counter() - started
    assert 0.5 <= waited < 3 and running.future.running(), waited  # the compile ahead of them goes on
    with pytest.raises(GrammarBusyError, match="grammar-queue-timeout"):  # the blocking path: the same answer
        c.compile(StructuredOutput("regex", "[a-c]{3}", "sync"))
    assert not c._errors  # busy is not remembered as the constraint's fault
    service.release(running)  # killed, stopped as it is
    with pytest.raises(GrammarError, match="abandoned"):
        running.future.result(timeout=5)
    assert c.compile(StructuredOutput("json", slow(20), "q0")) is not None  # a fresh worker takes the next at once
    assert not service._queue and not service._jobs


def test_jobs_arriving_together_run_on_every_worker(tok):
    c = compiler_for(tok, grammar_compile_timeout=2, grammar_compile_workers=2)
    c.compile(StructuredOutput("regex", "[0-9]", "warm"))  # one thread, now idle
    service = c._service
    jobs = [service.submit(StructuredOutput("json", slow(3900 + i), f"j{i}")) for i in range(2)]
    time.sleep(0.3)  # the idle thread had no time to take the first before the second came
    assert all(job.future.running() for job in jobs)
    for job in jobs:
        service.release(job)


def test_the_cache_is_bounded_by_bytes(tok):
    def choices(i):
        return StructuredOutput("choice", json.dumps([f"option {i} {j} " + "x" * 40 for j in range(200)]), "c")

    one = compiler_for(tok)
    one.compile(choices(0))
    limit = one.cache_bytes * 3 + 1  # about three of them
    c = compiler_for(tok, grammar_cache_bytes=limit)
    for i in range(6):  # from the fourth on, each compile evicts the oldest
        c.compile(choices(i))
        assert c.cache_bytes <= limit
    assert 2 <= len(c._cache) <= 3  # the newest kept, the oldest dropped
    with pytest.raises(GrammarError) as info:
        compiler_for(tok, grammar_max_bytes=100).compile(
            StructuredOutput("json", json.dumps({"a": "x" * 200}), "tools"))
    assert info.value.code == TOO_COMPLEX and info.value.param == "tools"


# ---- the engine: impossible rows, min_tokens, the per-token budget -----------------------------------------------

@pytest.fixture(scope="module")
def engine(model_dir):
    from tests.support.tiny import tiny_engine

    return tiny_engine(model_dir, 64, max_num_batched_tokens=32)


def run(engine, rid, params, others=None):
    engine.add_request(rid, "Hello there", params)
    outs = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            (outs if o.request_id == rid else others if others is not None else []).append(o)
    return outs


def test_a_row_with_no_allowed_token_ends_with_an_error_not_token_0(engine):
    yes = engine.tokenizer.encode("yes", add_special_tokens=False)
    other = next(t for t in range(5, 200) if t not in yes)
    params = SamplingParams(max_tokens=8, temperature=0.0, allowed_token_ids=[other],
                            structured_output=StructuredOutput("choice", '["yes"]', "guided_choice"))
    outs = run(engine, "dead", params)
    assert outs[-1].finish_reason == "error" and outs[-1].error_code == "constraint_error"
    assert "guided_choice and allowed_token_ids" in outs[-1].error
    assert not any(0 in o.token_ids for o in outs) and not engine.grammar.matchers


def test_the_grammars_end_wins_over_min_tokens(engine):
    params = SamplingParams(max_tokens=20, min_tokens=15, temperature=0.0,
                            structured_output=StructuredOutput("choice", '["yes"]', "guided_choice"))
    outs = run(engine, "short", params)
    assert outs[-1].finish_reason == "stop" and "".join(o.text for o in outs) == "yes"


def test_a_row_over_its_grammar_budget_ends_and_its_neighbour_goes_on(engine):
    state = engine.grammar
    state._budget = 0.0  # every token is over: the row ends after STRIKES tokens
    try:
        engine.add_request("free", "Hello", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        free = []
        outs = run(engine, "costly", SamplingParams(max_tokens=30, temperature=0.0,
                                                    structured_output=StructuredOutput("regex", "[a-z ]+", "re")),
                   free)
    finally:
        state._budget = engine.config.grammar.grammar_token_budget_ms / 1000
    assert outs[-1].error_code == "constraint_error" and "per token" in outs[-1].error and "re" in outs[-1].error
    assert sum(len(o.token_ids) for o in outs) == 2  # the third token over budget ends it
    assert free[-1].finish_reason == "length" and sum(len(o.token_ids) for o in free) == 12


# ---- masks ---------------------------------------------------------------------------------------------------

def test_masks_started_before_the_forward_fill_on_the_worker_and_match_the_inline_fill(compiler, tok, monkeypatch):
    import threading

    import torch

    from sluice.scheduling.output import ScheduledRequest
    from sluice.service.structured import grammar as grammar_module
    from sluice.service.structured.grammar import GrammarState

    threads = []
    fill = grammar_module._fill
    monkeypatch.setattr(grammar_module, "_fill", lambda *a: threads.append(threading.current_thread().name) or fill(*a))
    state = GrammarState(compiler, 4)
    params = SamplingParams(max_tokens=8)
    for rid, spec in (("a", "[0-9]+"), ("b", "(yes|no)")):
        state.add(rid, StructuredOutput("regex", spec, "re"))
    rows = [ScheduledRequest(rid, [1], 3, [0], True, params, 0) for rid in ("a", "free", "b")]
    state.start_masks(rows)
    early = torch.zeros(3, len(tok))
    state.mask_logits(early, rows)
    assert threads == ["sluice-grammar-mask_0"]  # the fill ran beside the forward, and mask_logits waited for it
    inline = torch.zeros(3, len(tok))
    state.mask_logits(inline, rows)  # no fill started for these rows: it fills in place
    assert threads[-1] == threading.current_thread().name
    assert torch.equal(early, inline) and torch.isinf(early[0]).any() and not torch.isinf(early[1]).any()
    digits = {i for i in range(len(tok)) if early[0, i] == 0}
    assert digits and all(tok.decode([i]).strip().isdigit() for i in digits)
    assert set(state._mask_seconds) == {"a", "b"}  # each row's fill is charged to its own grammar budget
