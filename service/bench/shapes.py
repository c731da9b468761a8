"""Random-initialized checkpoints of the shapes people serve on CPUs, on the default model's tokenizer.

Speed depends on a model's shape, not its weights, so a random model of SmolLM2-360M's or SmolLM2-1.7B's shape
(or a Qwen2/Qwen3 layer layout at SmolLM2's size) measures what the real one would, without a download. The
benchmark's requests set ignore_eos, so random text still runs to its full length. The weights are drawn as
transformers initializes a new model (normal, std 0.02; norms at 1) from a fixed seed, then the query and key
projections again with std 0.1: at 0.02 every attention is near uniform, and greedy decoding settles on one token
repeated ("tripled tripled ..."), which n-gram speculation would predict for free; sharper attention gives varied
text (29-32 distinct tokens in 32 at 360M's shape). Saved in bf16: the same checkpoint on every machine, half the
disk of fp32. RECIPE names the folder, so a checkpoint made another way is never taken for this one.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from sluice.machine import cache_root
from sluice.service.executor.model_loader import ensure_default_model


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's size: what its config.json says, vocabulary and tied embeddings aside."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float = 100000.0


# SmolLM2's published configs (HuggingFaceTB/SmolLM2-*-Instruct config.json): all tie their embeddings to the
# 49,152-token vocabulary; 1.7B has no grouped-query attention.
SIZES = {"135m": Shape(576, 1536, 30, 9, 3), "360m": Shape(960, 2560, 32, 15, 5),
         "1.7b": Shape(2048, 8192, 24, 32, 32, rope_theta=130000.0)}
ARCHS = ("llama", "qwen2", "qwen3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
SEED = 0
QK_STD = 0.1
RECIPE = "r2"  # bf16, std 0.02, q/k std 0.1, seed 0


def config_of(arch: str, size: str | Shape) -> transformers.PretrainedConfig:
    """The transformers config of a `size`-shaped model with `arch`'s layer layout (qwen2: q/k/v bias,
    qwen3: q/k norms), on the default model's vocabulary and tied embeddings."""
    shape = SIZES[size] if isinstance(size, str) else size
    base = transformers.AutoConfig.from_pretrained(ensure_default_model())
    rope = {**base.rope_parameters, "rope_theta": shape.rope_theta}
    common = dict(vocab_size=base.vocab_size, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, max_position_embeddings=base.max_position_embeddings,
                  rope_parameters=rope, rms_norm_eps=base.rms_norm_eps, tie_word_embeddings=True,
                  initializer_range=0.02, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id,
                  pad_token_id=base.pad_token_id)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=shape.hidden // shape.heads, **common)
    raise ValueError(f"unknown architecture {arch!r}; one of {', '.join(ARCHS)}")


def random_checkpoint(arch: str, size: str | Shape, cache: Path | None = None, name: str = "") -> Path:
    """A saved random `arch` model of `size`'s shape with the default tokenizer (made once, cached).

    `name` names the folder when `size` is a Shape rather than one of SIZES.
    """
    target = (cache or cache_root() / "shapes") / f"{arch}-{name or size}-{RECIPE}"
    if (target / "model.safetensors").is_file():
        return target
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config_of(arch, size), dtype=torch.bfloat16)
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if module_name.endswith(("q_proj", "k_proj")):
                module.weight.normal_(0.0, QK_STD)
    staged = target.with_name(target.name + ".partial")
    shutil.rmtree(staged, ignore_errors=True)
    model.save_pretrained(staged)
    del model
    source = ensure_default_model()
    for file in TOKENIZER_FILES:
        if (source / file).is_file():
            shutil.copy2(source / file, staged / file)
    shutil.rmtree(target, ignore_errors=True)
    staged.rename(target)  # whole or absent: a killed run never leaves half a checkpoint behind
    return target
