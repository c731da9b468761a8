"""config.json read without transformers' per-model config classes: wherever the reader answers, the owned forward
reads the same numbers as from transformers' own class (tiny configs transformers wrote, published checkpoints'
files, and files with keys dropped at random); transformers' class wherever the file leaves something to it; a model
served from a directory that never imports those classes."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, PreTrainedConfig

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.config import ModelConfig
from sluice.service.executor.model_loader import load_model
from sluice.service.executor.models import weights
from sluice.service.executor.models.config_json import REQUIRED_KEYS, read_owned_config
from sluice.service.executor.models.llama import LlamaForCausalLM
from tests.support import tiny
from tests.support.parity import MAX_NEW, build_pair, config_reading, hf_greedy, make_engine, mixed_prompts, tiny_config
from tests.support.profiles import examples

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# Published checkpoints' files, in the spellings of the transformers that wrote them (rope_theta at the top level).
HUB_FILES = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
        "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
        "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 32000},
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
        "head_dim": 64, "hidden_act": "silu", "hidden_size": 576, "intermediate_size": 1536,
        "max_position_embeddings": 8192, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 9,
        "num_hidden_layers": 30, "num_key_value_heads": 3, "pad_token_id": 2, "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": True,
        "vocab_size": 49152},
}


def write(tmp_path, values: dict):
    (tmp_path / "config.json").write_text(json.dumps(values))
    return tmp_path


def both(path) -> tuple:
    ours = read_owned_config(path)
    return ours, AutoConfig.from_pretrained(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_file_transformers_wrote_reads_the_same(tmp_path, arch):
    tiny_config(arch).save_pretrained(tmp_path)
    ours, theirs = both(tmp_path)
    assert type(ours) is PreTrainedConfig
    assert config_reading(ours) == config_reading(theirs)


@pytest.mark.parametrize("name", sorted(HUB_FILES))
def test_published_files_read_the_same(tmp_path, name):
    ours, theirs = both(write(tmp_path, HUB_FILES[name]))
    assert ours is not None and config_reading(ours) == config_reading(theirs)


@pytest.mark.parametrize("change", [
    {"rope_theta": None},  # TinyLlama's file names no base: LlamaConfig's default
    {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}},
    {"use_sliding_window": True},  # which layers slide: max_window_layers, in the class
    {"layer_types": ["sliding_attention"] * 24},
    {"tie_word_embeddings": None},  # each family's class has its own default
    {"auto_map": {"AutoConfig": "configuration_x.XConfig"}},
    {"quantization_config": {"quant_method": "awq"}},
    {"model_type": "gemma"},
])
def test_what_the_class_decides_goes_to_transformers(tmp_path, change):
    values = {**HUB_FILES["qwen2.5-0.5b"], **change}
    values = {k: v for k, v in values.items() if v is not None or k in ("sliding_window",)}
    assert read_owned_config(write(tmp_path, values)) is None


@pytest.mark.parametrize("text", ["{", "[1, 2]", ""])
def test_an_unreadable_file_goes_to_transformers(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    assert read_owned_config(tmp_path) is None
    assert read_owned_config(tmp_path / "missing") is None


@settings(max_examples=examples(12, 120), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(HUB_FILES)), drop=st.sets(st.sampled_from(REQUIRED_KEYS + ("head_dim",
       "sliding_window", "rope_theta", "rope_parameters", "num_key_value_heads", "use_sliding_window")), max_size=2),
       tie=st.booleans(), theta=st.sampled_from([10000.0, 500000, 1e6]))
def test_whenever_it_answers_it_agrees_with_transformers(tmp_path, name, drop, tie, theta):
    values = copy.deepcopy(HUB_FILES[name])
    values["tie_word_embeddings"] = tie
    if "rope_parameters" in values:
        values["rope_parameters"]["rope_theta"] = theta
    else:
        values["rope_theta"] = theta
    values = {k: v for k, v in values.items() if k not in drop}
    ours = read_owned_config(write(tmp_path, values))
    if ours is not None:  # (transformers may refuse a file the reader refuses: a dropped hidden_size)
        assert config_reading(ours) == config_reading(AutoConfig.from_pretrained(tmp_path))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_directory_serves_as_transformers_generates(tmp_path, arch):
    reference, ours = build_pair(arch)
    torch.manual_seed(7)
    with torch.no_grad():  # biases and norms away from their 0 and 1 starts
        for name, param in ours.named_parameters():
            if name.endswith("bias") or "q_norm" in name or "k_norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    reference.load_state_dict(ours.state_dict())
    ours.save_pretrained(tmp_path)
    tiny.tokenizer().save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), "cpu", "float32")
    assert isinstance(model, LlamaForCausalLM) and type(model.config) is PreTrainedConfig
    engine = make_engine(model, "recompute", num_blocks=64)
    prompts = mixed_prompts(4)
    got = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))
    assert [g.token_ids for g in got] == [hf_greedy(reference, p, MAX_NEW) for p in prompts]


def test_overrides_are_read_by_transformers_class(tmp_path):
    path = tiny.save_tiny_model(str(tmp_path / "tiny"))
    settings = ModelConfig(hf_overrides='{"rms_norm_eps": 0.001}')
    model, _ = load_model(path, "cpu", "float32", settings=settings)
    assert type(model.config).__name__ == "LlamaConfig" and model.config.rms_norm_eps == 0.001


def test_serving_a_directory_imports_no_model_config_class(tmp_path):
    path = tiny.save_tiny_model(str(tmp_path / "tiny"))
    family = [f"transformers.models.{t}.configuration_{t}" for t in weights.MODEL_TYPES]
    code = ("import sys; from sluice.service.executor.model_loader import load_model; load_model(sys.argv[1], 'cpu', "
            f"'float32'); print([m for m in {family} if m in sys.modules], 'sympy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[] False"
