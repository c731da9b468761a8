"""peft LoRA adapters for tests: random-initialized on a model directory, with deltas large enough to matter."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: str, out: str, seed: int, targets=ALL_TARGETS, r: int = 8, scale: float = 0.3) -> str:
    """A random-initialized peft LoRA adapter of the model at `model_dir`, saved to `out`; large enough deltas
    to change greedy output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                 init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(scale / p.abs().mean())
    peft_model.save_pretrained(out)
    return out


def call(srv, path: str, body=None, headers: dict | None = None) -> tuple[int, str]:
    """(status, body text) of a GET (body None) or a JSON POST to a test server, with `headers`."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(srv.url + path, data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
