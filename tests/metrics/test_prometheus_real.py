"""A real Prometheus scrapes a real `sluice serve` under load; every dashboard and alert expression runs on it.

The load forces a preemption (more concurrent long requests than the small KV cache holds), drops a stream
mid-way, sends an invalid request and repeats a prompt for prefix-cache hits. Afterwards every dashboard
expression must parse and return data, every alert expression must parse and evaluate, and the gauges must
show an idle, entirely free cache. Also run by `make prometheus-check`.
"""

from __future__ import annotations

import asyncio
import math
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from sluice.metrics.prometheus import CONTENT_TYPE
from sluice.service.bench import promql_check as pc
from tests.support.server import MODEL as MODEL_NAME
from tests.support.server import Server, free_port
from tests.support.tiny import save_tiny_model

pytestmark = pytest.mark.timeout(600)  # generous for a first-run apt-get; the check itself takes ~30 s

NUM_KV_BLOCKS = 24  # of 16 tokens (the Server's block size): eight 140-token requests cannot all fit
PROMPT = list(range(10, 50))  # 40 token ids, shared by every request (prefix-cache hits)
MAX_TOKENS = 100


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), ""


def wait_until(predicate, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    try:
        return pc.ensure_prometheus()[0]
    except RuntimeError as err:
        pytest.skip(f"cannot install Prometheus here: {err}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`sluice serve` on a tiny random Llama with a small KV cache and swap preemption; yields its base URL."""
    tmp = tmp_path_factory.mktemp("sluice")
    srv = Server(
        save_tiny_model(str(tmp / "model")), tmp, "--dtype", "float32", "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--swap-space", "0.001", "--preemption-mode", "swap", "--max-num-batched-tokens", "256",
        "--shutdown-timeout", "5",
    )
    try:
        yield srv.wait_ready().url
    finally:
        srv.stop()


async def drive_load(base: str) -> None:
    """Concurrent long streams (preemption), one dropped stream (abort), an invalid request, repeats (prefix hits)."""
    timeout = aiohttp.ClientTimeout(total=120)
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}

    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def complete(stream: bool) -> None:
            async with session.post(f"{base}/v1/completions", json={**body, "stream": stream}) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()

        async def drop_after_first_chunk() -> None:
            async with session.post(f"{base}/v1/completions", json={**body, "stream": True}) as resp:
                assert resp.status == 200, await resp.text()
                await resp.content.readuntil(b"\n\n")  # first SSE event, then hang up mid-stream
                resp.close()

        await complete(stream=False)  # fills the prefix cache with the shared prompt
        await asyncio.gather(*(complete(stream=True) for _ in range(8)), drop_after_first_chunk())
        async with session.post(f"{base}/v1/completions", json={**body, "temperature": 9}) as resp:
            assert resp.status == 400, await resp.text()
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
        async with session.post(f"{base}/v1/chat/completions", json=chat) as resp:
            assert resp.status == 200, await resp.text()


def scalar(url: str, expr: str) -> float:
    body = pc.query(url, expr)
    assert body["status"] == "success", body
    result = body["data"]["result"]
    assert result, f"no data for {expr}"
    return float(result[0]["value"][1])


def test_dashboard_and_alerts_against_real_prometheus(server, prometheus_binary, tmp_path):
    status, text, content_type = http_get(server + "/metrics")
    assert status == 200 and b"sluice_kv_cache_total_blocks" in text
    assert content_type.split(";")[0] == CONTENT_TYPE.split(";")[0]

    port = free_port()
    target = server.removeprefix("http://")
    with pc.PrometheusServer(prometheus_binary, tmp_path / "prom", port, [target], [pc.ALERTS]) as prom:
        prom.wait_ready()
        url = prom.url
        wait_until(lambda: pc.query(url, 'up{job="sluice"} == 1')["data"]["result"], 20, "the first scrape")

        load_start = time.time()
        asyncio.run(drive_load(server))

        # Idle again: the last engine step left every gauge at rest. Two more scrapes record that state.
        def idle() -> bool:
            body = http_get(server + "/metrics")[1].decode()
            return f'sluice_requests_running{{model_name="{MODEL_NAME}"}} 0.0' in body and (
                f'sluice_requests_waiting{{model_name="{MODEL_NAME}"}} 0.0' in body
            )

        wait_until(idle, 30, "the engine to go idle")
        idle_at = time.time()  # scrapes come each second: a last one past idle_at + 1 s is the second since idle
        wait_until(lambda: scalar(url, 'timestamp(up{job="sluice"})') > idle_at + 1, 20,
                   "two scrapes of the idle engine")
        at = time.time()
        rate_interval = f"{math.ceil(at - load_start) + 5}s"  # one window spanning the whole load

        problems = pc.check(url, MODEL_NAME, rate_interval, at)
        assert not problems, "\n".join(problems) + "\n" + prom.log_tail()

        # The load did what it was meant to, as Prometheus saw it.
        sel = f'model_name="{MODEL_NAME}"'
        assert scalar(url, f"sum(sluice_preemptions_total{{{sel}}})") >= 1
        assert scalar(url, f'sluice_requests_finished_total{{{sel}, finish_reason="abort"}}') >= 1
        # 1 + 8 ignore_eos runs
        assert scalar(url, f'sluice_requests_finished_total{{{sel}, finish_reason="length"}}') >= 9
        assert scalar(url, f'sluice_requests_rejected_total{{{sel}, reason="invalid"}}') >= 1
        assert scalar(url, f"sluice_prefix_cache_hit_tokens_total{{{sel}}}") > 0
        assert scalar(url, f"sluice_kv_cache_total_blocks{{{sel}}}") == NUM_KV_BLOCKS
        assert scalar(url, f"sluice_kv_cache_free_blocks{{{sel}}}") == NUM_KV_BLOCKS
        assert scalar(url, f"sluice_kv_cache_usage_ratio{{{sel}}}") == 0
        assert scalar(url, f"sluice_swap_free_blocks{{{sel}}}") == scalar(url, f"sluice_swap_total_blocks{{{sel}}}")
        assert scalar(url, f"sluice_requests_swapped{{{sel}}}") == 0
        for q in ("sluice_time_to_first_token_seconds", "sluice_inter_token_latency_seconds",
                  "sluice_e2e_request_latency_seconds", "sluice_request_queue_time_seconds"):
            p99 = scalar(url, f"histogram_quantile(0.99, sum by (le) (rate({q}_bucket{{{sel}}}[{rate_interval}])))")
            assert math.isfinite(p99) and p99 >= 0, q

        # Prometheus evaluated every alerting rule without error.
        def evaluated():
            groups = pc.api(url, "/api/v1/rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            return rules if all(not r["lastEvaluation"].startswith("0001") for r in rules) else None

        rules = wait_until(evaluated, 10, "the alerting rules to be evaluated")
        assert len(rules) == len(pc.alert_queries(pc.load_rules()))
        bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert not bad, bad
