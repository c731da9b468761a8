"""Device/dtype resolution, local loading, EOS discovery, and (slow) the embedded default model."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from sluice.kvcache.config import CacheConfig
from sluice.machine import cache_root
from sluice.scheduling.output import ScheduledRequest, SchedulerOutput
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.executor.model_loader import (
    DEFAULT_MODEL_NAME,
    ensure_default_model,
    eos_token_ids,
    load_model,
    resolve_device_dtype,
)
from sluice.service.executor.model_runner import ModelRunner
from sluice.service.executor.models.llama import LlamaForCausalLM


def test_resolve_device_dtype(monkeypatch):
    from sluice.service.executor import model_loader

    # a CPU without bf16 (tests/executor/test_dtype_auto.py)
    monkeypatch.setattr(model_loader, "native_bf16_flags", lambda: [])
    expected_auto = (torch.device("cuda"), torch.bfloat16) if torch.cuda.is_available() else (
        torch.device("cpu"), torch.float32)
    assert resolve_device_dtype() == expected_auto
    assert resolve_device_dtype("cpu", "auto") == (torch.device("cpu"), torch.float32)
    assert resolve_device_dtype("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    assert resolve_device_dtype("cpu", "float16")[1] == torch.float16
    assert resolve_device_dtype("cpu", torch.float64)[1] == torch.float64
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_device_dtype("cpu", "int8")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            resolve_device_dtype("cuda:1", "auto")


def test_eos_token_ids_merges_generation_config_and_tokenizer():
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[5, 7]))
    assert eos_token_ids(model, SimpleNamespace(eos_token_id=7)) == [5, 7]
    assert eos_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=3)),
                         SimpleNamespace(eos_token_id=None)) == [3]
    assert eos_token_ids(SimpleNamespace(), SimpleNamespace(eos_token_id=2)) == [2]


def test_cache_root_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path


def test_existing_default_model_cache_is_reused_without_download(tmp_path):
    target = tmp_path / DEFAULT_MODEL_NAME
    target.mkdir()
    (target / "config.json").write_text("{}")
    assert ensure_default_model(tmp_path) == target


def test_load_local_directory(tmp_path):
    from tests.support import tiny

    path = tiny.save_tiny_model(str(tmp_path / "tiny"))
    model, tokenizer = load_model(path, "cpu", "bfloat16")
    assert isinstance(model, LlamaForCausalLM)  # Sluice's own forward, straight from the safetensors
    assert not model.training and model.dtype == torch.bfloat16
    assert tokenizer.eos_token_id == tiny.tokenizer().eos_token_id


def test_missing_paths_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "nope.gguf"), "cpu", "float32")
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "no" / "such" / "dir"), "cpu", "float32")


@pytest.mark.slow
def test_default_model_download_convert_cache_and_generate(smollm2_dir):
    # The session's copy: on a fresh machine (CI) the fixture's first call is the download and conversion.
    from transformers import AutoModelForCausalLM

    path, cache = smollm2_dir, smollm2_dir.parent
    assert path.name == DEFAULT_MODEL_NAME and (path / "model.safetensors").is_file()
    assert not [p.name for p in cache.iterdir() if p.name.startswith(".download-")]  # no staging leftovers
    start = time.perf_counter()
    assert ensure_default_model(cache) == path
    assert time.perf_counter() - start < 1.0

    model, tokenizer = load_model("default", "cpu", "float32", cache_dir=cache)
    assert tokenizer.eos_token == "<|im_end|>" and eos_token_ids(model, tokenizer) == [2]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt)

    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    with torch.no_grad():
        want = reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()

    runner = ModelRunner(model, CacheConfig(num_kv_blocks=32), "cpu", torch.float32, 256, 4)
    tokens, greedy = list(ids), SamplingParams(temperature=0.0)
    blocks = list(range(31, 15, -1))
    for start_pos, chunk in [(0, len(ids) - 10), (len(ids) - 10, 10)] + [(len(ids) + i, 1) for i in range(11)]:
        req = ScheduledRequest("r", tokens[start_pos:start_pos + chunk], start_pos, blocks, True, greedy,
                               len(tokens) - len(ids), eos_token_id=2)
        req.sample = start_pos + chunk == len(tokens)
        out = runner.execute(SchedulerOutput([req], chunk))
        if req.sample:
            tokens.append(out.sampled["r"])
    got = tokens[len(ids):]
    assert got[: len(want)] == want  # generate stops at EOS; the runner leaves stopping to the engine
    assert "Paris" in tokenizer.decode(got)
