"""The one native extension (sluice/native.py): one line says what was built, and without it the engine serves
on the pure-torch fallbacks."""

from __future__ import annotations

import logging

import pytest
import torch

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


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_without_a_compiler_quantized_weights_serve_on_dequantized_tiles(model_dir, fresh_load, monkeypatch,
                                                                          tmp_path, quantization):
    """int4 / int8 keep their GGUF blocks as stored (Q4_1 not repacked: no kernel to read the packing), dequantize a
    tile at a time in torch, and skip the C++ layer: the engine still serves."""
    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine
    from sluice.service.executor.layers.gguf_linear import GgufLinear

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    config = SluiceConfig()
    config.model.model, config.model.quantization, config.cache.num_kv_blocks = model_dir, quantization, 64
    engine = LLMEngine(config)
    linears = [m for m in engine.model.modules() if isinstance(m, GgufLinear)]
    assert linears and all(m.method.kernel is None and not m.method.packed for m in linears)
    assert {b.dtype for m in linears for b in m.buffers()} == {torch.uint8}  # the blocks only, no float copy
    assert all(layer._layer_ops is None for layer in engine.model.layers)
    outputs = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    assert all(len(t) == GREEDY.max_tokens for t in outputs)


@pytest.mark.parametrize(("banner", "gcc"), [
    ("c++ (Debian 12.2.0-14) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc.", True),
    ("Apple clang version 15.0.0 (clang-1500.3.9.4)\nTarget: arm64-apple-darwin23.4.0", False),
    ("Ubuntu clang version 17.0.6\nInstalledDir: /usr/bin", False),
])
def test_gcc_alone_gets_its_scheduling_flags(tmp_path, banner, gcc):
    compiler = tmp_path / "c++"
    compiler.write_text(f"#!/bin/sh\nprintf '%s\\n' '{banner}'\n")
    compiler.chmod(0o755)
    assert native.is_gcc(str(compiler)) is gcc
    assert native.is_gcc(str(tmp_path / "missing")) is False
