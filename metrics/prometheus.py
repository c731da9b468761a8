"""Every Sluice Prometheus metric, defined once, and the small API the engine and HTTP layer record through."""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from sluice.metrics.tenant_labels import TenantLabels
from sluice.metrics.vllm_names import CacheConfigInfo, VllmNames
from sluice.scheduling.outcomes import FinishReason

if TYPE_CHECKING:  # annotations only: metrics must stay importable from anywhere without cycles
    from sluice.scheduling.output import SchedulerStats
    from sluice.scheduling.request import Request

PREEMPTION_MODES = ("recompute", "swap")
ITL_OUTCOMES = ("kept", "missed")  # a step with decoding requests, against its time-between-tokens target
FINISH_REASONS = tuple(r.value for r in FinishReason)  # "stop", "length", "abort", "error"
# Bounded on purpose: a label value per client-supplied string would explode the series count.
REJECT_REASONS = ("queue_full", "invalid", "unauthorized", "not_found", "too_large", "draining", "unavailable")
# What the process holds resident, by what for (sluice_memory_resident_bytes), and what the KV cache set aside.
MEMORY_KINDS = ("weights", "kv_cache", "kv_swap", "other")
RESERVED_KINDS = ("kv_cache", "kv_swap")
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
LORA_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")
# generate_latest() writes the classic text format, which newer prometheus_client versions label version=1.0.0
# (a label only Prometheus 3 knows); 0.0.4 names the same format in a way every scraper understands.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric family: everything its definition, its children and its per-step update are made from."""

    field: str  # its key in the families and children (metrics/vllm_names.py reads the families by it)
    kind: type  # Gauge, Counter or Histogram
    name: str
    help: str
    label: str | tuple[str, ...] | None = None  # the one label besides model_name (an info series: several),
    values: tuple[str, ...] = ()  # and its values: children made up front export 0 from the start
    buckets: tuple[float, ...] | None = None
    # The SchedulerStats field a step sets (gauge) or adds (counter); "{}" stands for the label's value.
    stat: str | None = None


def _spec(field, kind, name, help, stat=None, **kw) -> MetricSpec:
    return MetricSpec(field, kind, name, help, stat=stat, **kw)


METRICS: tuple[MetricSpec, ...] = (
    _spec("free_blocks", Gauge, "sluice_kv_cache_free_blocks", "KV cache blocks on the device that are free (cached-but-unreferenced blocks count as free).", "num_free_blocks"),
    _spec("total_blocks", Gauge, "sluice_kv_cache_total_blocks", "KV cache blocks on the device.", "num_total_blocks"),
    _spec("usage", Gauge, "sluice_kv_cache_usage_ratio", "Fraction of device KV cache blocks in use, 0 to 1.", "kv_cache_usage"),
    _spec("free_host_blocks", Gauge, "sluice_swap_free_blocks", "Host-memory swap blocks that are free.", "num_free_host_blocks"),
    _spec("total_host_blocks", Gauge, "sluice_swap_total_blocks", "Host-memory swap blocks (0 when swap is off).", "num_total_host_blocks"),
    _spec("waiting", Gauge, "sluice_requests_waiting", "Requests waiting to be scheduled, including recompute-preempted ones.", "num_waiting"),
    _spec("running", Gauge, "sluice_requests_running", "Requests holding device KV blocks and being computed.", "num_running"),
    _spec("swapped", Gauge, "sluice_requests_swapped", "Requests whose KV cache is swapped out to host memory.", "num_swapped"),
    _spec("preemptions", Counter, "sluice_preemptions", "Running requests preempted for lack of KV cache blocks.", "num_preemptions_{}", label="mode", values=PREEMPTION_MODES),
    _spec("prompt_tokens", Counter, "sluice_prompt_tokens", "Prompt tokens computed by prefill (prefix-cache hits excluded).", "num_prompt_tokens"),
    _spec("generation_tokens", Counter, "sluice_generation_tokens", "Tokens generated.", "num_generation_tokens"),
    _spec("prefix_queries", Counter, "sluice_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    _spec("prefix_hits", Counter, "sluice_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    _spec("finished", Counter, "sluice_requests_finished", "Requests that ended, by finish reason.", label="finish_reason", values=FINISH_REASONS),
    _spec("rejected", Counter, "sluice_requests_rejected", "Requests refused before reaching the engine, by reason.", label="reason", values=REJECT_REASONS),
    _spec("ttft", Histogram, "sluice_time_to_first_token_seconds", "Time from arrival to the first generated token.", buckets=_LATENCY_BUCKETS),
    _spec("itl", Histogram, "sluice_inter_token_latency_seconds", "Time between consecutive generated tokens of one request.", buckets=_LATENCY_BUCKETS),
    _spec("e2e", Histogram, "sluice_e2e_request_latency_seconds", "Time from arrival to the end of a request.", buckets=_REQUEST_BUCKETS),
    _spec("queue_time", Histogram, "sluice_request_queue_time_seconds", "Time from arrival to first being scheduled.", buckets=_REQUEST_BUCKETS),
    _spec("prompt_len", Histogram, "sluice_request_prompt_tokens", "Prompt length of finished requests, in tokens.", buckets=_LENGTH_BUCKETS),
    _spec("generation_len", Histogram, "sluice_request_generation_tokens", "Generated length of finished requests, in tokens.", buckets=_LENGTH_BUCKETS),
    # The step histograms: observed only for steps that computed tokens (observe_step).
    _spec("step_tokens", Histogram, "sluice_engine_step_tokens", "Tokens computed in one engine step (the batch size in tokens).", "num_batched_tokens", buckets=_STEP_TOKEN_BUCKETS),
    _spec("step_requests", Histogram, "sluice_engine_step_requests", "Requests computed in one engine step (the batch size in sequences).", "num_scheduled_requests", buckets=_STEP_REQUEST_BUCKETS),
    # An info series (vLLM's lora_requests_info): one child per model, its labels the adapters now, its value the
    # time of the report; max_lora 0 where the model serves no adapters.
    _spec("lora_info", Gauge, "sluice_lora_requests_info", "LoRA adapters of the running and the waiting requests (comma-separated) and the adapter slots; the value is the time of the report.", label=LORA_LABELS),
    # Speculative decoding (--speculative-method): per position, the drafts accepted at that index of a draft.
    _spec("spec_drafts", Counter, "sluice_spec_decode_num_drafts", "Drafts verified (one per request and step that speculated).", "spec_num_drafts"),
    _spec("spec_draft_tokens", Counter, "sluice_spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", "spec_num_draft_tokens"),
    _spec("spec_accepted", Counter, "sluice_spec_decode_num_accepted_tokens", "Draft tokens accepted.", "spec_num_accepted_tokens"),
    _spec("spec_accepted_per_pos", Counter, "sluice_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft (0: the first; later positions appear once drafted).", label="position", values=("0",)),
    # --kv-events-config: events the publisher could not queue (its subscribers see a gap in the sequence).
    _spec("kv_events_dropped", Counter, "sluice_kv_events_dropped", "KV cache events dropped because the event publisher's queue was full."),
    # The latency budget (--max-itl-ms): steps with decoding requests that kept their target or missed it, the
    # target of the last step, and tokens served per tenant (--tenant-header; bounded labels, tenant_labels.py).
    _spec("itl_steps", Counter, "sluice_itl_target_steps", "Engine steps with decoding requests and prompt work waiting, by whether they kept the time-between-tokens target (--max-itl-ms).", "itl_steps_{}", label="outcome", values=ITL_OUTCOMES),
    _spec("itl_target", Gauge, "sluice_itl_target_seconds", "Time-between-tokens target of the last engine step (0: nothing decoding, or no prompt work waiting).", "itl_target_s"),
    _spec("tenant_tokens", Counter, "sluice_tenant_served_tokens", "Prompt tokens computed plus tokens generated, by tenant (--tenant-header): a series for each of the heaviest tenants (16 at most), the rest under 'other'.", label="tenant"),
    _spec("step_duration", Histogram, "sluice_engine_step_duration_seconds", "Wall time of one engine step (schedule, forward, update).", "step_duration_s", buckets=_STEP_BUCKETS),
    # Memory, read when scraped (watch_memory): the KV cache's pages become resident as its blocks are first used.
    _spec("memory_resident", Gauge, "sluice_memory_resident_bytes", "Memory held, by what for: weights (parameters and buffers, prepacked copies included), kv_cache (the KV blocks ever used; blocks never used hold no pages), kv_swap (host swap blocks ever used), other (the rest of the process's resident set: runtime, activations, allocator caches). On a GPU, weights and kv_cache are GPU memory and other leaves them out.", label="kind", values=MEMORY_KINDS),
    _spec("memory_reserved", Gauge, "sluice_memory_reserved_bytes", "Memory set aside, resident only as it is used: kv_cache (every configured KV block), kv_swap (the host swap pool).", label="kind", values=RESERVED_KINDS),
)


def _define(r: CollectorRegistry) -> SimpleNamespace:
    """Register every family of METRICS in `r`; the result holds each by its field (labelled parents)."""
    families = {}
    for spec in METRICS:
        labels = (*_L, *((spec.label,) if isinstance(spec.label, str) else spec.label or ()))
        kw = {"buckets": spec.buckets} if spec.buckets is not None else {}
        families[spec.field] = spec.kind(spec.name, spec.help, labels, registry=r, **kw)
    return SimpleNamespace(**families)


# One set of families per registry, so that several SluiceMetrics (tests, two models) can share a registry.
_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, SimpleNamespace] = weakref.WeakKeyDictionary()


def _collectors(registry: CollectorRegistry) -> SimpleNamespace:
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
        # One child per model (a dict of them per label value for a labelled family).
        self._c: dict = {
            spec.field: ({v: getattr(c, spec.field).labels(model_name, v) for v in spec.values} if spec.label
                         else getattr(c, spec.field).labels(model_name))
            for spec in METRICS
        }
        # What a step writes: (child.set or child.inc, stats field) for the gauges and counters the stats feed.
        self._per_step = [
            (child.set if spec.kind is Gauge else child.inc, spec.stat.format(v))
            for spec in METRICS if spec.stat is not None and spec.kind is not Histogram
            for v, child in (self._c[spec.field].items() if spec.label else [("", self._c[spec.field])])
        ]
        self._step_histograms = [(self._c[spec.field].observe, spec.stat) for spec in METRICS
                                 if spec.stat is not None and spec.kind is Histogram]
        self._tracked: dict[str, _Timing] = {}  # request_id -> timing state, dropped at the finish
        self._lora_labels: tuple[str, str, str] | None = None
        self._tenants = TenantLabels()
        self._set_lora_info(("", "", "0"))

    def observe_step(self, stats: SchedulerStats) -> None:
        """Set the gauges to the state after a step and add the step's counter increments."""
        for write, stat in self._per_step:
            write(getattr(stats, stat))
        if stats.max_loras:
            self._set_lora_info((",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters),
                                 str(stats.max_loras)))
        if stats.spec_accepted_per_pos:
            self._observe_positions(stats.spec_accepted_per_pos)
        for tenant, tokens in stats.tenant_tokens.items():
            self._observe_tenant(tenant, tokens)
        if stats.num_batched_tokens:  # a step that only swapped or idled says nothing about batch size
            for observe, stat in self._step_histograms:
                observe(getattr(stats, stat))

    def _observe_positions(self, accepted: list[int]) -> None:
        """Add the step's accepted drafts per position (a position's child appears once it is first drafted)."""
        children = self._c["spec_accepted_per_pos"]
        for pos, n in enumerate(accepted):
            child = children.get(str(pos))
            if child is None:
                family = _collectors(self.registry).spec_accepted_per_pos
                child = children[str(pos)] = family.labels(self.model_name, str(pos))
            child.inc(n)

    def _observe_tenant(self, tenant: str, tokens: int) -> None:
        """Add a tenant's served tokens under its bounded label (its own among the top tenants, else 'other')."""
        label = self._tenants.label(tenant, tokens)
        children = self._c["tenant_tokens"]
        child = children.get(label)
        if child is None:
            child = children[label] = _collectors(self.registry).tenant_tokens.labels(self.model_name, label)
        child.inc(tokens)

    def _set_lora_info(self, labels: tuple[str, str, str]) -> None:
        """Point the model's lora_info child at the adapters now (the previous label set is removed)."""
        family = _collectors(self.registry).lora_info
        if labels != self._lora_labels:
            if self._lora_labels is not None:
                family.remove(self.model_name, *self._lora_labels)
            self._lora_labels = labels
        family.labels(self.model_name, *labels).set(time.time())

    def watch_memory(self, weight_bytes: int, kv, kv_manager) -> None:
        """Read the memory gauges when scraped: `weight_bytes`, the KV tensors' (kvcache KVTensors) bytes for the
        blocks `kv_manager` (a KVCacheManager) ever handed out, and the process's resident set for the rest."""
        # Weak references: the registry outlives engines (tests build many), and must not keep their caches alive.
        kv_ref, pools = weakref.ref(kv), weakref.ref(kv_manager)

        def kv_bytes(host: bool) -> int:
            tensors, manager = kv_ref(), pools()
            if tensors is None or manager is None:
                return 0
            if host:
                return tensors.host_resident_bytes(manager.swap_space.num_touched)
            return tensors.resident_bytes(manager.pool.num_touched)

        resident = {"weights": lambda: weight_bytes, "kv_cache": lambda: kv_bytes(False),
                    "kv_swap": lambda: kv_bytes(True)}
        in_host_memory = ["kv_swap", *(("weights", "kv_cache") if kv.device.type == "cpu" else ())]
        resident["other"] = lambda: max(0, process_resident_bytes() - sum(resident[k]() for k in in_host_memory))
        for kind, read in resident.items():
            self._c["memory_resident"][kind].set_function(read)
        self._c["memory_reserved"]["kv_cache"].set(kv.num_bytes)
        self._c["memory_reserved"]["kv_swap"].set(kv.host_num_bytes)

    def observe_kv_events_dropped(self, n: int) -> None:
        """Count KV cache events the publisher dropped (--kv-events-config)."""
        self._c["kv_events_dropped"].inc(n)

    def observe_first_token(self, ttft_s: float, queue_s: float) -> None:
        """Record a request's time to first token and the time it spent queued before its first step."""
        self._c["ttft"].observe(ttft_s)
        self._c["queue_time"].observe(queue_s)

    def observe_token_latency(self, itl_s: float) -> None:
        """Record the gap between two consecutive tokens of one request."""
        self._c["itl"].observe(itl_s)

    def observe_finished(self, finish_reason: str, e2e_s: float, prompt_tokens: int, generation_tokens: int) -> None:
        """Record a request that ended (stop, length, abort or error)."""
        counter = self._c["finished"].get(finish_reason)
        if counter is None:
            raise ValueError(f"unknown finish_reason {finish_reason!r}; expected one of {FINISH_REASONS}")
        counter.inc()
        self._c["e2e"].observe(e2e_s)
        self._c["prompt_len"].observe(prompt_tokens)
        self._c["generation_len"].observe(generation_tokens)

    def observe_rejected(self, reason: str) -> None:
        """Record a request refused before admission (see REJECT_REASONS)."""
        counter = self._c["rejected"].get(reason)
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


def process_resident_bytes() -> int:
    """This process's resident set now (/proc/self/statm), 0 where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


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
