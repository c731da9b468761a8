"""The owned model straight from a .gguf file: its quantized weights kept in the file's own blocks
(--quantization gguf), or dequantized into any other weight format.

Tensors are read from the file's directory (gguf_file.py) and named as transformers names them (gguf's tensor name
map); each quantized tensor is copied out of the file once, as its raw uint8 rows (`GgufBlocks`) or dequantized to
float32 by gguf's own dequantize (every type llama.cpp writes, as transformers' GGUF loader reads them); float
tensors keep their type. llama.cpp's converter permutes the rows of a llama q and k weight (and bias) for its rotary
layout: the rows are put back exactly as transformers' GGUF loader does (`reverse_permute`), which moves whole
rows, so the blocks are untouched. Config, tokenizer and chat template are read from the metadata (gguf_config.py,
gguf_tokenizer.py) where those can, else by transformers.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from sluice import native
from sluice.service.executor.kv_sizing import format_bytes, model_weight_bytes
from sluice.service.executor.layers.gguf_blocks import GgufBlocks, quantize
from sluice.service.executor.layers.gguf_linear import GgufFormat
from sluice.service.executor.layers.linear import WeightFormat
from sluice.service.executor.layers.quant_types import BY_NAME
from sluice.service.executor.models import weights
from sluice.service.executor.models.gguf_file import read_gguf
from sluice.service.executor.models.llama import LlamaForCausalLM

logger = logging.getLogger("sluice.engine")

FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}  # how numpy holds each
# What a type without a kernel here (the IQ types but IQ4_NL and IQ4_XS) is served in: Q8_0, 8.5 bits a weight,
# finer than any of those types (2-3.5 bits), so its values come back within Q8_0's rounding (half a step of
# max|w| / 127 per 32 inputs).
REQUANTIZED = "Q8_0"


def reverse_permute(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation for `heads` heads (transformers' reverse_permute on row
    indices): checkpoint row h * D + j * D / 2 + i is GGUF row h * D + 2 * i + j."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(2, 1).reshape(rows)


def read_tensors(path: Path, config, dequantize: bool = False) -> weights.Tensors:
    """Access by transformers name to the file's tensors: float tensors of the file's own type (float32, float16,
    bfloat16), and quantized ones as `GgufBlocks` (a type without a kernel here, an IQ type but IQ4_NL and IQ4_XS,
    requantized into Q8_0), or as float32 where `dequantize`."""
    import gguf
    from gguf.quants import dequantize as dequantized

    metadata, stored = read_gguf(path)
    arch_name = metadata.get(gguf.KEY_GENERAL_ARCHITECTURE)
    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name), None)
    if arch is None:
        raise ValueError(f"{path.name}: unknown GGUF architecture {arch_name!r}")
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    rewritten: set[str] = set()
    permuted = {"attn_q": config.num_attention_heads,
                "attn_k": config.num_key_value_heads or config.num_attention_heads} if arch_name == "llama" else {}

    def tensor(name: str):
        base, _, suffix = name.rpartition(".")
        gguf_name = names.get_name(base)
        t = stored.get(f"{gguf_name}.{suffix}") if gguf_name else None
        if t is None:
            return None
        qtype = t.type_name
        data = t.rows(FLOAT_TYPES.get(qtype, np.uint8))
        heads = permuted.get(gguf_name.rpartition(".")[2]) if suffix in ("weight", "bias") else None
        data = data[reverse_permute(data.shape[0], heads)] if heads else np.array(data)  # a copy of the bytes
        t.release()
        if qtype == "BF16":  # no numpy bfloat16: its bits, viewed by torch
            return torch.from_numpy(data).view(torch.bfloat16)
        if qtype in FLOAT_TYPES:  # F16 stays 16-bit: GgufFormat serves it as stored, a norm is widened
            return torch.from_numpy(data)
        if qtype in BY_NAME and not dequantize:
            return GgufBlocks(torch.from_numpy(data), qtype, int(t.dims[0]))
        kind, in_features = gguf.GGMLQuantizationType[qtype], int(t.dims[0])
        try:
            values = torch.from_numpy(dequantized(data, kind))
        except NotImplementedError as error:
            raise ValueError(f"{path.name}: {gguf_name}.{suffix} is {qtype}, which gguf cannot dequantize") from error
        if dequantize:
            return values
        if qtype not in rewritten:
            logger.info("%s: %s has no kernel here; its tensors are requantized into %s blocks", path.name, qtype,
                        REQUANTIZED)
            rewritten.add(qtype)
        return GgufBlocks(quantize(values, REQUANTIZED), REQUANTIZED, in_features)

    return tensor


def load(path: Path, config, device: torch.device, dtype: torch.dtype,
         formats: WeightFormat | None = None) -> LlamaForCausalLM:
    """The owned model of `config` with the weights of the GGUF file `path`: quantized ones as stored (`formats`
    None), or dequantized into `formats`."""
    from transformers import GenerationConfig

    as_stored = formats is None
    if as_stored and device.type != "cpu":
        raise ValueError(f"GGUF blocks are served on CPU, not {device}")
    formats = GgufFormat(dtype, native.load()) if as_stored else formats
    tensors = read_tensors(path, config.get_text_config(), dequantize=not as_stored)
    model = weights.build(config, tensors, formats, device, dtype, GenerationConfig.from_model_config(config))
    apply_rope_factors(model, path, tensors)
    resident, size = model_weight_bytes(model), path.stat().st_size
    logger.info("GGUF %s: %s resident weights for a %s file (%.2fx); linears %s", path.name, format_bytes(resident),
                format_bytes(size), resident / size, formats.describe())
    return model


def apply_rope_factors(model, path: Path, tensors: weights.Tensors | None = None) -> None:
    """Divide the owned model's rotary frequencies by the file's rope factors (rope_freqs.weight: Llama 3.1's
    scaling, as llama.cpp's converter stores it, with no rope type in the metadata), as llama.cpp does; a file
    without them is left alone. `tensors`: the file's (`read_tensors`), where the caller has them already."""
    tensors = tensors or read_tensors(path, model.config.get_text_config())
    factors = tensors("rope_freqs.weight")
    if factors is None:
        return
    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"{path.name} scales its rope per frequency (rope_freqs.weight), which only Sluice's own "
                         "forward applies (drop --no-owned-model)")
    inv_freq = model.rotary_emb.inv_freq
    if not isinstance(factors, torch.Tensor) or factors.dtype != torch.float32 or factors.shape != inv_freq.shape:
        raise ValueError(f"{path.name}: rope_freqs.weight is not one float32 factor per rotary frequency "
                         f"({inv_freq.numel()})")
    inv_freq /= factors.to(inv_freq.device)
