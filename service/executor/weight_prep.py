"""Chooses the path a model runs and the format of its weights: Sluice's own Llama-family forward with its linears
in the weight format asked for, or, for any other architecture, transformers' model on the paged attention hook."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from sluice import native
from sluice.cpu import release_freed_memory
from sluice.service.attention.attention_backend import register as register_attention
from sluice.service.config import ModelConfig
from sluice.service.executor.forward_context import get_forward_context
from sluice.service.executor.layers.gguf_linear import QuantizeFormat
from sluice.service.executor.layers.half_linear import HALF_DTYPES, HalfFormat
from sluice.service.executor.layers.linear import PlainFormat, WeightFormat
from sluice.service.executor.layers.packed_linear import PackedFormat, can_prepack
from sluice.service.executor.models import weights
from sluice.service.executor.models.llama import LlamaForCausalLM

logger = logging.getLogger("sluice.engine")


def float_weights(config: ModelConfig) -> bool:
    """Whether `--quantization` keeps float weights: 'none', or 'auto' for a model that is no .gguf file (the engine
    resolves auto where it knows the file: model_loader.resolve_precision)."""
    return config.quantization in ("none", "auto")


def weight_format(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> WeightFormat:
    """The weight format `--quantization` and `--prepack-weights` ask for on this device and precision."""
    if config.quantization == "gguf":
        raise ValueError("--quantization gguf serves a .gguf file's blocks as stored: load the model from the file")
    if config.quantization in ("int8", "int4"):
        return QuantizeFormat(config.quantization, native.load())
    if config.quantization in HALF_DTYPES:
        return HalfFormat(config.quantization, native.load())
    if not float_weights(config):
        raise ValueError(f"unknown quantization {config.quantization!r}: one of int8, int4, f16, bf16, gguf")
    if config.prepack_weights and can_prepack(device, dtype):
        return PackedFormat(device, dtype)
    return PlainFormat(device, dtype)


def owned_path(model_config, config: ModelConfig) -> str | None:
    """Why the model runs on transformers' forward (None: it runs on Sluice's own)."""
    if not config.owned_model:
        return "--no-owned-model"
    return weights.unsupported_reason(model_config)


def load_owned(directory, model_config, config: ModelConfig, device: torch.device,
               dtype: torch.dtype) -> LlamaForCausalLM:
    """The owned model straight from a safetensors checkpoint directory."""
    return _owned(lambda formats: weights.load(directory, model_config, formats, device, dtype), config, device, dtype)


def load_owned_gguf(path, model_config, config: ModelConfig, device: torch.device,
                    dtype: torch.dtype) -> LlamaForCausalLM:
    """The owned model from a GGUF file, its quantized tensors dequantized into the format `config` asks for."""
    from sluice.service.executor.models import gguf_weights

    return _owned(lambda formats: gguf_weights.load(path, model_config, device, dtype, formats), config, device, dtype)


def prepare_weights(model: nn.Module, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The model to run for a loaded transformers model: Sluice's own forward with its weights (in the formats
    `config` asks for) where the architecture is supported, else the model itself on the paged attention hook."""
    if isinstance(model, LlamaForCausalLM):  # built by load_model: its weights' formats were chosen at load
        return model
    reason = owned_path(model.config, config)
    if reason is None:
        return _owned(lambda formats: weights.from_transformers(model, formats, device, dtype), config, device, dtype)
    if not float_weights(config):
        raise ValueError(f"--quantization {config.quantization} needs Sluice's own forward, which this model cannot "
                         f"run ({reason})")
    logger.info("model path: transformers' %s with the paged attention hook (%s)", type(model).__name__, reason)
    model.eval()
    model.to(device=device, dtype=dtype)
    model.set_attn_implementation(register_attention(get_forward_context))
    return model


def _owned(build, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """build(weight format) with the formats `config` asks for, timed and logged."""
    start = time.perf_counter()
    formats = weight_format(config, device, dtype)
    model = build(formats)
    logger.info("model path: Sluice's own Llama-family forward; linears %s (%.1f s)", formats.describe(),
                time.perf_counter() - start)
    if device.type == "cpu":
        release_freed_memory()  # before the KV cache is sized from what is free
    return model
