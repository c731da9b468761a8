"""Builds the owned Llama-family model straight from checkpoint tensors: a safetensors directory, or the state of a
transformers model handed to the engine. q/k/v and gate/up are fused at load; each linear's format comes from the
weight format (`layers/linear.py`). No transformers modeling module is built on the safetensors path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from sluice.service.executor.layers.attention import PagedAttention
from sluice.service.executor.layers.linear import WeightFormat
from sluice.service.executor.layers.mlp import GatedMLP
from sluice.service.executor.layers.norm import RMSNorm
from sluice.service.executor.layers.rotary import STATIC_ROPE_TYPES, RotaryEmbedding, rope_parameters
from sluice.service.executor.models.llama import DecoderLayer, LlamaForCausalLM

# transformers model_type → the family member; all share this one forward.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

Tensors = Callable[[str], torch.Tensor | None]  # checkpoint name → tensor, None where absent

# A decoder layer's tensors under "model.layers.{i}.", as transformers names them: each fused linear's parts, and
# the norms (Qwen3's q/k norms among them; absent elsewhere).
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
O_PROJ, GATE_UP, DOWN = ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)
Q_NORM, K_NORM, INPUT_NORM, POST_NORM = ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm",
                                         "post_attention_layernorm")
EMBED, FINAL_NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


def unsupported_reason(config) -> str | None:
    """Why the owned forward cannot run a model of this transformers config; None where it can."""
    config = config.get_text_config()
    if config.model_type not in MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {', '.join(MODEL_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    rope_type = rope_parameters(config)["rope_type"]
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r}"
    return None


def attention_shape(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of a transformers text config: KV heads default to the query heads, the
    head size to hidden_size / heads."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def sliding_window(config, layer: int) -> int | None:
    """The attention window of `layer` (None: the whole context) under the family's rule."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if config.model_type in ("qwen2", "qwen3"):  # a window only on layers marked so (use_sliding_window)
        return window if layer_types and layer_types[layer] == "sliding_attention" else None
    return window if config.model_type == "mistral" else None


def build(config, tensors: Tensors, formats: WeightFormat, device: torch.device, dtype: torch.dtype,
          generation_config=None) -> LlamaForCausalLM:
    """The owned model of `config` with the checkpoint's weights, each linear in the format `formats` gives it."""
    config = config.get_text_config()

    def linear(prefix: str, parts: tuple[str, ...], weights: list[torch.Tensor] | None = None) -> nn.Module:
        names = [f"{prefix}{p}" for p in parts]
        weights = weights or [tensors(f"{n}.weight") for n in names]
        return formats.make_parts(weights, [tensors(f"{n}.bias") for n in names], names, device, dtype)

    def norm(weight: torch.Tensor) -> RMSNorm:
        return RMSNorm(weight.detach().to(device=device, dtype=dtype, copy=True), config.rms_norm_eps)

    # Each tensor is fetched once: whether an optional one exists is read off the fetch itself (a fetch reads the
    # file, and a GGUF file's q/k rows are reordered on the way).
    heads, kv_heads, head_dim = attention_shape(config)
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        q_norm, k_norm = tensors(f"{p}{Q_NORM}.weight"), tensors(f"{p}{K_NORM}.weight")
        attn = PagedAttention(
            linear(p, QKV), linear(p, O_PROJ), heads, kv_heads, head_dim, i,
            norm(q_norm) if q_norm is not None else None, norm(k_norm) if k_norm is not None else None,
            sliding_window(config, i),
        )
        mlp = GatedMLP(linear(p, GATE_UP), linear(p, DOWN))
        layers.append(DecoderLayer(norm(tensors(f"{p}{INPUT_NORM}.weight")), attn,
                                   norm(tensors(f"{p}{POST_NORM}.weight")), mlp))
    embed = formats.embedding(tensors(EMBED), device, dtype)
    untied = None if config.tie_word_embeddings else tensors(HEAD)
    head = formats.tied_head(embed) if untied is None else linear("", (HEAD.removesuffix(".weight"),), [untied])
    rotary = RotaryEmbedding(config, head_dim).to(device)
    return LlamaForCausalLM(config, embed, layers, norm(tensors(FINAL_NORM)), head, rotary,
                            generation_config).eval()


def checkpoint_names(config) -> list[str]:
    """Every tensor name `build` may read from a checkpoint of `config`, optional ones (biases, q/k norms, an
    untied head) included."""
    names = []
    for i in range(config.get_text_config().num_hidden_layers):
        p = f"model.layers.{i}."
        names += [f"{p}{part}.{kind}" for part in QKV + O_PROJ + GATE_UP + DOWN for kind in ("weight", "bias")]
        names += [f"{p}{norm}.weight" for norm in (Q_NORM, K_NORM, INPUT_NORM, POST_NORM)]
    return [EMBED, *names, FINAL_NORM, HEAD]


def safetensors_tensors(directory: Path) -> Tensors:
    """Lazy access to a checkpoint directory's safetensors tensors by name (one or several files)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.is_file() \
        else sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {directory}")
    where = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            where.update(dict.fromkeys(handle.keys(), f))
    # A checkpoint saved from the bare decoder (Qwen3-Embedding, sentence-transformers models) names its tensors
    # without the "model." prefix of transformers' *ForCausalLM.
    bare = not any(name.startswith("model.") for name in where)

    def get(name: str) -> torch.Tensor | None:
        key = name.removeprefix("model.") if bare else name
        if key not in where:
            return None
        # A mapping per tensor, which lives as long as the tensor (a view of it): the file's pages leave the
        # resident set as each tensor is converted, not at the end of the load (538 MB of peak at 135M fp32).
        with safe_open(str(where[key]), framework="pt", device="cpu") as handle:
            return handle.get_tensor(key)

    return get


def load(directory: Path, config, formats: WeightFormat, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """The owned model from a safetensors checkpoint directory (transformers' layout and names)."""
    from transformers import GenerationConfig

    generation = GenerationConfig.from_pretrained(directory) if (directory / "generation_config.json").is_file() \
        else GenerationConfig.from_model_config(config)
    return build(config, safetensors_tensors(directory), formats, device, dtype, generation)


def from_transformers(model: nn.Module, formats: WeightFormat, device: torch.device,
                      dtype: torch.dtype) -> LlamaForCausalLM:
    """The owned model with the weights of a transformers Llama-family model (copied: `model` is left as it is)."""
    state = model.state_dict()
    return build(model.config, state.get, formats, device, dtype, getattr(model, "generation_config", None))

