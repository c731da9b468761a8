"""A Llama-family checkpoint's config.json read as transformers' base config class, without its per-model classes.

transformers' LlamaConfig, Qwen2Config, Qwen3Config and MistralConfig modules import its modeling stack (activations,
hub kernels, torch.distributed.tensor, sympy): 66 MB resident and most of a second at start-up, for a handful of
numbers the owned forward reads. A config.json that states each of those numbers (what transformers writes, and
what published checkpoints carry) is read here into a plain `PreTrainedConfig`. One whose meaning rests on a class's
own defaults or derivations (a missing key, a scaled rope, Qwen's sliding-window layers, remote code,
a quantization config, a nested text config) gets None, and the loader takes transformers' own class.
"""

from __future__ import annotations

import json
from pathlib import Path

from sluice.service.executor.models.weights import MODEL_TYPES

# What the owned forward reads, which every family's class defaults differently or derives; the JSON must state it.
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "hidden_act", "rms_norm_eps", "max_position_embeddings",
                 "tie_word_embeddings")
FAMILY_KEYS = {"mistral": ("sliding_window",), "qwen3": ("head_dim",)}  # Qwen3's head_dim is 128, not hidden/heads
NEEDS_OWN_CLASS = ("auto_map", "quantization_config", "text_config")


def read_owned_config(directory: Path):
    """The checkpoint's config as a `PreTrainedConfig` where its config.json states all the owned forward reads;
    None where transformers' own config class must read it."""
    values = _read_json(Path(directory) / "config.json")
    return None if values is None else owned_config(values, str(directory))


def owned_config(values: dict, name_or_path: str):
    """`values` (config.json's keys) as a `PreTrainedConfig` where they state all the owned forward reads; None
    where transformers' own config class must read them."""
    if values.get("model_type") not in MODEL_TYPES:
        return None
    family = values["model_type"]
    if any(k in values for k in NEEDS_OWN_CLASS):
        return None
    if any(k not in values for k in REQUIRED_KEYS + FAMILY_KEYS.get(family, ())):
        return None
    rope = _default_rope(values)
    if rope is None:
        return None
    if family in ("qwen2", "qwen3"):
        if values.get("use_sliding_window") or set(values.get("layer_types") or ()) - {"full_attention"}:
            return None  # which layers slide is the class's derivation
        values["sliding_window"] = None  # what Qwen's classes set when use_sliding_window is off
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        values.pop(key, None)
    from transformers import PreTrainedConfig

    return PreTrainedConfig(**values, rope_parameters=rope, name_or_path=name_or_path)


def _read_json(path: Path) -> dict | None:
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return values if isinstance(values, dict) else None


def _default_rope(values: dict) -> dict | None:
    """{"rope_type": "default", "rope_theta": θ} where the file gives an unscaled rope and its base; None otherwise."""
    params = values.get("rope_parameters")
    if params is None and values.get("rope_scaling") is None and "rope_theta" in values:
        params = {"rope_type": "default", "rope_theta": values["rope_theta"]}
    if not isinstance(params, dict) or params.get("rope_type", params.get("type")) != "default":
        return None
    theta = params.get("rope_theta")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or set(params) - {"rope_type", "rope_theta"}:
        return None
    return {"rope_type": "default", "rope_theta": float(theta)}
