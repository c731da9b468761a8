"""ModelRunner driven by hand-built SchedulerOutputs must reproduce transformers' greedy generate."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import transformers

from sluice.kvcache.config import CacheConfig
from sluice.kvcache.kv_tensors import kv_block_bytes
from sluice.scheduling.output import ScheduledRequest, SchedulerOutput
from sluice.scheduling.sampling_params import SamplingParams
from sluice.service.config import ModelConfig
from sluice.service.engine.attention_backend import ATTN_IMPLEMENTATION, get_forward_context
from sluice.service.engine.model_runner import ModelRunner
from sluice.service.engine.models.llama import LlamaForCausalLM
from sluice.service.engine.weight_prep import prepare_weights

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
    }[arch]()
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    # A config of its own: the runner switches its model's attention implementation on the config.
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


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


@pytest.mark.parametrize("arch,owned", [("llama", True), ("qwen2", True), ("qwen3", True), ("llama", False),
                                        ("qwen3", False)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_and_batched_decode_match_generate(arch, owned, block_size):
    """Sluice's own forward, and transformers' model on the paged attention hook (the fallback path)."""
    reference, model = tiny_pair(arch)
    runner = make_runner(model, block_size=block_size, num_blocks=256 // block_size, owned=owned)
    assert owned or model.config._attn_implementation == ATTN_IMPLEMENTATION
    p = prompts()
    n_new = 8
    driver = Driver(runner)
    for rid in "abc":
        driver.add(rid, p[rid])
    driver.step({"a": 16, "b": None})  # a: first chunk (no sample), b: whole prompt
    driver.step({"a": None, "b": 1, "c": None})  # a: second chunk on top of cached context
    driver.add("d", p["d"])
    driver.step({"a": 1, "d": 10, "b": 1, "c": 1})  # decodes around a prefill chunk
    driver.step({"d": None, "c": 1, "a": 1, "b": 1})
    while any(len(driver.outputs(r)) < n_new for r in "abcd"):
        driver.step({r: 1 for r in "abcd" if len(driver.outputs(r)) < n_new})
    for rid in "abcd":
        assert driver.outputs(rid)[:n_new] == hf_greedy(reference, p[rid], n_new), rid


def test_swap_out_and_in_to_other_blocks_continues_identically():
    reference, model = tiny_pair("llama")
    runner = make_runner(model, block_size=4, num_blocks=32, swap_space=0.001)
    assert runner.num_host_blocks > 0
    p = prompts(1)["a"]
    driver = Driver(runner)
    driver.add("a", p)
    driver.step({"a": None})
    driver.step({"a": 1})
    old = driver.blocks["a"]
    host = list(range(len(old)))
    driver.step({}, swap_out=list(zip(old, host, strict=True)))
    runner.kv.kv[:, :, old] = torch.randn_like(runner.kv.kv[:, :, old])  # blocks reused by someone else
    new = [driver.free.pop() for _ in old]
    driver.blocks["a"] = new
    driver.step({"a": 1}, swap_in=list(zip(host, new, strict=True)))  # swap back in, then compute in the same step
    for _ in range(3):
        driver.step({"a": 1})
    assert driver.outputs("a") == hf_greedy(reference, p, 6)


def test_logprobs_and_seeded_sampling_through_the_runner():
    _, model = tiny_pair("qwen2")
    runner = make_runner(model)
    p = prompts(2)
    driver = Driver(runner)
    driver.add("g", p["b"], SamplingParams(temperature=0.0, logprobs=2))
    driver.add("s", p["c"], SamplingParams(temperature=1.0, seed=42))
    driver.step({"g": None, "s": None})
    driver.step({"g": 1, "s": 1})
    lps = driver.logprobs["g"]
    assert len(lps) == 2 and not driver.logprobs["s"]
    for lp, token in zip(lps, driver.outputs("g"), strict=True):
        assert lp.token_id == token and lp.top[0][0] == token and len(lp.top) == 2 and lp.logprob <= 0

    alone = Driver(make_runner(tiny_pair("qwen2")[1]))
    alone.add("s", p["c"], SamplingParams(temperature=1.0, seed=42))
    alone.step({"s": None})
    alone.step({"s": 1})
    assert alone.outputs("s") == driver.outputs("s")


def test_cache_sized_from_memory_budget():
    _, model = tiny_pair("llama")
    cache = CacheConfig(block_size=16, num_kv_blocks=0, kv_cache_memory=0.001, swap_space=0.002)
    runner = ModelRunner(model, cache, "cpu", torch.float32, max_num_batched_tokens=64, max_num_seqs=4)
    per_block = kv_block_bytes(2, 2, 16, 16, torch.float32)
    assert runner.num_kv_blocks == int(0.001 * 2**30) // per_block
    assert runner.num_host_blocks == int(0.002 * 2**30) // per_block
    assert runner.kv_cache_bytes == runner.num_kv_blocks * per_block
    assert runner.execute(SchedulerOutput()).sampled == {}


def test_forward_context_required():
    with pytest.raises(RuntimeError, match="set_forward_context"):
        get_forward_context()
