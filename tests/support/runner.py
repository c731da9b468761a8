"""ModelRunner helpers: twin tiny models and a hand-driven stand-in for the scheduler."""

from __future__ import annotations

import copy
import random

import torch
import transformers

from sluice.kvcache.config import CacheConfig
from sluice.scheduling.output import ScheduledRequest, SchedulerOutput
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.config import ModelConfig
from sluice.service.executor.model_runner import ModelRunner
from sluice.service.executor.models.llama import LlamaForCausalLM
from sluice.service.executor.weight_prep import prepare_weights

VOCAB = 512


CPU = torch.device("cpu")


GREEDY = SamplingParams(max_tokens=64, temperature=0.0)


def tiny_pair(arch: str):
    """Two models with identical random weights: an sdpa reference and one for the runner."""
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, eos_token_id=None,
        bos_token_id=None, pad_token_id=None,
    )
    config = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "qwen3": lambda: transformers.Qwen3Config(head_dim=16, **common),
        "mistral": lambda: transformers.MistralConfig(sliding_window=16, **common),  # a window on every layer
    }[arch]()
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    # A config of its own: the runner switches its model's attention implementation on the config.
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


class Driver:
    """A minimal stand-in for the scheduler: tracks tokens, progress and (shuffled) block tables."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        self.runner = runner
        self.bs = runner.block_size
        self.free = list(range(runner.num_kv_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous block tables
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.logprobs: dict[str, list] = {}

    def add(self, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> None:
        self.tokens[rid], self.prompt_len[rid], self.computed[rid] = list(prompt), len(prompt), 0
        self.blocks[rid], self.params[rid], self.logprobs[rid] = [], params, []

    def outputs(self, rid: str) -> list[int]:
        return self.tokens[rid][self.prompt_len[rid]:]

    def step(self, plan: dict[str, int | None], **extra) -> None:
        """plan: request -> tokens to compute this step (None: all remaining)."""
        scheduled = []
        for rid, n in plan.items():
            done, tokens = self.computed[rid], self.tokens[rid]
            n = len(tokens) - done if n is None else n
            while len(self.blocks[rid]) * self.bs < done + n:
                self.blocks[rid].append(self.free.pop())
            scheduled.append(ScheduledRequest(
                request_id=rid, token_ids=tokens[done:done + n], start_pos=done, block_ids=list(self.blocks[rid]),
                sample=done + n == len(tokens), sampling_params=self.params[rid],
                num_output_tokens=len(tokens) - self.prompt_len[rid],
                output_token_ids=self.outputs(rid),
            ))
            self.computed[rid] = done + n
        result = self.runner.execute(SchedulerOutput(scheduled, sum(s.num_tokens for s in scheduled), **extra))
        assert set(result.sampled) == {s.request_id for s in scheduled if s.sample}
        for rid, token in result.sampled.items():
            self.tokens[rid].append(token)
            if rid in result.logprobs:
                self.logprobs[rid].append(result.logprobs[rid])


def make_runner(model, block_size=4, num_blocks=64, swap_space=0.0, owned=True):
    """A runner on Sluice's own model of `model`'s weights (owned) or on the transformers model itself."""
    cache = CacheConfig(block_size=block_size, num_kv_blocks=num_blocks, swap_space=swap_space)
    model = prepare_weights(model, ModelConfig(owned_model=owned), CPU, torch.float32)
    assert isinstance(model, LlamaForCausalLM) == owned
    return ModelRunner(model, cache, CPU, torch.float32, max_num_batched_tokens=128, max_num_seqs=8)


def prompts(seed=0):
    rng = random.Random(seed)
    return {rid: [rng.randrange(VOCAB) for _ in range(n)] for rid, n in (("a", 37), ("b", 20), ("c", 5), ("d", 23))}
