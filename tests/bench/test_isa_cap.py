"""`bench peers --isa avx2`: both servers held to AVX2 and FMA on a CPU that has more (llama.cpp's build options,
Sluice's -march and torch's caps, the float pair), and $SLUICE_NATIVE_MARCH building the kernels for that level."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from sluice import native
from sluice.service.bench import isa_cap
from sluice.service.bench.llama_cpp import cmake_isa_options
from tests.support.kernels import has_avx2

ZEN4 = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "sse4_2"}


def test_the_avx2_cap_keeps_avx2_and_fma_for_both_servers():
    kept = set(isa_cap.capped(ZEN4, "avx2"))
    assert kept == {"avx", "avx2", "fma", "f16c"} and set(isa_cap.capped(ZEN4, "native")) == ZEN4
    options = cmake_isa_options(kept)
    assert "-DGGML_AVX2=ON" in options and "-DGGML_FMA=ON" in options
    assert "-DGGML_AVX512=OFF" in options and "-DGGML_AVX512_BF16=OFF" in options
    env = isa_cap.server_env("avx2")
    assert env["SLUICE_NATIVE_MARCH"] == "x86-64-v3" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and isa_cap.server_env("native") == {}
    assert "avx512_bf16" in isa_cap.describe("avx2", ZEN4) and isa_cap.describe("native", ZEN4) == ""


def test_a_cap_this_cpu_cannot_run_or_does_not_know_is_refused():
    with pytest.raises(ValueError, match="needs a CPU with avx2, f16c, fma"):
        isa_cap.check("avx2", {"avx", "sse4_2"})
    with pytest.raises(ValueError, match="unknown --isa"):
        isa_cap.check("avx10", ZEN4)
    isa_cap.check("avx2", ZEN4)
    isa_cap.check("native", set())


def test_capped_float_pair_leaves_bf16_to_the_cpus_that_have_it(monkeypatch, capsys):
    from sluice.service.bench import add_bench_subcommands, llama_cpp

    monkeypatch.setattr(isa_cap, "native_bf16_flags", lambda: ["avx512_bf16"])
    monkeypatch.setattr(llama_cpp, "cpu_flags", lambda: ZEN4)
    assert isa_cap.bf16_flags("native") == ["avx512_bf16"] and isa_cap.bf16_flags("avx2") == []
    parser = argparse.ArgumentParser()
    add_bench_subcommands(parser.add_subparsers(dest="command"))
    for isa, present, absent in (("native", "135m Sluice bf16", "llama.cpp F16"),
                                 ("avx2", "135m llama.cpp F16", "BF16")):
        args = parser.parse_args(["bench", "peers", "--estimate", "--sizes", "135m", "--d-sizes", "none", "--isa", isa])
        assert args.func(args) == 0
        out = capsys.readouterr().out
        assert present in out and absent not in out
    args = parser.parse_args(["bench", "peers", "--estimate", "--sizes", "135m", "--isa", "sse"])
    assert args.func(args) == 2 and "unknown --isa" in capsys.readouterr().err


def test_native_march_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    assert native.cflags() == ("-O3", "-march=native")
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    assert native.cflags() == ("-O3", "-march=x86-64-v3")
    monkeypatch.setenv(native.MARCH_ENV, "native -fplugin=x.so")
    with pytest.raises(ValueError, match="not an -march name"):
        native.cflags()


@pytest.mark.deep  # the whole extension built once more, for x86-64-v3
@pytest.mark.skipif(not has_avx2(), reason="needs a CPU that runs x86-64-v3")
def test_kernels_built_for_x86_64_v3_take_their_avx2_paths():
    code = ("from sluice import native; ops = native.load(); "
            "print(ops.paged_decode_isa(), ops.int4_linear_isa(), ops.bf16_linear_is_native())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200,
                         env={**os.environ, **isa_cap.server_env("avx2")})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["avx2", "avx2", "False"]
