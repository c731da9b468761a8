"""`sluice serve --speculative-method ngram` over HTTP: the same greedy text as the engine without speculation,
streamed or not, and the spec_decode counters on /metrics under both names."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from tests.support import tiny
from tests.support.http import get, post, stream
from tests.support.server import MODEL, Server

PROMPTS = [
    "Hello world, how are you today? Hello world, how are you today? Hello world, how",  # text to copy
    "café naïve 😀 Paris",  # nothing to copy
]


@pytest.fixture(scope="module")
def copying_model_dir(tmp_path_factory) -> str:
    """The tiny model with its blocks' outputs damped: its greedy text soon repeats, so drafts are accepted."""
    from transformers import AutoModelForCausalLM

    path = tiny.save_tiny_model(str(tmp_path_factory.mktemp("copying")))
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def spec_server(copying_model_dir, tmp_path_factory):
    srv = Server(copying_model_dir, tmp_path_factory.mktemp("logs"), "--speculative-method", "ngram",
                 "--num-speculative-tokens", "4", "--prompt-lookup-min", "1", "--vllm-metric-names").wait_ready()
    yield srv
    srv.stop()


def expected_texts(model_dir: str, max_tokens: int) -> list[str]:
    engine = tiny.tiny_engine(model_dir, 64)
    from sluice.scheduling.sampling_params import SamplingParams

    return [c.text for c in engine.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0))]


def counter(body: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", body, re.M))


def test_greedy_text_over_http_equals_the_engine_without_speculation(spec_server, copying_model_dir):
    want = expected_texts(copying_model_dir, 48)

    async def run():
        texts = []
        for prompt in PROMPTS:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 48, "temperature": 0}
            status, reply, _ = await post(spec_server.url, "/v1/completions", body)
            assert status == 200, reply
            events = await stream(spec_server.url, "/v1/completions", {**body, "stream": True})
            streamed = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
            assert streamed == reply["choices"][0]["text"]
            texts.append(reply["choices"][0]["text"])
        return texts, (await get(spec_server.url, "/metrics"))[1].decode()

    texts, metrics = asyncio.run(run())
    assert texts == want
    drafted = counter(metrics, "sluice_spec_decode_num_draft_tokens_total")
    accepted = counter(metrics, "sluice_spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted, (accepted, drafted)
    assert counter(metrics, "sluice_spec_decode_num_drafts_total") > 0
    assert counter(metrics, "sluice_spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert counter(metrics, "vllm:spec_decode_num_accepted_tokens_total") == accepted
    assert counter(metrics, "vllm:spec_decode_num_draft_tokens_total") == drafted


def test_a_seeds_text_is_the_same_with_logprobs_which_turn_drafts_off(spec_server):
    """Issue 53's probe: the same seeded sampled request with and without `logprobs` (no drafts with them) gives
    the same text, since each position draws from (seed, position) whether drafts were proposed or not."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0.4, "top_p": 0.95}

    async def run():
        texts = []
        for seed in (7, 8, 9):
            before = counter((await get(spec_server.url, "/metrics"))[1].decode(),
                             "sluice_spec_decode_num_drafts_total")
            status, plain, _ = await post(spec_server.url, "/v1/completions", {**body, "seed": seed})
            after = counter((await get(spec_server.url, "/metrics"))[1].decode(),
                            "sluice_spec_decode_num_drafts_total")
            status2, with_lp, _ = await post(spec_server.url, "/v1/completions", {**body, "seed": seed, "logprobs": 1})
            assert status == status2 == 200, (plain, with_lp)
            texts.append((plain["choices"][0]["text"], with_lp["choices"][0]["text"], after > before))
        return texts

    texts = asyncio.run(run())
    assert all(a == b for a, b, _ in texts), texts
    assert any(drafted for _, _, drafted in texts)  # drafts were proposed without logprobs
    assert len({a for a, _, _ in texts}) > 1  # and the seeds matter
