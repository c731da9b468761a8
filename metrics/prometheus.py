"""Every Sluice Prometheus metric, defined once, and the small API the engine and HTTP layer record through."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
)

from sluice.cpu import helpers_private_bytes, resident_bytes
from sluice.metrics.families import FINISH_REASONS, METRICS, MODEL_LABEL, REJECT_REASONS
from sluice.metrics.tenant_labels import TenantLabels
from sluice.metrics.vllm_names import CacheConfigInfo, VllmNames

if TYPE_CHECKING:  # annotations only: metrics must stay importable from anywhere without cycles
    from sluice.scheduling.output import SchedulerStats
    from sluice.scheduling.request import Request

_REJECT_BY_STATUS = {400: "invalid", 401: "unauthorized", 403: "unauthorized", 404: "not_found", 405: "invalid",
                     413: "too_large", 422: "invalid", 429: "queue_full"}

# generate_latest() writes the classic text format, which newer prometheus_client versions label version=1.0.0
# (a label only Prometheus 3 knows); 0.0.4 names the same format in a way every scraper understands.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _define(r: CollectorRegistry) -> SimpleNamespace:
    """Register every family of METRICS in `r`; the result holds each by its field (labelled parents)."""
    families = {}
    for spec in METRICS:
        labels = (*MODEL_LABEL, *((spec.label,) if isinstance(spec.label, str) else spec.label or ()))
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
        blocks `kv_manager` (a KVCacheManager) ever handed out, the process's resident set for the rest, and its
        child processes' private memory."""
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
        resident["other"] = lambda: max(0, resident_bytes() - sum(resident[k]() for k in in_host_memory))
        resident["helpers"] = helpers_private_bytes
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


def reject_reason(status: int, code: str | None = None) -> str | None:
    """The `reason` label for an HTTP error refusing a request; None when the status is no refusal (500s)."""
    if status == 503:
        return "draining" if code == "draining" else "unavailable"  # loading, or the engine died
    return _REJECT_BY_STATUS.get(status)


def record_rejection(
    model_name: str, status: int, code: str | None = None, registry: CollectorRegistry = REGISTRY
) -> None:
    """Count an HTTP error response as a refused request of `model_name` (no-op for statuses that are no refusal).

    For the HTTP layer, which knows the model's name but need not hold the engine's SluiceMetrics.
    """
    reason = reject_reason(status, code)
    if reason is not None:
        _collectors(registry).rejected.labels(model_name, reason).inc()


def render_latest(registry: CollectorRegistry = REGISTRY) -> tuple[bytes, str]:
    """The /metrics response: body in Prometheus text format and its Content-Type header value."""
    return generate_latest(registry), CONTENT_TYPE
