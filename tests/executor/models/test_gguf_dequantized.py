"""A GGUF file in any weight format but its own blocks: Sluice dequantizes it tensor by tensor (gguf's dequantize)
into the format asked for, with the weights transformers' GGUF loader gives; the default model's checkpoint
directory is written from its file the same way, the same as transformers' conversion."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from sluice.service.config import ModelConfig
from sluice.service.executor.layers.linear import PlainFormat
from sluice.service.executor.model_loader import _convert_gguf, _dequantize, load_model
from sluice.service.executor.models import gguf_weights, weights
from sluice.service.executor.models.llama import LlamaForCausalLM
from sluice.service.executor.weight_prep import weight_format
from tests.support.gguf_files import PROMPTS, greedy, llama_cpp_permute, same_tokenizer, write_tiny_gguf
from tests.support.parity import config_reading

CPU = torch.device("cpu")
ARCHS = ["llama", "qwen2", "qwen3"]  # Llama's q/k rows permuted in the file, Qwen2's biases, Qwen3's q/k norms
# transformers reads a Qwen3 file's head size as its class's default (128), not from attention.key_length: the tiny
# Qwen3's heads of 64 are read right by Sluice only (its q/k norms are checked against the float values above).
TRANSFORMERS_READS = ["llama", "qwen2"]


def transformers_dequantized(path):
    """transformers' own model on the file, dequantized by its GGUF loader."""
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                quantization_config=_dequantize(path.name), dtype=torch.float32)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_a_gguf_file_loads_dequantized_into_the_format_asked_for(tmp_path, arch, quantization):
    path, config, floats = write_tiny_gguf(tmp_path / "tiny.gguf", arch)
    settings = ModelConfig(quantization=quantization)
    model, tokenizer = load_model(str(path), "cpu", "float32", settings=settings)
    assert isinstance(model, LlamaForCausalLM) and tokenizer.eos_token == "<|im_end|>"
    # The same model as the owned one built from the float values the blocks stand for, in the same format.
    reference = weights.build(config, floats.get, weight_format(settings, CPU, torch.float32), CPU, torch.float32)
    ours, want = model.state_dict(), reference.state_dict()
    assert ours.keys() == want.keys() and all(torch.equal(ours[k], want[k]) for k in want)
    assert greedy(model, PROMPTS) == greedy(reference, PROMPTS)


@pytest.mark.parametrize("arch", TRANSFORMERS_READS)
def test_the_weights_are_transformers_dequantized_weights(tmp_path, arch):
    path, _, _ = write_tiny_gguf(tmp_path / "tiny.gguf", arch)
    plain = ModelConfig(quantization="none", prepack_weights=False)
    ours = load_model(str(path), "cpu", "float32", settings=plain)[0].state_dict()
    theirs = weights.from_transformers(transformers_dequantized(path), PlainFormat(CPU, torch.float32), CPU,
                                       torch.float32).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_llama_files_q_and_k_biases_are_put_back_in_order(tmp_path):
    """llama.cpp's converter permutes a Llama's q/k biases as it does their weights' rows."""
    import gguf

    path = tmp_path / "biased.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    bias, weight = np.arange(16, dtype=np.float32), np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    writer.add_tensor("blk.0.attn_q.bias", llama_cpp_permute(bias, 4))
    writer.add_tensor("blk.0.attn_q.weight", llama_cpp_permute(weight, 4))
    writer.add_tensor("blk.0.attn_v.bias", bias)  # v is not permuted
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = SimpleNamespace(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    tensors = gguf_weights.read_tensors(path, config, dequantize=True)
    assert torch.equal(tensors("model.layers.0.self_attn.q_proj.bias"), torch.from_numpy(bias))
    assert torch.equal(tensors("model.layers.0.self_attn.q_proj.weight"), torch.from_numpy(weight))
    assert torch.equal(tensors("model.layers.0.self_attn.v_proj.bias"), torch.from_numpy(bias))


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_names_cover_what_the_model_reads(arch, tmp_path):
    _, config, floats = write_tiny_gguf(tmp_path / "tiny.gguf", arch)
    read: list[str] = []
    weights.build(config, lambda name: read.append(name) or floats.get(name), PlainFormat(CPU, torch.float32),
                  CPU, torch.float32)
    names = weights.checkpoint_names(config)
    assert set(read) <= set(names) and set(floats) <= set(names) and weights.HEAD in names


@pytest.mark.parametrize("arch", TRANSFORMERS_READS)
def test_the_converted_directory_is_transformers_conversion(tmp_path, arch):
    path, _, _ = write_tiny_gguf(tmp_path / "tiny.gguf", arch)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _convert_gguf(path, ours)
    hf = transformers_dequantized(path)  # what the default model's conversion was: transformers' model and tokenizer
    hf.save_pretrained(theirs)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(theirs)
    saved, want = load_file(ours / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert saved.keys() == want.keys() and all(torch.equal(saved[k], want[k]) for k in want)
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert config_reading(AutoConfig.from_pretrained(ours)) == config_reading(AutoConfig.from_pretrained(theirs))
    assert type(AutoConfig.from_pretrained(ours)) is type(AutoConfig.from_pretrained(theirs))
    same_tokenizer(AutoTokenizer.from_pretrained(ours), AutoTokenizer.from_pretrained(theirs))
    assert GenerationConfig.from_pretrained(ours).eos_token_id == GenerationConfig.from_pretrained(theirs).eos_token_id
    assert (ours / path.name).read_bytes() == path.read_bytes()  # --quantization gguf serves the file's blocks
    dequantized = ModelConfig(quantization="none")
    model, _ = load_model(str(ours), "cpu", "float32")
    assert greedy(model, PROMPTS) == greedy(load_model(str(path), "cpu", "float32", settings=dequantized)[0], PROMPTS)


def test_auto_serves_a_gguf_files_blocks_as_stored_on_cpu(tmp_path):
    """--quantization auto (the default): the file's blocks on CPU with float32 activations, as llama.cpp serves
    them; float weights where the blocks cannot be served (bf16 activations, no owned forward, overrides) or there
    is no GGUF file."""
    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine
    from sluice.service.executor.layers.gguf_linear import GgufLinear
    from sluice.service.executor.model_loader import resolve_precision

    path, _, _ = write_tiny_gguf(tmp_path / "tiny.gguf", "llama")
    auto = ModelConfig()
    assert auto.quantization == "auto"
    device, dtype, settings = resolve_precision(str(path), auto)
    assert (device, dtype, settings.quantization) == (CPU, torch.float32, "gguf")
    for model, settings, dtype in [
        (str(path), auto, "bfloat16"),
        (str(path), ModelConfig(owned_model=False), "auto"),
        (str(path), ModelConfig(hf_overrides='{"rms_norm_eps": 1e-5}'), "auto"),
        (str(tmp_path), auto, "auto"),  # a directory
    ]:
        assert resolve_precision(model, settings, "cpu", dtype)[2].quantization == "none", (model, settings, dtype)
    with pytest.raises(ValueError, match="runs on CPU with float32 activations"):
        resolve_precision(str(path), ModelConfig(quantization="int4"), "cpu", "bfloat16")
    config = SluiceConfig(model=ModelConfig(model=str(path)))
    config.cache.num_kv_blocks = 32
    engine = LLMEngine(config)
    assert engine.config.model.quantization == "gguf" and engine.dtype == torch.float32
    assert isinstance(engine.model.layers[0].mlp.down_proj, GgufLinear)



def test_types_without_a_kernel_are_served_in_types_with_one(tmp_path):
    """IQ3_S (an IQ3_S file's) has no kernel here: as stored, its values go into Q8_0 blocks, the file's values
    (through gguf's dequantize) quantized as --quantization int8 quantizes a float weight. A Q2_K or Q3_K_M file's
    Q2_K and Q3_K are served as stored."""
    from sluice.service.executor.layers.gguf_blocks import quantize
    from sluice.service.executor.layers.gguf_linear import GgufLinear
    from sluice.service.executor.layers.quant_types import dequantize
    from tests.support.gguf_files import LAYER_TYPES

    types = [{**LAYER_TYPES[0], "o_proj": "Q2_K", "down_proj": "Q3_K"}, {**LAYER_TYPES[1], "o_proj": "IQ3_S"}]
    path, config, floats = write_tiny_gguf(tmp_path / "k_quants.gguf", "llama", types=types)
    model, _ = load_model(str(path), "cpu", "float32")  # --quantization auto: the blocks as stored
    for layer, name, served in ((0, "self_attn.o_proj", "Q2_K"), (0, "mlp.down_proj", "Q3_K"),
                                (1, "self_attn.o_proj", "Q8_0")):
        linear = model.layers[layer].get_submodule(name)
        weight = floats[f"model.layers.{layer}.{name}.weight"]
        assert isinstance(linear, GgufLinear) and linear.method.qtype == served, name
        rows = linear.method.stored_rows(linear)
        if served == "Q8_0":
            assert torch.equal(rows, quantize(weight, "Q8_0")), (layer, name)
        else:  # the file's own blocks
            assert torch.equal(dequantize(rows, served, weight.shape[1]), weight), (layer, name)
    assert len(greedy(model, PROMPTS, 10)[0]) == 10
