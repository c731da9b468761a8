"""Random-initialized checkpoints of the shapes people serve on CPUs, on the default model's tokenizer.

Speed depends on a model's shape, not its weights, so a random model of SmolLM2-360M's or SmolLM2-1.7B's shape
(or a Qwen2/Qwen3 layer layout at SmolLM2's size) measures what the real one would, without a download. The
benchmark's requests set ignore_eos, so random text still runs to its full length.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers

from sluice.machine import cache_root
from sluice.service.engine.model_loader import ensure_default_model

# SmolLM2's published shapes: hidden, intermediate, layers, attention heads, key/value heads.
SIZES = {"135m": (576, 1536, 30, 9, 3), "360m": (960, 2560, 32, 15, 5), "1.7b": (2048, 8192, 24, 32, 32)}
ARCHS = ("llama", "qwen2", "qwen3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def config_of(arch: str, size: str) -> transformers.PretrainedConfig:
    """The transformers config of a `size`-shaped model with `arch`'s layer layout (qwen2: q/k/v bias,
    qwen3: q/k norms), on the default model's vocabulary and tied embeddings."""
    hidden, intermediate, layers, heads, kv_heads = SIZES[size]
    base = transformers.AutoConfig.from_pretrained(ensure_default_model())
    common = dict(vocab_size=base.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=base.max_position_embeddings, rope_parameters=base.rope_parameters,
                  rms_norm_eps=base.rms_norm_eps, tie_word_embeddings=True, bos_token_id=base.bos_token_id,
                  eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=hidden // heads, **common)
    raise ValueError(f"unknown architecture {arch!r}; one of {', '.join(ARCHS)}")


def random_checkpoint(arch: str, size: str, cache: Path | None = None) -> Path:
    """A saved random `arch` model of `size`'s shape with the default tokenizer (made once, cached)."""
    target = (cache or cache_root() / "shapes") / f"{arch}-{size}"
    if (target / "model.safetensors").is_file():
        return target
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_of(arch, size), torch_dtype=torch.float32)
    staged = target.with_name(target.name + ".partial")
    shutil.rmtree(staged, ignore_errors=True)
    model.save_pretrained(staged)
    source = ensure_default_model()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, staged / name)
    shutil.rmtree(target, ignore_errors=True)
    staged.rename(target)  # whole or absent: a killed run never leaves half a checkpoint behind
    return target
