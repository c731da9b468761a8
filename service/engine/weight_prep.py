"""Readies a loaded model's weights for the device: quantized, oneDNN-prepacked (read by our GEMV when decoding)
or plain linears with decode kernels, fused norms, lean Llama layers."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from sluice.service.config import ModelConfig
from sluice.service.engine import cpu_ops
from sluice.service.engine.cpu import release_freed_memory
from sluice.service.engine.decode_linear import KERNEL_MAX_ROWS as DECODE_KERNEL_MAX_ROWS
from sluice.service.engine.decode_linear import onednn_linear_available, use_decode_kernels
from sluice.service.engine.fused_norm import FUSED_DTYPES, fuse_rms_norms
from sluice.service.engine.lean_layers import lean_llama_layers
from sluice.service.engine.prepack import PackedLinear, can_prepack, pad_linear_rows, prepack_linears
from sluice.service.engine.quantize import quantize

logger = logging.getLogger("sluice.engine")


def prepare_weights(model: nn.Module, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                    gguf_types: dict[str, str] | None = None) -> None:
    """Swap the model's linears and norms, in place, for the kernels this device and precision run fastest."""
    if config.quantization != "none":
        start = time.perf_counter()
        logger.info("%s: quantized %d linear layers in %.1f s", config.quantization,
                    quantize(model, config.quantization, gguf_types), time.perf_counter() - start)
    elif config.prepack_weights and can_prepack(device, dtype):
        packed = prepack_linears(model)  # in place: the engine owns the model it runs (idempotent)
        gemv = [m.gemv_max_rows for m in model.modules() if isinstance(m, PackedLinear) and m.gemv_layout]
        logger.info("prepacked %d linear layers for oneDNN; %d read by the packed-layout GEMV up to %d rows",
                    packed, len(gemv), max(gemv, default=0))
        _plain_with_decode_kernels(model, dtype)  # what stayed plain: a head tied to the embedding
    elif device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        _plain_with_decode_kernels(model, dtype)
    if device.type == "cpu" and dtype in FUSED_DTYPES and cpu_ops.load() is not None:
        logger.info("fused %d RMSNorm layers into one C++ op each", fuse_rms_norms(model))
    if device.type == "cpu" and config.lean_layers:
        counts = lean_llama_layers(model)
        logger.info("lean Llama forwards: %s", ", ".join(f"{n} {kind}" for kind, n in counts.items()))
    if device.type == "cpu":
        release_freed_memory()  # before the KV cache is sized from what is free


def _plain_with_decode_kernels(model: nn.Module, dtype: torch.dtype) -> None:
    """Pad the plain linears' row counts and, where the C++ GEMV for this dtype wins, give them its path."""
    padded = pad_linear_rows(model)  # bounds oneDNN's per-shape kernel cache (see PaddedLinear)
    if not padded:
        return
    if decode_kernel_wins(dtype):
        logger.info("CPU %s: %d linears on plain weights, batches of up to %d rows in the C++ kernel",
                    str(dtype).removeprefix("torch."), use_decode_kernels(model), DECODE_KERNEL_MAX_ROWS)
    else:
        logger.info("CPU %s: %d linears unpacked with padded row counts", str(dtype).removeprefix("torch."), padded)


def decode_kernel_wins(dtype: torch.dtype) -> bool:
    """Whether plain weights with the C++ decode GEMV beat the alternatives for this dtype on this CPU."""
    ops = cpu_ops.load()
    if ops is None:
        return False
    if dtype == torch.bfloat16:
        return ops.bf16_linear_is_native()  # the scalar fallback loses to oneDNN's bf16 path
    return onednn_linear_available()  # larger fp32 calls need oneDNN on the plain weight (MKL's sgemm is slower)
