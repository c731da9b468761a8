"""`--dtype auto`: bf16 on CPUs with a native bf16 matmul (AMX, AVX-512 BF16), fp32 elsewhere; bf16 runs the torch
decode path without prepacking. The CPU is faked: these tests pass the same on any machine."""

from __future__ import annotations

import ast
import logging
import re
from collections import Counter

import pytest
import torch

from sluice import native
from sluice.cpu import native_bf16_flags
from sluice.service.config import SluiceConfig
from sluice.service.executor import model_loader
from sluice.service.executor.layers.linear import PlainLinear
from sluice.service.executor.layers.packed_linear import PackedLinear
from sluice.service.executor.model_loader import auto_dtype, resolve_device_dtype

CPU = torch.device("cpu")


def cpuinfo(tmp_path, flags: str):
    path = tmp_path / "cpuinfo"
    block = f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 {flags}\n\n"
    path.write_text(block + block.replace(": 0", ": 1"))
    return path


@pytest.mark.parametrize("flags,want", [
    ("avx512f avx512_bf16", ["avx512_bf16"]),
    ("amx_tile amx_bf16 avx512_bf16", ["amx_bf16", "avx512_bf16"]),
    ("avx512f avx512_vnni", []),  # AVX-512 alone is not a bf16 matmul
    ("", []),
])
def test_native_bf16_flags_from_cpuinfo(tmp_path, flags, want):
    assert native_bf16_flags(cpuinfo(tmp_path, flags)) == want


def test_no_cpuinfo_asks_torch(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert native_bf16_flags(tmp_path / "absent") == ["avx512_bf16"]
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    assert native_bf16_flags(tmp_path / "absent") == []


def logged_gemv_rows(log: str) -> dict[int, int]:
    """What the start-up log says of the packed linears' GEMV: {most rows: linears} (each shape measured here)."""
    logged = re.search(r"read by the packed-layout GEMV: (\{[^}]*\}|none)", log).group(1)
    return {} if logged == "none" else ast.literal_eval(logged)


def packed_gemv_rows(eng) -> dict[int, int]:
    """The engine's packed linears counted by the most rows their GEMV takes (those that take none left out)."""
    return dict(Counter(m.method.max_rows for m in eng.model.modules()
                        if isinstance(m, PackedLinear) and m.method.max_rows))


def fake_cpu(monkeypatch, flags: list[str]):
    monkeypatch.setattr(model_loader, "native_bf16_flags", lambda: list(flags))


def test_auto_is_bf16_only_with_a_native_bf16_matmul(monkeypatch):
    fake_cpu(monkeypatch, ["amx_bf16"])
    dtype, why = auto_dtype(CPU)
    assert dtype == torch.bfloat16 and "amx_bf16" in why
    assert resolve_device_dtype("cpu", "auto") == (CPU, torch.bfloat16)
    assert resolve_device_dtype("cpu", "float32") == (CPU, torch.float32)  # explicit wins
    fake_cpu(monkeypatch, [])
    dtype, why = auto_dtype(CPU)
    assert dtype == torch.float32 and "no native bf16" in why
    assert resolve_device_dtype("cpu", "auto") == (CPU, torch.float32)


def tiny_dir(tmp_path_factory):
    from tests.support.tiny import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def engine(model_dir, dtype: str, model=None, tokenizer=None, prepack_weights: bool = True):
    from sluice.service.engine.engine import LLMEngine

    cfg = SluiceConfig()
    cfg.model.model, cfg.model.device, cfg.model.dtype = model_dir, "cpu", dtype
    cfg.model.prepack_weights = prepack_weights
    cfg.cache.num_kv_blocks = 32
    return LLMEngine(cfg, model=model, tokenizer=tokenizer)


def packed(eng) -> int:
    return sum(isinstance(m, PackedLinear) for m in eng.model.modules())


def test_bf16_engine_packs_where_bf16_is_native_and_still_generates(tmp_path_factory, monkeypatch, caplog):
    from sluice.scheduling.sampling_params import SamplingParams
    from sluice.service.executor import packed_gemv

    fake_cpu(monkeypatch, ["avx512_bf16"])
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        eng = engine(tiny_dir(tmp_path_factory), "auto")
    assert eng.dtype == torch.bfloat16 and eng.model.dtype == torch.bfloat16
    assert eng.runner.kv.kv.dtype == torch.bfloat16
    assert eng.runner.decode_kernel.ops is native.load()  # it reads bf16 caches too
    assert "dtype auto: bfloat16 on cpu, as the CPU multiplies bf16 natively (avx512_bf16)" in caplog.text
    # the GEMVs are built for the real CPU: they exist only with real AVX512_BF16, and only then is bf16 packed
    bf16_native = packed_gemv.bf16_native()
    assert (packed(eng) > 0) == bf16_native
    plain = [m for m in eng.model.modules() if isinstance(m, PlainLinear)]
    # the tied head, or every linear
    assert plain and all(m.method.pad and m.method.decode_kernel == bf16_native for m in plain)
    if bf16_native:
        assert all(m.method.gemv_layout for m in eng.model.modules() if isinstance(m, PackedLinear))
        assert logged_gemv_rows(caplog.text) == packed_gemv_rows(eng)
    else:
        assert "model path: Sluice's own Llama-family forward; linears plain" in caplog.text
    (out,) = eng.generate(["Hello world"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 6


def test_fp32_engine_prepacks_and_reads_the_packed_layout_when_decoding(tmp_path_factory, monkeypatch, caplog):
    from sluice.service.executor.layers.packed_linear import can_prepack

    fake_cpu(monkeypatch, [])
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        eng = engine(tiny_dir(tmp_path_factory), "auto")
    assert eng.dtype == torch.float32 and "dtype auto: float32 on cpu" in caplog.text
    assert (packed(eng) > 0) == can_prepack(CPU, torch.float32)
    if native.load() is not None and packed(eng):
        assert all(m.method.gemv_layout for m in eng.model.modules() if isinstance(m, PackedLinear))
        assert logged_gemv_rows(caplog.text) == packed_gemv_rows(eng)


def test_fp32_engine_without_prepacking_runs_plain_weights(tmp_path_factory, monkeypatch):
    from sluice.service.executor.layers.linear import decode_kernel_wins

    fake_cpu(monkeypatch, [])
    eng = engine(tiny_dir(tmp_path_factory), "float32", prepack_weights=False)
    linears = [m for m in eng.model.modules() if isinstance(m, PlainLinear)]
    assert packed(eng) == 0 and linears
    assert all(m.method.decode_kernel == decode_kernel_wins(torch.float32) for m in linears)


def test_a_given_model_keeps_its_own_precision_under_auto(tmp_path_factory, monkeypatch):
    fake_cpu(monkeypatch, ["amx_bf16"])  # auto would pick bf16 for a model it loads itself ...
    path = tiny_dir(tmp_path_factory)
    model, tok = model_loader.load_model(path, "cpu", "float32")
    eng = engine(path, "auto", model=model, tokenizer=tok)  # ... but a given fp32 model stays fp32, KV included
    assert eng.dtype == torch.float32 and eng.runner.kv.kv.dtype == torch.float32


def test_padded_linears_compute_the_same_on_a_few_row_counts(monkeypatch):
    from sluice.service.executor.layers.linear import padded_rows

    torch.manual_seed(0)
    plain = [torch.nn.Linear(8, 12).to(torch.bfloat16), torch.nn.Linear(12, 5, bias=False).to(torch.bfloat16)]
    model = torch.nn.Sequential(*(PlainLinear(m.weight.detach(), None if m.bias is None else m.bias.detach(),
                                              pad=True) for m in plain))
    assert model[0].weight.data_ptr() == plain[0].weight.data_ptr()  # the same weight: nothing copied
    with torch.inference_mode():
        cases = [torch.randn(2, rows, 8, dtype=torch.bfloat16) for rows in (1, 3, 17, 100)]
        wants = [plain[1](plain[0](x)) for x in cases]
        seen = []
        real = torch.nn.functional.linear
        monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: seen.append(x.shape) or real(x, w, b))
        for x, want in zip(cases, wants, strict=True):
            torch.testing.assert_close(model(x), want)
    # oneDNN builds a kernel per row count it sees: only padded ones reach it (2 x 17 = 34 rows run as 48)
    assert [shape[0] for shape in seen] == [padded_rows(2 * r) for r in (1, 3, 17, 100) for _ in range(2)]
    assert all(len(shape) == 2 for shape in seen) and 48 in [shape[0] for shape in seen]
