"""The GGUF block type each linear's weight was stored in, for `--quantization gguf`.

A checkpoint converted from a GGUF (the default model, or `--model file.gguf`) holds dequantized float32 weights.
Q4_1 and Q8_0 blocks requantize into the int4 and int8 linears' layouts bit for bit (the same scales, minimums and
codes: `tests/engine/test_gguf_types.py` checks them against the file's raw blocks), so serving every linear in its GGUF
type serves exactly the file's weights. The types are read from the GGUF's tensor table at conversion time and
kept beside the safetensors as gguf_types.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TYPES_FILE = "gguf_types.json"


def read_linear_types(gguf_path: Path, linear_names: list[str]) -> dict[str, str]:
    """{linear name: GGUF type name ("Q4_1", "Q8_0", "F32", ...)} for the checkpoint linears `linear_names`
    (transformers' names); a head tied to the embedding ("lm_head" without a tensor of its own) gets the
    embedding's type."""
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    field = reader.fields[gguf.KEY_GENERAL_ARCHITECTURE]
    arch_name = bytes(field.parts[field.data[0]]).decode()
    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name), None)
    if arch is None:
        raise ValueError(f"{gguf_path.name}: unknown GGUF architecture {arch_name!r}")
    layers = 1 + max((int(n.split(".")[2]) for n in linear_names if n.startswith("model.layers.")), default=0)
    names = gguf.get_tensor_name_map(arch, layers)
    stored = {t.name: t.tensor_type.name for t in reader.tensors}

    def stored_type(module_name: str) -> str | None:
        gguf_name = names.get_name(module_name)
        return stored.get(f"{gguf_name}.weight") if gguf_name else None

    types = {}
    for name in linear_names:
        found = stored_type(name)
        if found is None and name == "lm_head":  # a head tied to the embedding has no tensor of its own
            found = stored_type("model.embed_tokens")
        if found is not None:
            types[name] = found
    return types


def save(types: dict[str, str], directory: Path) -> None:
    """Write gguf_types.json into a converted checkpoint's directory."""
    staged = directory / f".{TYPES_FILE}.{os.getpid()}"
    staged.write_text(json.dumps(types, indent=1, sort_keys=True))
    os.replace(staged, directory / TYPES_FILE)  # atomic: a concurrent reader never sees half a file


def load(directory: Path) -> dict[str, str] | None:
    """The types saved beside a converted checkpoint, or None."""
    path = directory / TYPES_FILE
    return json.loads(path.read_text()) if path.is_file() else None
