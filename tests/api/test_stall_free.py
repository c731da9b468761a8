"""Stall-free and fair, end to end (issue 54): `sluice serve` on SmolLM2, a stream decoding while one completions
call with 32 long prompts is prefilled, and a one-line chat sent meanwhile (`sluice bench serve --mixed`).

Before the latency budget and fair shares the stream fell to ~6% of its idle rate and the chat waited for the whole
batch (17 s at 16 x 1,024 tokens on 2 cores). The design keeps the stream at half its idle rate or better, which
leaves the batch at most half of each step: 2x its time alone at best, against the issue's 2.5x (bench figures in
the issue's note). This test asks for 40% and 3x with three tries, so that a neighbour taking the cores for a few
seconds cannot fail it, while any return of the stall still does: that is 6%, in every try. The slowdown is the
ratio of two single timings a few seconds apart: on a shared machine it spread from 1.55x to 2.68x over six runs of
the same build, where a batch the target starved (a block every few steps) would take 8x or more.
"""

from __future__ import annotations

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice.service.bench.mixed import MixedWorkload, mixed_lines, run_mixed
from sluice.service.bench.serve import ServeConfig
from tests.support.server import Server

pytestmark = [pytest.mark.slow, pytest.mark.canary, pytest.mark.deep, pytest.mark.anyio, pytest.mark.timeout(600)]
MIN_RATE_RATIO = 0.4  # of the stream's idle rate, per try (the design gives >= 0.5)
CHAT_TTFT_S = 5.0  # the bound on a one-line chat's first token
MAX_SLOWDOWN = 3.0  # the batch beside the stream against alone, per try (the issue asks 2.5)
TRIES = 3


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    srv = Server(str(smollm2_dir), tmp_path_factory.mktemp("logs"), "--max-model-len", "2048",
                 "--kv-cache-memory", "1", "--tenant-header", "x-tenant", name="stall-free").wait_ready(timeout=300)
    yield srv
    srv.stop()


async def test_a_stream_and_a_chat_beside_a_32_prompt_request(server):
    results = []
    for attempt in range(TRIES):
        w = MixedWorkload(streams=1, stream_output_len=1500, long_prompts=32, long_input_len=256, idle_s=2.0,
                          probe_delay_s=1.0, alone=True, seed=attempt)
        r = await run_mixed(ServeConfig(base_url=server.url, model="tiny", timeout_s=300, progress=False), w)
        print("\n".join(mixed_lines(r)))
        assert not r.errors, r.errors
        results.append((round(r.rate_ratio, 2), round(r.probe_ttft_ms), round(r.slowdown, 2)))
        if r.rate_ratio >= MIN_RATE_RATIO and r.probe_ttft_ms <= CHAT_TTFT_S * 1e3 and r.slowdown <= MAX_SLOWDOWN:
            return
    pytest.fail(f"(stream rate ratio, chat TTFT ms, batch slowdown) in each try: {results}")


async def tenant_tokens(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return {sample.labels["tenant"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == "sluice_tenant_served_tokens_total"}


async def test_the_tenant_header_names_whom_a_request_is_charged_to(server):
    before = await tenant_tokens(server.url)
    body = {"model": "tiny", "prompt": ["One, two, three,", "Red, green,"], "max_tokens": 5, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/v1/completions", json=body, headers={"x-tenant": "acme"}) as r:
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
        async with s.post(server.url + "/v1/completions", json=body) as r:  # no header: no tenant series
            assert r.status == 200
    after = await tenant_tokens(server.url)
    served = after.get("acme", 0) - before.get("acme", 0)
    assert 0 < served <= usage["prompt_tokens"] + usage["completion_tokens"]  # cached prompt blocks are free
    assert served >= usage["completion_tokens"]
    assert set(after) <= {"acme", "other"}
