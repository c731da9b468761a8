"""A peft LoRA checkpoint (`adapter_config.json` + `adapter_model.safetensors`) read and checked against the model.

Only what the owned forward can apply is accepted: plain LoRA (no DoRA, no bias, no modules to save) on the
attention and MLP projections, rank at most `--max-lora-rank`, every tensor the shape the base model's linear
needs. The tensors' shapes are checked from the safetensors header before any weight is read, and the file's size
is bounded by what an adapter of the maximum rank can hold, so a bad or huge file costs no memory.

A refusal's message goes to the client: it says what is wrong in the server's own words and never quotes the files
(their values, tensor names, parser errors) nor a path; `LoRAError.detail` holds those, for the log only.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.service.executor.models.weights import attention_shape

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# The owned model's fused linears and the checkpoint modules each is made of, in the order of its output rows.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
TARGETS = frozenset(part.split(".")[-1] for parts in FUSED_PARTS.values() for part in parts)
_CONFIG_BYTES = 1 << 20
_TENSOR = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.((?:self_attn|mlp)\.\w+)\.lora_([AB])\.weight")


class LoRAError(ValueError):
    """An adapter that cannot be served (or a load or unload refused): the message, for the client, says why in
    the server's words; `param` names the field, `status` and `code` the API's answer; `detail` says more, for the
    log only (it may quote the files)."""

    def __init__(self, message: str, param: str = "lora_path", *, status: int = 400,
                 code: str = "invalid_lora_adapter", detail: str = "") -> None:
        super().__init__(message)
        self.param, self.status, self.code, self.detail = param, status, code, detail


@dataclass(frozen=True, slots=True)
class Geometry:
    """What an adapter is checked against: the base model's layers and each checkpoint linear's (out, in)."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]  # "self_attn.q_proj" -> (out_features, in_features)

    @classmethod
    def of(cls, config) -> Geometry:
        """The geometry of a Llama-family transformers config."""
        config = config.get_text_config()
        heads, kv_heads, head_dim = attention_shape(config)
        e, i = config.hidden_size, config.intermediate_size
        shapes = {"self_attn.q_proj": (heads * head_dim, e), "self_attn.k_proj": (kv_heads * head_dim, e),
                  "self_attn.v_proj": (kv_heads * head_dim, e), "self_attn.o_proj": (e, heads * head_dim),
                  "mlp.gate_proj": (i, e), "mlp.up_proj": (i, e), "mlp.down_proj": (e, i)}
        return cls(config.num_hidden_layers, shapes)

    def max_bytes(self, max_rank: int) -> int:
        """The largest adapter file of rank `max_rank` on every module, float32, with room for its header."""
        per_layer = sum(max_rank * (out + inp) for out, inp in self.shapes.values())
        return 4 * per_layer * self.num_layers + (1 << 20)


@dataclass(slots=True)
class LoRAWeights:
    """One adapter: per layer and checkpoint module, (A [r, in], B [out, r] times the adapter's scale)."""

    rank: int
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        """Host memory its tensors take."""
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def read_adapter(path: str | Path, geometry: Geometry, max_rank: int, dtype: torch.dtype) -> LoRAWeights:
    """The adapter in the peft directory `path`, checked; LoRAError for anything the model cannot apply."""
    try:
        return _read(path, geometry, max_rank, dtype)
    except OSError as e:  # unreadable (permissions, a file gone between the checks): a 400, not a 500
        raise LoRAError("the adapter's files cannot be read", detail=f"{type(e).__name__}: {e}") from None


def _read(path: str | Path, geometry: Geometry, max_rank: int, dtype: torch.dtype) -> LoRAWeights:
    from safetensors import safe_open

    directory = Path(path)
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not directory.is_dir() or not config_file.is_file() or not weights_file.is_file():
        raise LoRAError(f"lora_path is not a peft LoRA directory (with {CONFIG_FILE} and {WEIGHTS_FILE})",
                        detail=f"path {str(path)!r}")
    if config_file.stat().st_size > _CONFIG_BYTES:
        raise LoRAError(f"{CONFIG_FILE} is larger than {_CONFIG_BYTES} bytes")
    limit = geometry.max_bytes(max_rank)
    if weights_file.stat().st_size > limit:
        raise LoRAError(f"{WEIGHTS_FILE} holds more than an adapter of rank {max_rank} can ({limit} bytes)")
    try:
        with open(config_file, "rb") as f:
            config = json.loads(f.read(_CONFIG_BYTES + 1))  # bounded even if the file grew since its stat
    except ValueError as e:
        raise LoRAError(f"{CONFIG_FILE} is not valid JSON", detail=str(e)) from None
    rank, scale = _check_config(config, max_rank)
    try:
        with safe_open(str(weights_file), framework="pt", device="cpu") as f:
            names = list(f.keys())
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in names}
            pairs = _pair(names, shapes, geometry, rank)
            modules = {key: (f.get_tensor(a).to(dtype), (f.get_tensor(b).float() * scale).to(dtype))
                       for key, (a, b) in pairs.items()}
    except LoRAError:
        raise
    except Exception as e:  # safetensors' own error types for a truncated or foreign file
        raise LoRAError(f"{WEIGHTS_FILE} cannot be read (not a safetensors file, or a truncated one)",
                        detail=f"{type(e).__name__}: {e}") from None
    if not modules:
        raise LoRAError("the adapter holds no LoRA weights for the model's projections")
    return LoRAWeights(rank, modules)


def _check_config(config: dict, max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scale (alpha / r, or alpha / sqrt(r) with rsLoRA) from its peft config."""
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoRAError("only peft LoRA adapters are supported (peft_type LORA)")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not _finite(alpha):
        raise LoRAError(f"{CONFIG_FILE} needs a positive integer r and a finite numeric lora_alpha")
    if rank > max_rank:
        raise LoRAError(f"the adapter's rank (r in {CONFIG_FILE}) is above --max-lora-rank {max_rank}",
                        detail=f"r {rank}")
    unsupported = [k for k in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "fan_in_fan_out",
                               "layers_to_transform") if config.get(k)]
    if config.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise LoRAError(f"adapter options not supported: {', '.join(unsupported)}")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    if not isinstance(targets, list):
        raise LoRAError(f"target_modules in {CONFIG_FILE} must be a string or a list")
    unknown = sorted({str(t) for t in targets} - TARGETS)
    if unknown:
        raise LoRAError(f"{CONFIG_FILE} names target modules the model does not have; supported: "
                        f"{', '.join(sorted(TARGETS))}", detail=f"target_modules {unknown!r}"[:1000])
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _finite(value) -> bool:
    """A finite number (JSON allows NaN, Infinity and integers too large for a float)."""
    try:
        return isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:
        return False


def _pair(names: list[str], shapes: dict[str, tuple], geometry: Geometry, rank: int) -> dict:
    """(layer, module) -> (A name, B name), every shape checked against the model."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name in names:
        m = _TENSOR.fullmatch(name)
        if m is None:
            raise LoRAError(f"{WEIGHTS_FILE} holds a tensor that is not a LoRA weight of the model's projections",
                            detail=f"tensor {name!r}"[:1000])
        layer, module, which = int(m[1]), m[2], m[3]
        if module not in geometry.shapes or layer >= geometry.num_layers:
            raise LoRAError(f"{WEIGHTS_FILE} holds a tensor for a layer or linear the base model does not have",
                            detail=f"tensor {name!r}"[:1000])
        out, inp = geometry.shapes[module]
        want = (rank, inp) if which == "A" else (out, rank)
        if shapes[name] != want:
            raise LoRAError(f"{WEIGHTS_FILE} holds a tensor whose shape does not fit the base model's linear "
                            f"and the adapter's rank (r in {CONFIG_FILE})",
                            detail=f"tensor {name!r} has shape {list(shapes[name])}, the base model needs {list(want)}")
        found.setdefault((layer, module), {})[which] = name
    missing = [f"layers.{k[0]}.{k[1]}" for k, v in found.items() if len(v) != 2]
    if missing:
        raise LoRAError(f"{WEIGHTS_FILE} holds a lora_A without its lora_B, or the reverse",
                        detail=f"for {missing[0]}")
    return {k: (v["A"], v["B"]) for k, v in found.items()}
