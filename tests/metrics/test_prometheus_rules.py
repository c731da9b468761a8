"""The alerting rules pass promtool's checks and unit tests; the dashboard's expressions are well-formed."""

from __future__ import annotations

import subprocess

import pytest

from sluice.service.bench import promql_check as pc

pytestmark = pytest.mark.timeout(600)  # the first run may apt-get install prometheus


@pytest.fixture(scope="module")
def promtool() -> str:
    try:
        return pc.ensure_prometheus()[1]
    except RuntimeError as err:
        pytest.skip(f"cannot install Prometheus here: {err}")


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_promtool_check_rules(promtool):
    done = run(promtool, "check", "rules", str(pc.ALERTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_promtool_alert_unit_tests(promtool):
    done = run(promtool, "test", "rules", str(pc.ALERT_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_severity_summary_and_description():
    rules = pc.load_rules()
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    assert {"SluiceQueueGrowing", "SluicePreemptionStorm", "SluiceKVCachePinnedFull", "SluiceHighErrorRate"} <= {
        a["alert"] for a in alerts
    }
    for alert in alerts:
        assert alert["labels"]["severity"] in ("warning", "critical"), alert["alert"]
        assert alert["annotations"]["summary"] and alert["annotations"]["description"], alert["alert"]


def test_dashboard_shape_and_variables():
    dash = pc.load_dashboard()
    names = {v["name"]: v for v in dash["templating"]["list"]}
    assert names["datasource"]["type"] == "datasource" and names["datasource"]["query"] == "prometheus"
    assert pc.variable_queries(dash) == [("model_name", "sluice_kv_cache_total_blocks", "model_name")]
    ids = [p["id"] for p in pc._panels(dash["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in pc._panels(dash["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
    queries = pc.dashboard_queries(dash)
    assert len(queries) >= 30
    exprs = " ".join(e for _, e in queries)
    for needed in ("sluice_time_to_first_token_seconds_bucket", "sluice_inter_token_latency_seconds_bucket",
                   "sluice_e2e_request_latency_seconds_bucket", "sluice_preemptions_total",
                   "sluice_prefix_cache_hit_tokens_total", "sluice_requests_waiting", "sluice_kv_cache_usage_ratio",
                   "sluice_engine_step_tokens", "sluice_request_queue_time_seconds_bucket"):
        assert needed in exprs, needed
    for where, expr in queries:
        assert 'model_name=~"$model_name"' in expr, where  # every panel follows the model selector


def test_substitute_handles_grafana_variable_forms():
    v = {"model_name": "m", "__rate_interval": "10s"}
    assert pc.substitute('rate(x{a=~"$model_name"}[$__rate_interval])', v) == 'rate(x{a=~"m"}[10s])'
    assert pc.substitute("${model_name} ${model_name:regex} [[model_name]]", v) == "m m m"
    with pytest.raises(KeyError):
        pc.substitute("$unknown", v)
