"""transformers' own ways to run the same prompts: static-batch `generate` and continuous-batching `generate_batch`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class BaselineResult:
    """Output tokens/s of one baseline on (possibly a subset of) a workload's prompts."""

    name: str
    num_prompts: int
    output_tokens: int
    duration_s: float
    tokens_per_s: float
    note: str = ""


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], output_len: int, pad_token_id: int) -> BaselineResult:
    """One static batch through model.generate: left padding, greedy, exactly output_len new tokens each."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    # min_new_tokens == max_new_tokens is generate's ignore_eos: every row makes exactly output_len tokens.
    config = GenerationConfig(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
                              pad_token_id=pad_token_id, eos_token_id=model.generation_config.eos_token_id)
    device = next(model.parameters()).device
    start = time.perf_counter()
    out = model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=config)
    duration = time.perf_counter() - start
    tokens = (out.shape[1] - width) * len(prompts)
    return BaselineResult("hf_generate", len(prompts), tokens, duration, tokens / duration)


def cb_config(prompts: list[list[int]], output_len: int, max_batch_tokens: int, max_seqs: int, page_size: int = 16):
    """A fair ContinuousBatchingConfig: Sluice's token budget and batch size, a cache that holds every request."""
    from transformers import ContinuousBatchingConfig

    per_request = max(len(p) for p in prompts) + output_len
    pages = len(prompts) * -(-per_request // page_size) + 8
    return ContinuousBatchingConfig(
        page_size=page_size, num_blocks=pages, max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=min(max_seqs, len(prompts)), use_cuda_graph=False, use_async_batching=False,
        allow_block_sharing=False,  # no shared prefixes in these workloads; prefix bookkeeping would only cost
    )


@torch.inference_mode()
def hf_generate_batch(
    model, prompts: list[list[int]], output_len: int, max_batch_tokens: int, max_seqs: int, note: str = ""
) -> BaselineResult:
    """model.generate_batch (transformers' continuous batching) with eos disabled, greedy, output_len tokens each."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=output_len, eos_token_id=-1, pad_token_id=0)
    cb = cb_config(prompts, output_len, max_batch_tokens, max_seqs)
    cb_logger = logging.getLogger("transformers.generation.continuous_batching")
    level = cb_logger.level
    cb_logger.setLevel(logging.ERROR)  # it warns about flash attention on every start
    try:
        start = time.perf_counter()
        outputs = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb, warmup=False)
        duration = time.perf_counter() - start
    finally:
        cb_logger.setLevel(level)
    failed = [k for k, v in outputs.items() if v.error is not None]
    if failed or len(outputs) != len(prompts):
        raise RuntimeError(f"generate_batch failed on {len(failed)} requests, returned {len(outputs)}/{len(prompts)}")
    tokens = sum(len(v.generated_tokens) for v in outputs.values())
    return BaselineResult("hf_generate_batch", len(prompts), tokens, duration, tokens / duration, note)
