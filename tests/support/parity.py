"""The parity oracle's pieces: tiny random models of each architecture with twin weights, transformers' greedy
generate, the shared prompt mix and an engine over a given model."""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import torch

from sluice.service.bench.gpu_check import parity_prompts
from sluice.service.config import SluiceConfig
from sluice.service.engine.engine import LLMEngine
from sluice.service.executor.kv_sizing import model_context_length
from sluice.service.executor.layers.rotary import rope_parameters
from sluice.service.executor.models import weights
from tests.support import tiny

VOCAB = len(tiny.tokenizer())
SCALARS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "hidden_act",
           "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
           "pad_token_id")


def tiny_config(arch: str):
    import transformers

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
        eos_token_id=tiny.tokenizer().eos_token_id, bos_token_id=None, tie_word_embeddings=False,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "mistral":  # a window shorter than the longest prompt + output: masks some steps, not others
        return transformers.MistralConfig(sliding_window=64, **common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **common)
    raise ValueError(arch)


def config_reading(config) -> dict:
    """What the owned forward and the engine read of a config."""
    text = config.get_text_config()
    rope = rope_parameters(text)
    return {
        **{k: getattr(text, k, None) for k in SCALARS},
        "unsupported": weights.unsupported_reason(config),
        "attention": weights.attention_shape(text),
        "rope": (rope["rope_type"], float(rope["rope_theta"])),
        "windows": [weights.sliding_window(text, i) for i in range(text.num_hidden_layers)],
        "context": model_context_length(SimpleNamespace(config=config)),
    }


def build_pair(arch: str):
    """Two instances with identical random weights: one for the reference, one for Sluice."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch)
    torch.manual_seed(1234)
    reference = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    # A config of its own: the runner switches its model's config to paged attention.
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate of one prompt."""
    return hf_greedy_batch(model, [prompt], max_new_tokens)[0]


def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, **generate_kwargs) -> list[list[int]]:
    """transformers' greedy generate of each prompt, all in one left-padded call (a real model reads its weights once
    a step, not once a prompt a step); each row is cut after its first end token, where a one-prompt call stops."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, **generate_kwargs)
    eos = model.generation_config.eos_token_id
    ends = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    rows = out[:, width:].tolist()
    return [row[:next((i + 1 for i, t in enumerate(row) if t in ends), len(row))] for row in rows]


def mixed_prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    """The same prompt mix make gpu-check runs: half share a 48-token prefix."""
    return parity_prompts(VOCAB, n, seed)


def make_engine(model, mode: str, num_blocks: int, block_size: int = 16, budget: int = 64, cache: dict | None = None,
                **sched):
    """A float32 CPU engine on `model`; `cache` and `sched` override CacheConfig and SchedulerConfig fields."""
    cfg = SluiceConfig()
    cfg.model.device, cfg.model.dtype = "cpu", "float32"
    cfg.cache.block_size = block_size
    cfg.cache.num_kv_blocks = num_blocks
    cfg.cache.swap_space = 0.01
    cfg.scheduler.max_num_batched_tokens = budget
    cfg.scheduler.max_num_seqs = 16
    cfg.scheduler.preemption_mode = mode
    for k, v in (cache or {}).items():
        setattr(cfg.cache, k, v)
    for k, v in sched.items():
        setattr(cfg.scheduler, k, v)
    return LLMEngine(cfg, model=model, tokenizer=tiny.tokenizer())


MAX_NEW = 20


@functools.cache
def reference_case(arch: str):
    """The reference outputs are computed once per architecture and shared by both preemption modes."""
    reference, ours = build_pair(arch)
    prompts = mixed_prompts()
    return ours, prompts, [hf_greedy(reference, p, MAX_NEW) for p in prompts]
