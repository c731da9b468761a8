"""The metrics module: naming conventions, and gauges/counters that equal what the engine reported."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from sluice.metrics.families import FINISH_REASONS, PREEMPTION_MODES, REJECT_REASONS
from sluice.metrics.prometheus import SluiceMetrics, record_rejection, reject_reason, render_latest
from sluice.scheduling.output import SchedulerStats
from sluice.scheduling.request import Request
from sluice.scheduling.sampling_params import SamplingParams

MODEL = "tiny-llama"


@pytest.fixture
def reg() -> CollectorRegistry:
    return CollectorRegistry()


def value(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, {"model_name": MODEL, **labels})


def exported(reg: CollectorRegistry) -> dict:
    """Metric families as a scraper sees them after parsing the text exposition."""
    body, _ = render_latest(reg)
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def test_every_metric_follows_prometheus_naming(reg):
    SluiceMetrics(MODEL, reg)
    families = exported(reg)
    kinds = {f.type for f in families.values()}
    assert {"counter", "gauge", "histogram"} <= kinds
    for name, fam in families.items():
        if name.endswith("_created"):
            continue  # prometheus_client's creation-time companions of counters and histograms
        assert name.startswith("sluice_") and name == name.lower(), name
        assert fam.documentation.strip(), f"{name} has no help text"
        if fam.type == "histogram":
            # only durations carry the unit suffix; token counts are unitless
            assert name.endswith("_seconds") or "tokens" in name or "requests" in name, name
            assert "milli" not in name
        for sample in fam.samples:
            assert sample.labels.get("model_name") == MODEL, sample
            if fam.type == "counter" and not sample.name.endswith("_created"):
                assert sample.name.endswith("_total"), sample.name


def test_labelled_counters_exist_at_zero_before_any_event(reg):
    SluiceMetrics(MODEL, reg)
    for mode in PREEMPTION_MODES:
        assert value(reg, "sluice_preemptions_total", mode=mode) == 0
    for reason in FINISH_REASONS:
        assert value(reg, "sluice_requests_finished_total", finish_reason=reason) == 0
    for reason in REJECT_REASONS:
        assert value(reg, "sluice_requests_rejected_total", reason=reason) == 0


# A scripted engine run on 8 device blocks and 4 host blocks: each row is the state the scheduler reported after
# a step plus that step's increments. The comments say what happened.
SCRIPT = [
    # admit A (3 blocks) and B (2 blocks), prefill 40 + 20 prompt tokens, 16 of B's were a prefix hit
    SchedulerStats(num_running=2, num_waiting=1, num_free_blocks=3, num_total_blocks=8, kv_cache_usage=5 / 8,
                   num_free_host_blocks=4, num_total_host_blocks=4, num_prompt_tokens=44, num_generation_tokens=2,
                   prefix_cache_queries=60, prefix_cache_hits=16, num_batched_tokens=44, num_scheduled_requests=2,
                   step_duration_s=0.05),
    # C admitted; memory runs out: B swapped out (2 blocks to host)
    SchedulerStats(num_running=2, num_waiting=0, num_swapped=1, num_free_blocks=1, num_total_blocks=8,
                   kv_cache_usage=7 / 8, num_free_host_blocks=2, num_total_host_blocks=4, num_preemptions_swap=1,
                   num_prompt_tokens=30, num_generation_tokens=2, prefix_cache_queries=30, num_batched_tokens=31,
                   num_scheduled_requests=2, step_duration_s=0.04),
    # host pool too small for C: C preempted by recompute, back to waiting
    SchedulerStats(num_running=1, num_waiting=1, num_swapped=1, num_free_blocks=4, num_total_blocks=8,
                   kv_cache_usage=4 / 8, num_free_host_blocks=2, num_total_host_blocks=4,
                   num_preemptions_recompute=1, num_generation_tokens=1, num_batched_tokens=1,
                   num_scheduled_requests=1, step_duration_s=0.01),
    # A finishes; B swapped back in; C aborted while waiting
    SchedulerStats(num_running=1, num_waiting=0, num_swapped=0, num_free_blocks=6, num_total_blocks=8,
                   kv_cache_usage=2 / 8, num_free_host_blocks=4, num_total_host_blocks=4,
                   num_generation_tokens=1, num_batched_tokens=1, num_scheduled_requests=1, step_duration_s=0.01),
    # B finishes: everything free, the gauges must say so
    SchedulerStats(num_free_blocks=8, num_total_blocks=8, kv_cache_usage=0.0, num_free_host_blocks=4,
                   num_total_host_blocks=4),
]

GAUGES = {
    "sluice_requests_waiting": "num_waiting",
    "sluice_requests_running": "num_running",
    "sluice_requests_swapped": "num_swapped",
    "sluice_kv_cache_free_blocks": "num_free_blocks",
    "sluice_kv_cache_total_blocks": "num_total_blocks",
    "sluice_kv_cache_usage_ratio": "kv_cache_usage",
    "sluice_swap_free_blocks": "num_free_host_blocks",
    "sluice_swap_total_blocks": "num_total_host_blocks",
}
COUNTERS = {
    ("sluice_preemptions_total", ("mode", "recompute")): "num_preemptions_recompute",
    ("sluice_preemptions_total", ("mode", "swap")): "num_preemptions_swap",
    ("sluice_prompt_tokens_total", None): "num_prompt_tokens",
    ("sluice_generation_tokens_total", None): "num_generation_tokens",
    ("sluice_prefix_cache_queried_tokens_total", None): "prefix_cache_queries",
    ("sluice_prefix_cache_hit_tokens_total", None): "prefix_cache_hits",
}


def test_gauges_equal_state_after_every_step_and_counters_sum_increments(reg):
    m = SluiceMetrics(MODEL, reg)
    totals = dict.fromkeys(COUNTERS.values(), 0)
    for stats in SCRIPT:
        m.observe_step(stats)
        for name, field in GAUGES.items():
            assert value(reg, name) == getattr(stats, field), (name, stats)
        for (name, label), field in COUNTERS.items():
            totals[field] += getattr(stats, field)
            labels = dict([label]) if label else {}
            assert value(reg, name, **labels) == totals[field], name
    assert totals["num_preemptions_swap"] == 1 and totals["num_preemptions_recompute"] == 1
    assert value(reg, "sluice_kv_cache_usage_ratio") == 0.0
    assert value(reg, "sluice_kv_cache_free_blocks") == value(reg, "sluice_kv_cache_total_blocks") == 8


def test_step_histograms_count_only_steps_that_computed(reg):
    m = SluiceMetrics(MODEL, reg)
    for stats in SCRIPT:
        m.observe_step(stats)
    worked = [s for s in SCRIPT if s.num_batched_tokens]
    assert value(reg, "sluice_engine_step_tokens_count") == len(worked)
    assert value(reg, "sluice_engine_step_tokens_sum") == sum(s.num_batched_tokens for s in worked)
    assert value(reg, "sluice_engine_step_requests_sum") == sum(s.num_scheduled_requests for s in worked)
    assert value(reg, "sluice_engine_step_duration_seconds_sum") == pytest.approx(
        sum(s.step_duration_s for s in worked))
    assert value(reg, "sluice_engine_step_tokens_bucket", le="1.0") == 2  # the two decode-only steps


def test_observe_output_derives_ttft_queue_itl_and_finish(reg):
    m = SluiceMetrics(MODEL, reg)
    req = Request("r1", [1, 2, 3, 4], SamplingParams(max_tokens=3), arrival_time=100.0)
    m.track(req)
    req.first_scheduled_time = 100.5
    for i, now in enumerate((101.0, 101.25, 101.75)):
        req.append_output_token(7)
        done = i == 2
        m.observe_output("r1", 1, done, "length" if done else None, now)
    assert value(reg, "sluice_time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert value(reg, "sluice_request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert value(reg, "sluice_inter_token_latency_seconds_count") == 2
    assert value(reg, "sluice_inter_token_latency_seconds_sum") == pytest.approx(0.75)
    assert value(reg, "sluice_e2e_request_latency_seconds_sum") == pytest.approx(1.75)
    assert value(reg, "sluice_request_prompt_tokens_sum") == 4
    assert value(reg, "sluice_request_generation_tokens_sum") == 3
    assert value(reg, "sluice_requests_finished_total", finish_reason="length") == 1
    assert not m._tracked  # per-request bookkeeping released at the finish


def test_abort_before_first_token_counts_as_abort_without_ttft(reg):
    m = SluiceMetrics(MODEL, reg)
    req = Request("r2", [1, 2], SamplingParams(), arrival_time=10.0)
    m.track(req)
    m.observe_output("r2", 0, True, "abort", 12.0)
    assert value(reg, "sluice_requests_finished_total", finish_reason="abort") == 1
    assert value(reg, "sluice_e2e_request_latency_seconds_sum") == pytest.approx(2.0)
    assert value(reg, "sluice_time_to_first_token_seconds_count") == 0
    assert value(reg, "sluice_request_generation_tokens_bucket", le="1.0") == 1  # zero tokens generated
    m.observe_output("unknown", 1, True, "stop")  # never tracked: ignored, not an error
    assert value(reg, "sluice_requests_finished_total", finish_reason="stop") == 0


def test_rejections_and_unknown_labels(reg):
    m = SluiceMetrics(MODEL, reg)
    m.observe_rejected("queue_full")
    m.observe_rejected("queue_full")
    m.observe_rejected("invalid")
    assert value(reg, "sluice_requests_rejected_total", reason="queue_full") == 2
    assert value(reg, "sluice_requests_rejected_total", reason="invalid") == 1
    with pytest.raises(ValueError):
        m.observe_rejected("because")
    with pytest.raises(ValueError):
        m.observe_finished("eos", 1.0, 1, 1)


def test_reject_reason_maps_http_errors_onto_known_labels():
    assert reject_reason(429) == "queue_full"
    assert reject_reason(400) == reject_reason(422) == "invalid"
    assert reject_reason(401) == "unauthorized"
    assert reject_reason(404) == "not_found"
    assert reject_reason(413) == "too_large"
    assert reject_reason(503, "draining") == "draining"
    assert reject_reason(503, "loading") == "unavailable"
    assert reject_reason(500) is None  # an internal failure is an error, not a refusal
    for status in (400, 401, 403, 404, 405, 413, 422, 429, 503):
        assert reject_reason(status) in REJECT_REASONS


def test_record_rejection_counts_into_the_engines_series(reg):
    SluiceMetrics(MODEL, reg)
    record_rejection(MODEL, 429, registry=reg)
    record_rejection(MODEL, 503, "draining", registry=reg)
    record_rejection(MODEL, 500, "internal_error", registry=reg)  # not a refusal: not counted
    assert value(reg, "sluice_requests_rejected_total", reason="queue_full") == 1
    assert value(reg, "sluice_requests_rejected_total", reason="draining") == 1
    assert sum(value(reg, "sluice_requests_rejected_total", reason=r) for r in REJECT_REASONS) == 2


def test_constructing_twice_is_safe_and_models_are_separate_series(reg):
    a = SluiceMetrics(MODEL, reg)
    b = SluiceMetrics(MODEL, reg)
    other = SluiceMetrics("other", reg)
    a.observe_rejected("invalid")
    b.observe_rejected("invalid")
    other.observe_step(SchedulerStats(num_waiting=5))
    assert value(reg, "sluice_requests_rejected_total", reason="invalid") == 2
    assert value(reg, "sluice_requests_waiting") == 0
    assert reg.get_sample_value("sluice_requests_waiting", {"model_name": "other"}) == 5
    # the process-wide default registry tolerates repeated construction too
    SluiceMetrics("default-a")
    SluiceMetrics("default-a")
    assert REGISTRY.get_sample_value("sluice_kv_cache_total_blocks", {"model_name": "default-a"}) == 0


def test_render_latest_is_prometheus_text(reg):
    SluiceMetrics(MODEL, reg).observe_step(SCRIPT[0])
    body, content_type = render_latest(reg)
    assert content_type.startswith("text/plain") and "version=0.0.4" in content_type
    assert b'sluice_requests_waiting{model_name="tiny-llama"} 1.0' in body
