"""Every Sluice Prometheus metric, defined once, and the small API the engine and HTTP layer record through."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from sluice.metrics.vllm_names import CacheConfigInfo, VllmNames

if TYPE_CHECKING:  # annotations only: metrics must stay importable from anywhere without cycles
    from sluice.scheduling.output import SchedulerStats
    from sluice.scheduling.request import Request

PREEMPTION_MODES = ("recompute", "swap")
FINISH_REASONS = ("stop", "length", "abort", "error")
# Bounded on purpose: a label value per client-supplied string would explode the series count.
REJECT_REASONS = ("queue_full", "invalid", "unauthorized", "not_found", "too_large", "draining", "unavailable")
_REJECT_BY_STATUS = {400: "invalid", 401: "unauthorized", 403: "unauthorized", 404: "not_found", 405: "invalid",
                     413: "too_large", 422: "invalid", 429: "queue_full"}

# Buckets span a GPU decode step (~1 ms) to a loaded CPU box (tens of seconds).
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
_REQUEST_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0,
)
_STEP_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0,
)
_LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)
_STEP_TOKEN_BUCKETS = tuple(2**i for i in range(15))  # 1 .. 16384
_STEP_REQUEST_BUCKETS = tuple(2**i for i in range(11))  # 1 .. 1024

_L = ("model_name",)
# generate_latest() writes the classic text format, which newer prometheus_client versions label version=1.0.0
# (a label only Prometheus 3 knows); 0.0.4 names the same format in a way every scraper understands.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class _Collectors:
    """The metric families of one registry (labelled parents; children are per model_name)."""

    free_blocks: Gauge
    total_blocks: Gauge
    usage: Gauge
    free_host_blocks: Gauge
    total_host_blocks: Gauge
    waiting: Gauge
    running: Gauge
    swapped: Gauge
    preemptions: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    prefix_queries: Counter
    prefix_hits: Counter
    finished: Counter
    rejected: Counter
    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue_time: Histogram
    prompt_len: Histogram
    generation_len: Histogram
    step_tokens: Histogram
    step_requests: Histogram
    step_duration: Histogram


def _define(r: CollectorRegistry) -> _Collectors:
    """Register every Sluice metric family in `r`."""
    return _Collectors(
        free_blocks=Gauge("sluice_kv_cache_free_blocks", "KV cache blocks on the device that are free (cached-but-unreferenced blocks count as free).", _L, registry=r),
        total_blocks=Gauge("sluice_kv_cache_total_blocks", "KV cache blocks on the device.", _L, registry=r),
        usage=Gauge("sluice_kv_cache_usage_ratio", "Fraction of device KV cache blocks in use, 0 to 1.", _L, registry=r),
        free_host_blocks=Gauge("sluice_swap_free_blocks", "Host-memory swap blocks that are free.", _L, registry=r),
        total_host_blocks=Gauge("sluice_swap_total_blocks", "Host-memory swap blocks (0 when swap is off).", _L, registry=r),
        waiting=Gauge("sluice_requests_waiting", "Requests waiting to be scheduled, including recompute-preempted ones.", _L, registry=r),
        running=Gauge("sluice_requests_running", "Requests holding device KV blocks and being computed.", _L, registry=r),
        swapped=Gauge("sluice_requests_swapped", "Requests whose KV cache is swapped out to host memory.", _L, registry=r),
        preemptions=Counter("sluice_preemptions", "Running requests preempted for lack of KV cache blocks.", (*_L, "mode"), registry=r),
        prompt_tokens=Counter("sluice_prompt_tokens", "Prompt tokens computed by prefill (prefix-cache hits excluded).", _L, registry=r),
        generation_tokens=Counter("sluice_generation_tokens", "Tokens generated.", _L, registry=r),
        prefix_queries=Counter("sluice_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.", _L, registry=r),
        prefix_hits=Counter("sluice_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", _L, registry=r),
        finished=Counter("sluice_requests_finished", "Requests that ended, by finish reason.", (*_L, "finish_reason"), registry=r),
        rejected=Counter("sluice_requests_rejected", "Requests refused before reaching the engine, by reason.", (*_L, "reason"), registry=r),
        ttft=Histogram("sluice_time_to_first_token_seconds", "Time from arrival to the first generated token.", _L, registry=r, buckets=_LATENCY_BUCKETS),
        itl=Histogram("sluice_inter_token_latency_seconds", "Time between consecutive generated tokens of one request.", _L, registry=r, buckets=_LATENCY_BUCKETS),
        e2e=Histogram("sluice_e2e_request_latency_seconds", "Time from arrival to the end of a request.", _L, registry=r, buckets=_REQUEST_BUCKETS),
        queue_time=Histogram("sluice_request_queue_time_seconds", "Time from arrival to first being scheduled.", _L, registry=r, buckets=_REQUEST_BUCKETS),
        prompt_len=Histogram("sluice_request_prompt_tokens", "Prompt length of finished requests, in tokens.", _L, registry=r, buckets=_LENGTH_BUCKETS),
        generation_len=Histogram("sluice_request_generation_tokens", "Generated length of finished requests, in tokens.", _L, registry=r, buckets=_LENGTH_BUCKETS),
        step_tokens=Histogram("sluice_engine_step_tokens", "Tokens computed in one engine step (the batch size in tokens).", _L, registry=r, buckets=_STEP_TOKEN_BUCKETS),
        step_requests=Histogram("sluice_engine_step_requests", "Requests computed in one engine step (the batch size in sequences).", _L, registry=r, buckets=_STEP_REQUEST_BUCKETS),
        step_duration=Histogram("sluice_engine_step_duration_seconds", "Wall time of one engine step (schedule, forward, update).", _L, registry=r, buckets=_STEP_BUCKETS),
    )


# One set of families per registry, so that several SluiceMetrics (tests, two models) can share a registry.
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, _Collectors] = weakref.WeakKeyDictionary()


def _collectors(registry: CollectorRegistry) -> _Collectors:
    """The families registered in `registry`, defining them on first use."""
    found = _by_registry.get(registry)
    if found is None:
        found = _by_registry[registry] = _define(registry)
    return found


_vllm_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, VllmNames] = weakref.WeakKeyDictionary()


def _vllm_names(registry: CollectorRegistry) -> VllmNames:
    """The vLLM-names collector of `registry`, registering it on first use (only when a model asks for it)."""
    found = _vllm_by_registry.get(registry)
    if found is None:
        found = _vllm_by_registry[registry] = VllmNames(_collectors(registry))
        registry.register(found)
    return found


class SluiceMetrics:
    """Records engine and request events for one served model into a Prometheus registry.

    `vllm_names` (the cache's configuration) also exports the model's series under vLLM's metric names, read
    from the same families at scrape time (metrics/vllm_names.py).
    """

    def __init__(
        self, model_name: str, registry: CollectorRegistry = REGISTRY, vllm_names: CacheConfigInfo | None = None
    ) -> None:
        c = _collectors(registry)
        if vllm_names is not None:
            _vllm_names(registry).add_model(model_name, vllm_names)
        self.registry = registry
        self.model_name = model_name
        m = model_name
        self._free_blocks = c.free_blocks.labels(m)
        self._total_blocks = c.total_blocks.labels(m)
        self._usage = c.usage.labels(m)
        self._free_host_blocks = c.free_host_blocks.labels(m)
        self._total_host_blocks = c.total_host_blocks.labels(m)
        self._waiting = c.waiting.labels(m)
        self._running = c.running.labels(m)
        self._swapped = c.swapped.labels(m)
        # Children made up front export 0 from the start, so rate() sees the first increment.
        self._preemptions = {mode: c.preemptions.labels(m, mode) for mode in PREEMPTION_MODES}
        self._prompt_tokens = c.prompt_tokens.labels(m)
        self._generation_tokens = c.generation_tokens.labels(m)
        self._prefix_queries = c.prefix_queries.labels(m)
        self._prefix_hits = c.prefix_hits.labels(m)
        self._finished = {reason: c.finished.labels(m, reason) for reason in FINISH_REASONS}
        self._rejected = {reason: c.rejected.labels(m, reason) for reason in REJECT_REASONS}
        self._ttft = c.ttft.labels(m)
        self._itl = c.itl.labels(m)
        self._e2e = c.e2e.labels(m)
        self._queue_time = c.queue_time.labels(m)
        self._prompt_len = c.prompt_len.labels(m)
        self._generation_len = c.generation_len.labels(m)
        self._step_tokens = c.step_tokens.labels(m)
        self._step_requests = c.step_requests.labels(m)
        self._step_duration = c.step_duration.labels(m)
        self._tracked: dict[str, _Timing] = {}  # request_id -> timing state, dropped at the finish

    def observe_step(self, stats: SchedulerStats) -> None:
        """Set the gauges to the state after a step and add the step's counter increments."""
        self._free_blocks.set(stats.num_free_blocks)
        self._total_blocks.set(stats.num_total_blocks)
        self._usage.set(stats.kv_cache_usage)
        self._free_host_blocks.set(stats.num_free_host_blocks)
        self._total_host_blocks.set(stats.num_total_host_blocks)
        self._waiting.set(stats.num_waiting)
        self._running.set(stats.num_running)
        self._swapped.set(stats.num_swapped)
        self._preemptions["recompute"].inc(stats.num_preemptions_recompute)
        self._preemptions["swap"].inc(stats.num_preemptions_swap)
        self._prompt_tokens.inc(stats.num_prompt_tokens)
        self._generation_tokens.inc(stats.num_generation_tokens)
        self._prefix_queries.inc(stats.prefix_cache_queries)
        self._prefix_hits.inc(stats.prefix_cache_hits)
        if stats.num_batched_tokens:  # a step that only swapped or idled says nothing about batch size
            self._step_tokens.observe(stats.num_batched_tokens)
            self._step_requests.observe(stats.num_scheduled_requests)
            self._step_duration.observe(stats.step_duration_s)

    def observe_first_token(self, ttft_s: float, queue_s: float) -> None:
        """Record a request's time to first token and the time it spent queued before its first step."""
        self._ttft.observe(ttft_s)
        self._queue_time.observe(queue_s)

    def observe_token_latency(self, itl_s: float) -> None:
        """Record the gap between two consecutive tokens of one request."""
        self._itl.observe(itl_s)

    def observe_finished(self, finish_reason: str, e2e_s: float, prompt_tokens: int, generation_tokens: int) -> None:
        """Record a request that ended (stop, length, abort or error)."""
        counter = self._finished.get(finish_reason)
        if counter is None:
            raise ValueError(f"unknown finish_reason {finish_reason!r}; expected one of {FINISH_REASONS}")
        counter.inc()
        self._e2e.observe(e2e_s)
        self._prompt_len.observe(prompt_tokens)
        self._generation_len.observe(generation_tokens)

    def observe_rejected(self, reason: str) -> None:
        """Record a request refused before admission (see REJECT_REASONS)."""
        counter = self._rejected.get(reason)
        if counter is None:
            raise ValueError(f"unknown reject reason {reason!r}; expected one of {REJECT_REASONS}")
        counter.inc()

    def track(self, request: Request) -> None:
        """Start timing a request the engine just accepted (its arrival_time is the reference point)."""
        self._tracked[request.request_id] = _Timing(request)

    def observe_output(
        self, request_id: str, num_new_tokens: int, finished: bool, finish_reason: str | None, now: float | None = None
    ) -> None:
        """Derive TTFT, queue time, ITL and the finish of a tracked request from one step's output."""
        timing = self._tracked.get(request_id)
        if timing is None:
            return  # not tracked (an engine without metrics wiring at add time): nothing to time against
        now = time.monotonic() if now is None else now  # Request.arrival_time is monotonic too
        req = timing.request
        if num_new_tokens:
            if timing.last_token_time is None:
                # Without the scheduler's stamp, the first token's time is an upper bound of the queue time.
                scheduled = req.first_scheduled_time if req.first_scheduled_time is not None else now
                self.observe_first_token(now - req.arrival_time, scheduled - req.arrival_time)
            else:  # the engine yields at most one token per request and step
                self.observe_token_latency(now - timing.last_token_time)
            timing.last_token_time = now
        if finished:
            del self._tracked[request_id]
            self.observe_finished(
                finish_reason or "error", now - req.arrival_time, req.num_prompt_tokens, req.num_output_tokens
            )


@dataclass(slots=True)
class _Timing:
    """Per-request bookkeeping between outputs."""

    request: Request
    last_token_time: float | None = None


def reject_reason(status: int, code: str | None = None) -> str | None:
    """The `reason` label for an HTTP error refusing a request; None when the status is no refusal (500s)."""
    if status == 503:
        return "draining" if code == "draining" else "unavailable"  # loading, or the engine died
    return _REJECT_BY_STATUS.get(status)


def record_rejection(model_name: str, status: int, code: str | None = None, registry: CollectorRegistry = REGISTRY) -> None:
    """Count an HTTP error response as a refused request of `model_name` (no-op for statuses that are no refusal).

    For the HTTP layer, which knows the model's name but need not hold the engine's SluiceMetrics.
    """
    reason = reject_reason(status, code)
    if reason is not None:
        _collectors(registry).rejected.labels(model_name, reason).inc()


def render_latest(registry: CollectorRegistry = REGISTRY) -> tuple[bytes, str]:
    """The /metrics response: body in Prometheus text format and its Content-Type header value."""
    return generate_latest(registry), CONTENT_TYPE
