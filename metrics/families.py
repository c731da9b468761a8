"""Every Sluice Prometheus metric family, defined once: the table the engine records through (prometheus.py), that
vLLM's names mirror (vllm_names.py), and that the generated docs and dashboards read."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from sluice.scheduling.outcomes import FinishReason

PREEMPTION_MODES = ("recompute", "swap")
ITL_OUTCOMES = ("kept", "missed")  # a step with decoding requests, against its time-between-tokens target
FINISH_REASONS = tuple(r.value for r in FinishReason)  # "stop", "length", "abort", "error"
# Bounded on purpose: a label value per client-supplied string would explode the series count.
REJECT_REASONS = ("queue_full", "invalid", "unauthorized", "not_found", "too_large", "draining", "unavailable")
# What the process holds resident, by what for (sluice_memory_resident_bytes), and what the KV cache set aside.
MEMORY_KINDS = ("weights", "kv_cache", "kv_swap", "other", "helpers")
RESERVED_KINDS = ("kv_cache", "kv_swap")

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

MODEL_LABEL = ("model_name",)  # every family carries it
LORA_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")


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
    _spec(
        "free_blocks", Gauge, "sluice_kv_cache_free_blocks",
        "KV cache blocks on the device that are free (cached-but-unreferenced blocks count as free).",
        "num_free_blocks",
    ),
    _spec(
        "total_blocks", Gauge, "sluice_kv_cache_total_blocks",
        "KV cache blocks on the device.",
        "num_total_blocks",
    ),
    _spec(
        "usage", Gauge, "sluice_kv_cache_usage_ratio",
        "Fraction of device KV cache blocks in use, 0 to 1.",
        "kv_cache_usage",
    ),
    _spec(
        "free_host_blocks", Gauge, "sluice_swap_free_blocks",
        "Host-memory swap blocks that are free.",
        "num_free_host_blocks",
    ),
    _spec(
        "total_host_blocks", Gauge, "sluice_swap_total_blocks",
        "Host-memory swap blocks (0 when swap is off).",
        "num_total_host_blocks",
    ),
    _spec(
        "waiting", Gauge, "sluice_requests_waiting",
        "Requests waiting to be scheduled, including recompute-preempted ones.",
        "num_waiting",
    ),
    _spec(
        "running", Gauge, "sluice_requests_running",
        "Requests holding device KV blocks and being computed.",
        "num_running",
    ),
    _spec(
        "swapped", Gauge, "sluice_requests_swapped",
        "Requests whose KV cache is swapped out to host memory.",
        "num_swapped",
    ),
    _spec(
        "preemptions", Counter, "sluice_preemptions",
        "Running requests preempted for lack of KV cache blocks.",
        "num_preemptions_{}", label="mode", values=PREEMPTION_MODES,
    ),
    _spec(
        "prompt_tokens", Counter, "sluice_prompt_tokens",
        "Prompt tokens computed by prefill (prefix-cache hits excluded).",
        "num_prompt_tokens",
    ),
    _spec(
        "generation_tokens", Counter, "sluice_generation_tokens",
        "Tokens generated.",
        "num_generation_tokens",
    ),
    _spec(
        "prefix_queries", Counter, "sluice_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queries",
    ),
    _spec(
        "prefix_hits", Counter, "sluice_prefix_cache_hit_tokens",
        "Prompt tokens found in the prefix cache.",
        "prefix_cache_hits",
    ),
    _spec(
        "finished", Counter, "sluice_requests_finished",
        "Requests that ended, by finish reason.",
        label="finish_reason", values=FINISH_REASONS,
    ),
    _spec(
        "rejected", Counter, "sluice_requests_rejected",
        "Requests refused before reaching the engine, by reason.",
        label="reason", values=REJECT_REASONS,
    ),
    _spec(
        "ttft", Histogram, "sluice_time_to_first_token_seconds",
        "Time from arrival to the first generated token.",
        buckets=_LATENCY_BUCKETS,
    ),
    _spec(
        "itl", Histogram, "sluice_inter_token_latency_seconds",
        "Time between consecutive generated tokens of one request.",
        buckets=_LATENCY_BUCKETS,
    ),
    _spec(
        "e2e", Histogram, "sluice_e2e_request_latency_seconds",
        "Time from arrival to the end of a request.",
        buckets=_REQUEST_BUCKETS,
    ),
    _spec(
        "queue_time", Histogram, "sluice_request_queue_time_seconds",
        "Time from arrival to first being scheduled.",
        buckets=_REQUEST_BUCKETS,
    ),
    _spec(
        "prompt_len", Histogram, "sluice_request_prompt_tokens",
        "Prompt length of finished requests, in tokens.",
        buckets=_LENGTH_BUCKETS,
    ),
    _spec(
        "generation_len", Histogram, "sluice_request_generation_tokens",
        "Generated length of finished requests, in tokens.",
        buckets=_LENGTH_BUCKETS,
    ),
    # The step histograms: observed only for steps that computed tokens (observe_step).
    _spec(
        "step_tokens", Histogram, "sluice_engine_step_tokens",
        "Tokens computed in one engine step (the batch size in tokens).",
        "num_batched_tokens", buckets=_STEP_TOKEN_BUCKETS,
    ),
    _spec(
        "step_requests", Histogram, "sluice_engine_step_requests",
        "Requests computed in one engine step (the batch size in sequences).",
        "num_scheduled_requests", buckets=_STEP_REQUEST_BUCKETS,
    ),
    # An info series (vLLM's lora_requests_info): one child per model, its labels the adapters now, its value the
    # time of the report; max_lora 0 where the model serves no adapters.
    _spec(
        "lora_info", Gauge, "sluice_lora_requests_info",
        "LoRA adapters of the running and the waiting requests (comma-separated) and the adapter slots; the value is "
        "the time of the report.",
        label=LORA_LABELS,
    ),
    # Speculative decoding (--speculative-method): per position, the drafts accepted at that index of a draft.
    _spec(
        "spec_drafts", Counter, "sluice_spec_decode_num_drafts",
        "Drafts verified (one per request and step that speculated).",
        "spec_num_drafts",
    ),
    _spec(
        "spec_draft_tokens", Counter, "sluice_spec_decode_num_draft_tokens",
        "Draft tokens proposed and verified.",
        "spec_num_draft_tokens",
    ),
    _spec(
        "spec_accepted", Counter, "sluice_spec_decode_num_accepted_tokens",
        "Draft tokens accepted.",
        "spec_num_accepted_tokens",
    ),
    _spec(
        "spec_accepted_per_pos", Counter, "sluice_spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in the draft (0: the first; later positions appear once drafted).",
        label="position", values=("0",),
    ),
    # --kv-events-config: events the publisher could not queue (its subscribers see a gap in the sequence).
    _spec(
        "kv_events_dropped", Counter, "sluice_kv_events_dropped",
        "KV cache events dropped because the event publisher's queue was full.",
    ),
    # The latency budget (--max-itl-ms): steps with decoding requests that kept their target or missed it, the
    # target of the last step, and tokens served per tenant (--tenant-header; bounded labels, tenant_labels.py).
    _spec(
        "itl_steps", Counter, "sluice_itl_target_steps",
        "Engine steps with decoding requests and prompt work waiting, by whether they kept the time-between-tokens "
        "target (--max-itl-ms).",
        "itl_steps_{}", label="outcome", values=ITL_OUTCOMES,
    ),
    _spec(
        "itl_target", Gauge, "sluice_itl_target_seconds",
        "Time-between-tokens target of the last engine step (0: nothing decoding, or no prompt work waiting).",
        "itl_target_s",
    ),
    _spec(
        "tenant_tokens", Counter, "sluice_tenant_served_tokens",
        "Prompt tokens computed plus tokens generated, by tenant (--tenant-header): a series for each of the heaviest "
        "tenants (16 at most), the rest under 'other'.",
        label="tenant",
    ),
    _spec(
        "step_duration", Histogram, "sluice_engine_step_duration_seconds",
        "Wall time of one engine step (schedule, forward, update).",
        "step_duration_s", buckets=_STEP_BUCKETS,
    ),
    # Memory, read when scraped (watch_memory): the KV cache's pages become resident as its blocks are first used.
    _spec(
        "memory_resident", Gauge, "sluice_memory_resident_bytes",
        "Memory held, by what for: weights (parameters and buffers, prepacked copies included), kv_cache (the KV "
        "blocks ever used; blocks never used hold no pages), kv_swap (host swap blocks ever used), other (the rest of "
        "the process's resident set: runtime, activations, allocator caches), helpers (what the server's child "
        "processes, the grammar compile zygote and its workers, hold and share with no other process). On a GPU, "
        "weights and kv_cache are GPU memory and other leaves them out.",
        label="kind", values=MEMORY_KINDS,
    ),
    _spec(
        "memory_reserved", Gauge, "sluice_memory_reserved_bytes",
        "Memory set aside, resident only as it is used: kv_cache (every configured KV block), "
        "kv_swap (the host swap pool).",
        label="kind", values=RESERVED_KINDS,
    ),
)
