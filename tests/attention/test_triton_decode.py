"""The Triton kernels of the CUDA path, run here in Triton's interpreter: the decode kernel that CUDA graphs capture
(service/attention/triton_decode.py) and the whole-step kernel (service/attention/triton_varlen.py), every row
against the dense float64 reference, over block sizes smaller and larger than a tile, query groups that are not
powers of two, sliding windows and softcaps. (The interpreter's bfloat16 dot is wrong, so the 16-bit path runs in
float16 here; bfloat16 is checked on a GPU by `make gpu-check`.)"""

from __future__ import annotations

import os

import pytest
import torch

from sluice.service.attention import triton_decode, triton_varlen
from sluice.service.attention.paged_attention import AttentionMetadata, paged_attention, write_kv
from sluice.service.bench.gpu_attention import paged_attention_case

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it
    pytest.skip("no GPU and Triton's interpreter off", allow_module_level=True)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DECODES = [(37, 1), (5, 1), (0, 1), (64, 1), (300, 1), (127, 1)]


@pytest.mark.parametrize(("block_size", "heads", "kv_heads", "head_dim", "window", "softcap", "dtype"), [
    (16, 8, 2, 16, None, None, torch.float32),
    (4, 9, 3, 64, None, None, torch.float32),  # blocks far smaller than a tile; a group of 3 padded to 16
    (128, 4, 4, 32, None, None, torch.float32),  # a block larger than a tile
    (16, 8, 2, 16, 8, None, torch.float32),
    (16, 8, 2, 16, 100, None, torch.float32),  # a window the tile loop starts inside of
    (16, 4, 4, 32, None, 5.0, torch.float32),
    (16, 8, 2, 64, None, None, torch.float16),
    (32, 32, 4, 64, 70, None, torch.float16),
])
def test_each_row_matches_dense_attention(block_size, heads, kv_heads, head_dim, window, softcap, dtype):
    q, k, v, kc, vc, args, expected = paged_attention_case(DECODES, block_size, DEVICE, dtype, 3, window, softcap,
                                                           heads, kv_heads, head_dim)
    write_kv(k, v, kc, vc, args[3])
    out = triton_decode.paged_decode(q, kc, vc, args[2], torch.tensor(args[1], device=DEVICE), head_dim ** -0.5,
                                     window, softcap)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    assert (out.double() - expected).abs().max().item() < tolerance


def test_metadata_on_the_buffers_routes_decodes_to_the_kernel_and_stores_the_new_kv():
    q, k, v, kc, vc, args, expected = paged_attention_case(DECODES, 16, DEVICE, torch.float32, 5)
    query_lens, seq_lens, tables, slots, block_size = args
    meta = AttentionMetadata.for_decode_tables(
        tables.long(), torch.tensor(seq_lens, device=DEVICE), slots, block_size, 4096)
    assert meta.cu_seqlens_k.tolist() == [0, *torch.tensor(seq_lens, device=DEVICE).cumsum(0).tolist()]
    out = paged_attention(q, k, v, kc, vc, meta, q.shape[-1] ** -0.5)
    assert meta.backend == "triton"
    assert torch.equal(kc.flatten(0, 1)[slots], k) and torch.equal(vc.flatten(0, 1)[slots], v)
    assert (out.double() - expected).abs().max().item() < 1e-5


def test_a_cache_of_another_dtype_is_refused():
    q, _, _, kc, vc, args, _ = paged_attention_case(DECODES[:2], 16, DEVICE, torch.float32, 0)
    with pytest.raises(ValueError, match="dtype"):
        triton_decode.paged_decode(q, kc.half(), vc.half(), args[2], torch.tensor(args[1], device=DEVICE), 0.25)


MIXES = {
    "prefill_only": [(0, 29)],
    "chunk_with_context": [(40, 23)],
    "mixed": [(33, 1), (0, 17), (12, 1), (20, 9), (0, 1), (50, 1)],
    "decodes_then_prefills": [(3, 1), (70, 1), (16, 16), (0, 5)],
    "longer_than_a_tile": [(100, 130), (0, 70)],
}


@pytest.fixture
def triton_backend(monkeypatch):
    """The triton backend selectable here (on CPU: the interpreter; real CUDA needs no patch)."""
    monkeypatch.setattr(triton_decode, "available", lambda device: True)


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize(("block_size", "heads", "kv_heads", "head_dim", "window", "softcap", "dtype"), [
    (16, 8, 2, 16, None, None, torch.float32),
    (4, 9, 3, 64, None, None, torch.float32),
    (16, 8, 2, 16, 8, None, torch.float32),  # windows shorter than a query tile: rows see nothing at first
    (64, 4, 4, 32, None, 5.0, torch.float32),
    (16, 2, 1, 16, None, None, torch.float32),  # no grouping: 64 tokens a tile
    (16, 8, 2, 64, 20, None, torch.float16),
])
def test_a_whole_step_in_one_launch_matches_dense_attention(triton_backend, mix, block_size, heads, kv_heads,
                                                            head_dim, window, softcap, dtype):
    q, k, v, kc, vc, args, expected = paged_attention_case(MIXES[mix], block_size, DEVICE, dtype, 1, window, softcap,
                                                           heads, kv_heads, head_dim)
    meta = AttentionMetadata.build(*args, backend="triton")
    assert meta.backend == "triton" and meta.varlen is not None
    out = paged_attention(q, k, v, kc, vc, meta, head_dim ** -0.5, window, softcap)
    assert torch.equal(kc.flatten(0, 1)[args[3]], k) and torch.equal(vc.flatten(0, 1)[args[3]], v)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    assert (out.double() - expected).abs().max().item() < tolerance


def test_tiles_cover_every_query_once_and_never_span_two_sequences():
    query_lens, seq_lens = [1, 130, 64, 65, 3], [40, 130, 70, 65, 3]
    cu_q = [0, 1, 131, 195, 260, 263]
    step = triton_varlen.VarlenStep(query_lens, seq_lens, cu_q)
    for group in (1, 3, 8, 128):
        plan = step.plan_for(group, DEVICE)
        assert step.plan_for(group, DEVICE) is plan  # built once a step, shared by the layers
        assert plan.block_m * triton_decode.pow2(group, 1) >= min(64, triton_decode.pow2(group, 1))
        covered = [(s, f + i) for s, f in zip(plan.tile_seq.tolist(), plan.tile_first.tolist(), strict=True)
                   for i in range(plan.block_m) if f + i < query_lens[s]]
        assert sorted(covered) == [(s, i) for s, n in enumerate(query_lens) for i in range(n)]
        assert plan.q_start.tolist() == cu_q[:-1] and plan.seq_lens.tolist() == seq_lens


@pytest.mark.deep  # slow (builds or a long end-to-end run): `make test-deep`
@pytest.mark.parametrize("arch", ["mistral", "qwen3"])  # Llama with a window; per-head q/k norms
def test_greedy_parity_with_generate_on_the_triton_backend(triton_backend, monkeypatch, arch):
    """The engine end to end as on CUDA (chunked prefill over cached context, prefix hits, preemption; Mistral's
    window, Qwen3's q/k norms): prompt chunks in the whole-step kernel, decode steps in the decode kernel on the
    persistent buffers, RMSNorm, rotary and the gated activation in the layers' Triton kernels."""
    if os.environ.get("TRITON_INTERPRET") != "1":  # a GPU machine: its kernels do not take the CPU engine's tensors
        pytest.skip("runs the CPU engine through Triton's interpreter")
    from sluice.scheduling.sampling_params import SamplingParams
    from sluice.service.cli import build_parser
    from sluice.service.config import config_from_args
    from sluice.service.engine.engine import LLMEngine
    from sluice.service.executor.layers import triton_ops
    from tests.support import tiny
    from tests.support.parity import reference_case

    cfg = config_from_args(build_parser().parse_args(
        ["serve", "--attention-backend", "triton", "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "24",
         "--max-num-batched-tokens", "64", "--max-num-seqs", "16"]))
    ours, prompts, expected = reference_case(arch)
    engine = LLMEngine(cfg, model=ours, tokenizer=tiny.tokenizer())
    assert engine.runner.attention_backend == "triton" and engine.runner.decode_tables
    monkeypatch.setattr(triton_ops, "applies", lambda x: True)
    calls = {"paged_varlen": 0, "paged_decode": 0, "rms_norm": 0, "rotary": 0, "silu_and_mul": 0}
    for module, name in ((triton_varlen, "paged_varlen"), (triton_decode, "paged_decode"), (triton_ops, "rms_norm"),
                         (triton_ops, "rotary"), (triton_ops, "silu_and_mul")):
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    results = engine.generate(prompts[:8], SamplingParams(max_tokens=12, temperature=0.0))
    assert all(calls.values()), calls
    for got, want in zip(results, expected[:8], strict=True):
        assert got.token_ids == want[:12]


def test_every_array_of_a_plan_starts_16_byte_aligned():
    """Triton specializes on pointer alignment: a step whose counts moved an array off 16 bytes would compile the
    kernel again (seconds of a burst's first tokens on a GPU)."""
    for num_seqs in range(1, 7):
        query_lens = [1 + 7 * i for i in range(num_seqs)]
        cu_q = [0]
        for n in query_lens:
            cu_q.append(cu_q[-1] + n)
        plan = triton_varlen.plan(query_lens, [n + 3 for n in query_lens], cu_q, 3, DEVICE)
        arrays = (plan.tile_seq, plan.tile_first, plan.q_start, plan.q_lens, plan.seq_lens)
        assert all(a.data_ptr() % 16 == 0 for a in arrays)
        assert plan.q_lens.tolist() == query_lens and plan.q_start.tolist() == cu_q[:-1]
