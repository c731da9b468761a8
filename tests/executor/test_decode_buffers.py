"""A decode step's inputs live in persistent buffers (service/executor/decode_buffers.py): the same storage for every
decode step whatever its batch size, padded rows that change nothing, and a capture hook per batch size."""

from __future__ import annotations

import os

import pytest

from sluice.service.executor.decode_buffers import capture_sizes
from sluice.service.executor.forward_context import get_forward_context
from tests.support.parity import hf_greedy
from tests.support.runner import Driver, make_runner, prompts, tiny_pair

N_NEW = 6


def test_capture_sizes_are_vllms():
    assert capture_sizes(1) == [1]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def record_inputs(runner):
    """Wraps the model's forward: per call, the addresses of every decode input it reads and the rows it got."""
    seen = []
    forward = runner.model.compute_logits

    def compute_logits(input_ids, positions, rows):
        meta = get_forward_context().attn_metadata
        if meta.max_seqlen_q == 1:  # a decode step (with the C kernel, a prompt's rows are decode rows too)
            seen.append(dict(ptrs=(input_ids.data_ptr(), positions.data_ptr(), meta.slot_mapping.data_ptr(),
                                   meta.block_tables.data_ptr(), meta.decode.seq_lens.data_ptr(),
                                   meta.decode.tables.data_ptr()), rows=input_ids.shape[0]))
        return forward(input_ids, positions, rows)

    runner.model.compute_logits = compute_logits
    return seen


def decode_three_then_two(runner):
    """Prefill a, b, c; decode all three, then a and c only (b done): the greedy outputs, the prompts and every
    block the sequences held."""
    p = prompts()
    driver = Driver(runner)
    for rid in "abc":
        driver.add(rid, p[rid])
    driver.step({rid: None for rid in "abc"})
    for _ in range(3):
        driver.step({rid: 1 for rid in "abc"})
    while any(len(driver.outputs(r)) < N_NEW for r in "ac"):
        driver.step({r: 1 for r in "ac"})
    return {rid: driver.outputs(rid) for rid in "abc"}, p, {b for blocks in driver.blocks.values() for b in blocks}


def test_decode_steps_of_different_sizes_reuse_the_same_storage():
    reference, model = tiny_pair("llama")
    runner = make_runner(model)
    seen = record_inputs(runner)
    outputs, p, _ = decode_three_then_two(runner)
    buffers = runner.decode_buffers
    assert [s["rows"] for s in seen] == [3, 3, 3, 2, 2]  # on CPU the rows are the step's own: no padding
    want = (buffers.input_ids.data_ptr(), buffers.positions.data_ptr(), buffers.slot_mapping.data_ptr(),
            buffers.block_tables.data_ptr(), buffers.seq_lens.data_ptr(), buffers.block_tables.data_ptr())
    assert all(s["ptrs"] == want for s in seen)
    assert outputs["a"] == hf_greedy(reference, p["a"], N_NEW) and outputs["c"] == hf_greedy(reference, p["c"], N_NEW)
    assert outputs["b"] == hf_greedy(reference, p["b"], 4)


def test_padded_rows_change_no_output_and_touch_only_the_scratch_block():
    _, model = tiny_pair("qwen3")
    plain = make_runner(model)
    want, _, _ = decode_three_then_two(plain)
    _, model = tiny_pair("qwen3")
    runner = make_runner(model)
    runner.decode_buffers.pad = True  # as on CUDA, where the sizes are the captured graphs'
    seen = record_inputs(runner)
    got, _, held = decode_three_then_two(runner)
    assert [s["rows"] for s in seen] == [4, 4, 4, 2, 2]  # 3 decodes padded to 4; 2 is a size of its own
    assert got == want
    scratch = runner.num_kv_blocks  # one block past the pool's
    # row 3 of the padded steps wrote its K/V to the scratch block; the blocks no sequence holds are still zero
    assert runner.kv.kv[:, :, scratch].abs().sum() > 0
    untouched = sorted(set(range(runner.num_kv_blocks)) - held)
    assert untouched and runner.kv.kv[:, :, untouched].abs().sum() == 0
    assert runner.decode_buffers.seq_lens[3].item() == 1 and runner.decode_buffers.block_tables[3, 0] == scratch


def test_capture_hook_runs_every_size_on_the_same_buffers():
    reference, model = tiny_pair("llama")
    runner = make_runner(model)
    runner.decode_buffers.pad = True
    captured = []

    def capture(size, run):
        logits = run()
        captured.append((size, tuple(logits.shape), runner.decode_buffers.input_ids[:size].data_ptr()))

    runner.capture_decode(capture)
    vocab = model.config.vocab_size
    ptr = runner.decode_buffers.input_ids.data_ptr()
    assert captured == [(size, (size, vocab), ptr) for size in reversed(runner.decode_buffers.sizes)]
    outputs, p, _ = decode_three_then_two(runner)  # what capture left in the buffers does not leak into a real step
    assert outputs["a"] == hf_greedy(reference, p["a"], N_NEW)


class ReplayingGraphs:
    """DecodeGraphs' contract without CUDA: capture keeps run(), replay calls that same closure again (its metadata
    built once, at capture), as a replayed graph reruns what it recorded on whatever the buffers hold."""

    def __init__(self, max_size: int) -> None:
        self.runs, self.replays, self.max_size = {}, [], max_size

    def __contains__(self, size):
        return size in self.runs

    def capture(self, size, run):
        if size <= self.max_size:
            self.runs[size] = run

    def replay(self, size):
        self.replays.append(size)
        return self.runs[size]()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_decode_steps_replayed_from_their_capture_read_each_steps_inputs(arch):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter off (tests/conftest.py turns it on where there is no GPU)")
    reference, model = tiny_pair(arch)
    runner = make_runner(model)
    runner.decode_buffers.pad = True
    runner.decode_tables = True  # as on CUDA: the attention reads lengths and tables from the buffers
    graphs = ReplayingGraphs(max_size=4)
    runner.capture_decode(graphs.capture)
    runner.graphs = graphs
    outputs, p, _ = decode_three_then_two(runner)
    assert graphs.replays == [4, 4, 4, 2, 2]  # every decode step replayed: 3 rows padded to 4, then 2
    assert outputs["a"] == hf_greedy(reference, p["a"], N_NEW) and outputs["c"] == hf_greedy(reference, p["c"], N_NEW)
    assert outputs["b"] == hf_greedy(reference, p["b"], 4)


def test_a_capture_that_fails_leaves_decode_steps_eager(monkeypatch, caplog):
    import logging

    import torch

    from sluice.service.executor import cuda_graphs

    _, model = tiny_pair("llama")
    runner = make_runner(model)

    def broken(capture):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(runner, "capture_decode", broken)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)  # what the failure path waits on
    with caplog.at_level(logging.WARNING, logger="sluice.engine"):
        assert cuda_graphs.capture_decode_graphs(runner) is None
    assert "CUDA graphs: capture failed (RuntimeError: operation not permitted" in caplog.text
    assert "decode steps run eagerly" in caplog.text
