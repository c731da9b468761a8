"""LoRA adapters: greedy output with an adapter equals transformers + peft with the adapter merged, alone and with
rows of other adapters and of the base model in the same steps; checks, slots, scheduling and the API."""

from __future__ import annotations

import json

import pytest
import torch

from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.engine.lora.adapter import Geometry, LoRAError, read_adapter

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["The capital of France is", "Hello world, how are", "Streaming tokens over", "你好世界"]


def make_adapter(model_dir: str, out: str, seed: int, targets=ALL_TARGETS, r: int = 8, scale: float = 0.3) -> str:
    """A random-initialized peft LoRA adapter of the model at `model_dir`, saved to `out`; large enough deltas
    to change greedy output."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                 init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(scale / p.abs().mean())
    peft_model.save_pretrained(out)
    return out


def merged_greedy(model_dir: str, adapter: str | None, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy generate on the base model with `adapter` merged (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    outs = []
    for ids in prompts:
        gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, min_new_tokens=max_new,
                             pad_token_id=0)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def lora_engine(model_dir: str, modules: list[str], max_loras: int = 4, **scheduler):
    """An fp32 CPU engine on `model_dir` serving `modules` ('name=path')."""
    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine

    config = SluiceConfig()
    config.model.model, config.model.device, config.model.dtype = model_dir, "cpu", "float32"
    config.cache.num_kv_blocks = 64
    config.lora.lora_modules, config.lora.max_loras = tuple(modules), max_loras
    for name, value in scheduler.items():
        setattr(config.scheduler, name, value)
    return LLMEngine(config)


def run(engine, jobs: list[tuple[list[int], str | None]], max_new: int) -> list[list[int]]:
    """Greedy outputs of (prompt ids, adapter name or None) requests added together (so they share steps)."""
    for i, (ids, name) in enumerate(jobs):
        lora = None if name is None else engine.loras.get(name)
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True,
                                                        lora_request=lora))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(out.token_ids)
    return [done[f"r{i}"] for i in range(len(jobs))]


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Two adapters of the tiny model: one on every projection, one on attention only."""
    root = tmp_path_factory.mktemp("adapters")
    return (make_adapter(model_dir, str(root / "a"), seed=1),
            make_adapter(model_dir, str(root / "b"), seed=2, targets=["q_proj", "v_proj", "o_proj"], r=4))


def test_tiny_parity_alone_and_mixed_with_other_adapters_and_the_base(model_dir, adapters):
    from tests._tiny import tokenizer

    tok = tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    max_new = 12
    expected = {name: merged_greedy(model_dir, path, prompts, max_new)
                for name, path in (("a", adapters[0]), ("b", adapters[1]), (None, None))}
    assert expected["a"] != expected[None] and expected["b"] != expected[None]  # the adapters matter
    engine = lora_engine(model_dir, [f"a={adapters[0]}", f"b={adapters[1]}"], max_loras=2)
    assert run(engine, [(prompts[0], "a")], max_new) == [expected["a"][0]]  # batch 1
    jobs = [(p, name) for i, p in enumerate(prompts) for name in (("a", "b", None)[i % 3], ("b", None, "a")[i % 3])]
    got = run(engine, jobs, max_new)
    for (ids, name), tokens in zip(jobs, got, strict=True):
        assert tokens == expected[name][prompts.index(ids)], name
