"""--vllm-metric-names: vLLM's metric names carry exactly Sluice's own values, and appear only when asked for."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from sluice.metrics.prometheus import SluiceMetrics, render_latest
from sluice.metrics.vllm_names import CACHE_INFO, LORA_INFO, RENAMES, CacheConfigInfo
from sluice.scheduling.output import SchedulerStats
from sluice.scheduling.request import Request
from sluice.scheduling.sampling_params import SamplingParams
from tests.support.server import MODEL

# Sluice sample -> the vLLM sample that must carry the same value (histograms: every bucket, sum and count).
SAME = {
    "sluice_requests_waiting": "vllm:num_requests_waiting",
    "sluice_requests_running": "vllm:num_requests_running",
    "sluice_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "sluice_prompt_tokens_total": "vllm:prompt_tokens_total",
    "sluice_generation_tokens_total": "vllm:generation_tokens_total",
    "sluice_prefix_cache_hit_tokens_total": "vllm:prefix_cache_hits_total",
    "sluice_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "sluice_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "sluice_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
}


def samples(body: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, as a scraper parses the exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def assert_same_values(found: dict[tuple[str, tuple], float]) -> None:
    """Every sample of each Sluice series in SAME has its vLLM twin, with the same labels and value."""
    for ours, theirs in SAME.items():
        mine = {(n.replace(ours, theirs, 1), labels): v for (n, labels), v in found.items()
                if n == ours or (n.startswith(ours + "_") and not n.endswith("_created"))}
        assert mine, f"{ours} missing"
        for key, v in mine.items():
            assert found.get(key) == v, (key, v, found.get(key))


def info(found: dict[tuple[str, tuple], float], name: str) -> dict[str, str]:
    (labels,) = [dict(labels) for (n, labels) in found if n == name]
    return labels


def test_without_the_flag_no_vllm_names():
    reg = CollectorRegistry()
    SluiceMetrics("m", reg).observe_step(SchedulerStats(num_waiting=2))
    body = render_latest(reg)[0].decode()
    assert "vllm:" not in body and "sluice_requests_waiting" in body


def test_vllm_names_copy_sluice_values_after_steps_and_requests():
    reg = CollectorRegistry()
    m = SluiceMetrics("m", reg, vllm_names=CacheConfigInfo(block_size=16, enable_prefix_caching=True))
    m.observe_step(SchedulerStats(num_waiting=3, num_running=2, num_total_blocks=40, num_free_blocks=30,
                                  kv_cache_usage=0.25, num_total_host_blocks=8, num_prompt_tokens=48,
                                  num_generation_tokens=2, prefix_cache_queries=64, prefix_cache_hits=16))
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=10.0)
    m.track(req)
    req.first_scheduled_time = 10.2
    for i, now in enumerate((10.5, 10.75)):
        req.append_output_token(5)
        m.observe_output("r", 1, i == 1, "length" if i == 1 else None, now)
    found = samples(render_latest(reg)[0].decode())
    assert_same_values(found)
    assert found[("vllm:kv_cache_usage_perc", (("model_name", "m"),))] == 0.25  # a fraction, as vLLM's
    assert found[("vllm:time_to_first_token_seconds_count", (("model_name", "m"),))] == 1
    assert info(found, CACHE_INFO) == {"model_name": "m", "block_size": "16", "num_gpu_blocks": "40",
                                       "num_cpu_blocks": "8", "enable_prefix_caching": "True"}
    assert info(found, LORA_INFO) == {"model_name": "m", "running_lora_adapters": "", "waiting_lora_adapters": "",
                                      "max_lora": "0"}
    for names in RENAMES.values():  # every rename is exported, the older spellings too
        for name in names:
            assert any(n == name or n.startswith(name + "_") for n, _ in found), name


def test_a_second_model_in_the_registry_keeps_its_own_series():
    reg = CollectorRegistry()
    a = SluiceMetrics("a", reg, vllm_names=CacheConfigInfo(16, True))
    b = SluiceMetrics("b", reg, vllm_names=CacheConfigInfo(32, False))
    a.observe_step(SchedulerStats(num_waiting=1))
    b.observe_step(SchedulerStats(num_waiting=7))
    found = samples(render_latest(reg)[0].decode())
    assert found[("vllm:num_requests_waiting", (("model_name", "b"),))] == 7
    assert found[("vllm:num_requests_waiting", (("model_name", "a"),))] == 1
    sizes = {dict(labels)["model_name"]: dict(labels)["block_size"] for (n, labels) in found if n == CACHE_INFO}
    assert sizes == {"a": "16", "b": "32"}


@pytest.fixture(scope="module")
def vllm_server(tiny_server):
    """The shared tiny server, which exports the vLLM names too (conftest.TINY_FLAGS)."""
    return tiny_server


def scrape(srv) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=5) as r:
        return samples(r.read().decode())


def test_a_real_server_reports_the_same_values_under_both_names(vllm_server):
    labels = (("model_name", MODEL),)
    count = ("vllm:e2e_request_latency_seconds_count", labels)
    before = scrape(vllm_server).get(count, 0.0)  # a shared server: other modules' requests count too
    for prompt in ("hello there", "hello there, again", "something else"):
        body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode()
        req = urllib.request.Request(vllm_server.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
    found = scrape(vllm_server)
    assert_same_values(found)  # one scrape: both names read the same families at the same instant
    assert found[("vllm:generation_tokens_total", labels)] >= 3
    assert found[count] - before == 3
    assert info(found, CACHE_INFO)["block_size"] == "16" and info(found, CACHE_INFO)["num_gpu_blocks"] == "64"
