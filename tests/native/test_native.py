"""The one native extension (sluice/native.py): one line says what was built, and without it the engine serves
on the pure-torch fallbacks."""

from __future__ import annotations

import logging

import pytest

from sluice import native
from sluice.scheduling.sampling_params import SamplingParams
from tests.support.tiny import tiny_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["Hello world", "The cat sat on", "one two three four five six"]


def serve(model_dir):
    """Greedy outputs of the tiny engine for PROMPTS, and the engine."""
    engine = tiny_engine(model_dir, 64)
    return [c.token_ids for c in engine.generate(PROMPTS, GREEDY)], engine


@pytest.fixture
def fresh_load():
    """native.load() forgets its cached result before and after the test (the real build loads from disk again)."""
    native.load.cache_clear()
    yield
    native.load.cache_clear()


def test_one_line_says_what_the_extension_holds(fresh_load, caplog):
    with caplog.at_level(logging.INFO, logger="sluice.native"):
        ops = native.load()
    if ops is None:
        pytest.skip("no C++ compiler here")
    (line,) = [r.getMessage() for r in caplog.records if r.name == "sluice.native"]
    assert line.startswith("native kernels: ") and ops.__name__ in line and "decode attention" in line


def test_without_a_compiler_the_engine_serves_on_the_torch_fallbacks(model_dir, fresh_load, monkeypatch, caplog,
                                                                      tmp_path):
    with_kernels, engine = serve(model_dir)
    native.load.cache_clear()
    with monkeypatch.context() as patch:
        patch.setenv("CXX", str(tmp_path / "no-such-compiler"))
        with caplog.at_level(logging.INFO, logger="sluice.native"):
            without, fallback = serve(model_dir)
        assert native.load() is None and fallback.runner.decode_kernel is None
    assert "native kernels: no C++ compiler" in caplog.text and "pure-torch fallback" in caplog.text
    assert len([r for r in caplog.records if r.name == "sluice.native"]) == 1  # one line, however many layers ask
    # float32 sums in another order: on this random model the greedy tokens still agree
    assert without == with_kernels and all(len(t) == GREEDY.max_tokens for t in without)
    if native.load.__wrapped__() is not None:
        assert engine.runner.decode_kernel is not None


def test_a_failed_build_is_one_warning_and_no_extension(fresh_load, monkeypatch, caplog):
    def broken(cflags):
        raise RuntimeError("Error building extension: int4_linear.cpp:1: error")

    monkeypatch.setattr(native, "build", broken)
    with caplog.at_level(logging.INFO, logger="sluice.native"):
        assert native.load() is None
    assert "native kernels: the build failed (Error building extension" in caplog.text
    assert "every CPU kernel runs its pure-torch fallback" in caplog.text
