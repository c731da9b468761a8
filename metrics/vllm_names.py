"""The opt-in vLLM metric names (`--vllm-metric-names`): Sluice's own series re-exported at scrape time under the
names the Gateway API Inference Extension's endpoint picker and public vLLM dashboards read.

Nothing here observes anything: each vLLM series is a renamed copy of a Sluice family's samples, read from that
family when Prometheus scrapes, so the two names cannot disagree. The LoRA info series is
a renamed family too; the cache-config one is built from the families plus the cache's static configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from collections.abc import Iterator

# Sluice family (a MetricSpec field, metrics/families.py) -> the vLLM names it is also exported as. Several vLLM
# names for one family where vLLM renamed a series and both spellings are still read (gpu_cache_usage_perc by older
# pickers and dashboards, time_per_output_token_seconds by dashboards made before vLLM's inter_token_latency_seconds).
RENAMES: dict[str, tuple[str, ...]] = {
    "waiting": ("vllm:num_requests_waiting",),
    "running": ("vllm:num_requests_running",),
    "swapped": ("vllm:num_requests_swapped",),
    "usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # a fraction 0..1, despite "perc"
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "prefix_queries": ("vllm:prefix_cache_queries",),
    "prefix_hits": ("vllm:prefix_cache_hits",),
    "ttft": ("vllm:time_to_first_token_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2e": ("vllm:e2e_request_latency_seconds",),
    "queue_time": ("vllm:request_queue_time_seconds",),
    "prompt_len": ("vllm:request_prompt_tokens",),
    "generation_len": ("vllm:request_generation_tokens",),
    "lora_info": ("vllm:lora_requests_info",),
    "spec_drafts": ("vllm:spec_decode_num_drafts",),
    "spec_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "spec_accepted": ("vllm:spec_decode_num_accepted_tokens",),
    "spec_accepted_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
}
LORA_INFO = "vllm:lora_requests_info"
CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True, slots=True)
class CacheConfigInfo:
    """The static part of `vllm:cache_config_info` for one served model."""

    block_size: int
    enable_prefix_caching: bool


class VllmNames(Collector):
    """Yields the vLLM-named copies of the Sluice families of one registry (registered once per registry)."""

    def __init__(self, families: object) -> None:
        self._families = families  # the families of families.METRICS, read by field name (no import back: no cycle)
        self._cache_info: dict[str, CacheConfigInfo] = {}  # model_name -> its cache configuration

    def add_model(self, model_name: str, cache: CacheConfigInfo) -> None:
        """Export the info series of `model_name` too (its renamed series come with its Sluice ones)."""
        self._cache_info[model_name] = cache

    def describe(self) -> list[Metric]:
        """Nothing up front: the registry must not collect() at registration, before the families exist."""
        return []

    def collect(self) -> Iterator[Metric]:
        """The renamed families (the LoRA info series among them), then the cache-config info series."""
        for field, names in RENAMES.items():
            (family,) = getattr(self._families, field).collect()
            for name in names:
                yield _renamed(family, name)
        cache = GaugeMetricFamily(CACHE_INFO, "KV cache configuration (value 1).",
                                  labels=("model_name", "block_size", "num_gpu_blocks", "num_cpu_blocks",
                                          "enable_prefix_caching"))
        total, host = self._blocks("total_blocks"), self._blocks("total_host_blocks")
        for model, info in self._cache_info.items():
            cache.add_metric((model, str(info.block_size), str(int(total.get(model, 0))),
                              str(int(host.get(model, 0))), str(info.enable_prefix_caching)), 1.0)
        yield cache

    def _blocks(self, field: str) -> dict[str, float]:
        """model_name -> the current value of a per-model Sluice gauge."""
        (family,) = getattr(self._families, field).collect()
        return {s.labels["model_name"]: s.value for s in family.samples}


def _renamed(family: Metric, name: str) -> Metric:
    """A copy of `family` (all its samples, labels and values) under another family name."""
    out = Metric(name, family.documentation, family.type, family.unit)
    out.samples = [s._replace(name=name + s.name[len(family.name):]) for s in family.samples]
    return out
