"""The scaling-measurement helpers: gauge parsing, quantiles and the report table."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from sluice.metrics.prometheus import SluiceMetrics, render_latest
from sluice.scheduling.output import SchedulerStats
from sluice.service.bench.measure_scaling import RateResult, gauges, quantile, table


def test_gauges_sums_series_of_the_live_exposition():
    reg = CollectorRegistry()
    SluiceMetrics("a", reg).observe_step(SchedulerStats(num_waiting=3, num_running=2, kv_cache_usage=0.5))
    SluiceMetrics("b", reg).observe_step(SchedulerStats(num_waiting=4))
    values = gauges(render_latest(reg)[0].decode())
    assert values["sluice_requests_waiting"] == 7
    assert values["sluice_requests_running"] == 2
    assert values["sluice_kv_cache_usage_ratio"] == 0.5
    assert not any(name.endswith("_total") for name in values)  # counters are not gauges


def test_quantile_is_nearest_rank():
    assert quantile([], 0.99) == 0.0
    assert quantile([3.0], 0.5) == 3.0
    values = [float(i) for i in range(1, 101)]
    assert quantile(values, 0.5) == 50.0
    assert quantile(values, 0.99) == 99.0
    assert quantile(values, 1.0) == 100.0


def test_table_has_a_row_per_rate():
    rows = table([RateResult(0.5, completed=10, ttft_p99_s=1.5), RateResult(2.0)]).splitlines()
    assert len(rows) == 4 and rows[2].startswith("| 0.5 |") and "1.50 s" in rows[2]
