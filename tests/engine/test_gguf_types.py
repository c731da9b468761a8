"""--quantization gguf: each linear in its GGUF file's own type, checked against the file's raw blocks."""

from __future__ import annotations

import numpy as np
import pytest

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.config import SluiceConfig
from sluice.service.engine import gguf_types
from sluice.service.engine.engine import LLMEngine
from sluice.service.engine.int4_linear import Int4Linear
from sluice.service.engine.int8_linear import Int8Linear
from sluice.service.engine.model_loader import fetch_default_gguf
from tests.support import tiny
from tests.support.parity import build_pair


def _raw_blocks(reader, name: str, block_bytes: int) -> np.ndarray:
    tensor = next(t for t in reader.tensors if t.name == name)
    rows = np.asarray(tensor.data)
    return rows.reshape(rows.shape[0], -1, block_bytes)


@pytest.mark.slow
def test_default_model_served_in_its_gguf_types_is_the_files_blocks_bit_for_bit(smollm2_dir, kernel, tmp_path):
    import gguf

    cfg = SluiceConfig()
    cfg.model.quantization = "gguf"
    cfg.cache.num_kv_blocks = 64
    engine = LLMEngine(cfg)
    model = engine.model
    assert isinstance(model.lm_head, Int8Linear)  # the file's Q8_0 embedding, tied to the head
    projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the file's 210, q/k/v and gate/up fused
    body = [m for name, m in model.layers.named_modules() if name.rpartition(".")[2] in projections]
    assert len(body) == 120 and all(isinstance(m, Int4Linear) for m in body)

    reader = gguf.GGUFReader(str(fetch_default_gguf(tmp_path)))
    # Q4_1 block: float16 d, float16 m, 16 bytes of nibbles. ffn_down's rows are not permuted by the converter.
    blocks = _raw_blocks(reader, "blk.0.ffn_down.weight", 20)
    nibbles, scale, minimum = model.layers[0].mlp.down_proj.q4_1()
    assert np.array_equal(blocks[..., 0:2].copy().view(np.float16)[..., 0], scale.numpy())
    assert np.array_equal(blocks[..., 2:4].copy().view(np.float16)[..., 0], minimum.numpy())
    assert np.array_equal(blocks[..., 4:], nibbles.numpy())
    # Q8_0 block: float16 d, 32 int8
    blocks = _raw_blocks(reader, "token_embd.weight", 34)
    assert np.array_equal(blocks[..., 0:2].copy().view(np.float16)[..., 0], model.lm_head.scale.numpy())
    assert np.array_equal(blocks[..., 2:].copy().view(np.int8).reshape(blocks.shape[0], -1),
                          model.lm_head.qweight.numpy())

    # The file's exact weights: the same text as `--quantization int4` makes of the float weights converted from
    # it (which requantize to these very blocks), token for token.
    int4 = SluiceConfig()
    int4.model.quantization, int4.cache.num_kv_blocks = "int4", 64
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "The capital of France is"}],
                                                  add_generation_prompt=True, tokenize=False)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    assert engine.generate([prompt], params)[0].token_ids == LLMEngine(int4).generate([prompt], params)[0].token_ids


def test_gguf_needs_a_model_the_engine_loads_from_a_gguf(model_dir):
    _, ours = build_pair("llama")
    cfg = SluiceConfig()
    cfg.model.quantization = "gguf"
    with pytest.raises(ValueError, match="load the model itself"):
        LLMEngine(cfg, model=ours, tokenizer=tiny.tokenizer())
    cfg.model.model = model_dir  # a plain safetensors checkpoint: no GGUF types beside it
    with pytest.raises(ValueError, match="not a .gguf file or a directory converted from one"):
        LLMEngine(cfg)


def test_types_round_trip_through_their_file(tmp_path):
    types = {"model.layers.0.mlp.down_proj": "Q4_1", "lm_head": "Q8_0"}
    assert gguf_types.load(tmp_path) is None
    gguf_types.save(types, tmp_path)
    assert gguf_types.load(tmp_path) == types
