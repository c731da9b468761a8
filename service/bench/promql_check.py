"""Run every PromQL expression of the Grafana dashboard and the alerting rules against a real Prometheus.

Used by tests/metrics/test_prometheus_real.py (which starts Prometheus and `sluice serve` itself), and usable on its
own against any Prometheus that scrapes Sluice:

    python -m sluice.service.bench.promql_check --prometheus http://127.0.0.1:9090 --model-name SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parents[2] / "metrics"  # the metric definitions this tool reads
DASHBOARD = HERE / "grafana-dashboard.json"
ALERTS = HERE / "alerts.yml"
ALERT_TESTS = HERE / "alerts_test.yml"
# Metric the dashboard's model_name variable lists its values from (label_values(<metric>, model_name)).
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)")


# --- the expressions ----------------------------------------------------------------------------------------


def _panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows nest their panels


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expr) for every panel target of a Grafana dashboard, rows included."""
    found = []
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                found.append((f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]))
    return found


def alert_queries(rules: dict) -> list[tuple[str, str]]:
    """(where, expr) for every alerting and recording rule of a Prometheus rules file."""
    return [
        (f"rule {rule.get('alert') or rule.get('record')}", rule["expr"])
        for group in rules["groups"]
        for rule in group["rules"]
    ]


def variable_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(variable, metric, label) for every label_values() template variable."""
    found = []
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        match = _LABEL_VALUES.search(text)
        if var.get("type") == "query" and match:
            found.append((var["name"], match.group(1), match.group(2)))
    return found


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace Grafana variables ($x, ${x}, ${x:fmt}, [[x]]) as Grafana would for one selected value."""

    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in variables:
            raise KeyError(f"no value for Grafana variable ${name} in {expr!r}")
        return variables[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", repl, expr)


def load_dashboard(path: Path = DASHBOARD) -> dict:
    """The dashboard JSON."""
    return json.loads(path.read_text())


def load_rules(path: Path = ALERTS) -> dict:
    """The alerting rules YAML."""
    return yaml.safe_load(path.read_text())


# --- Prometheus binaries and process ------------------------------------------------------------------------


def ensure_prometheus() -> tuple[str, str]:
    """Paths of `prometheus` and `promtool`, installing Debian's package when missing; RuntimeError if impossible."""
    found = shutil.which("prometheus"), shutil.which("promtool")
    if all(found):
        return found  # type: ignore[return-value]
    if not shutil.which("apt-get") or os.geteuid() != 0:
        raise RuntimeError("prometheus/promtool are not installed and apt-get is unavailable or not root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
    found = shutil.which("prometheus"), shutil.which("promtool")
    if not all(found):
        raise RuntimeError("the prometheus package installed no prometheus/promtool binaries")
    return found  # type: ignore[return-value]


class PrometheusServer:
    """A throwaway Prometheus on loopback scraping `targets` every second, with the alerting rules loaded."""

    def __init__(self, binary: str, workdir: Path, port: int, targets: list[str], rule_files: list[Path]) -> None:
        self.url = f"http://127.0.0.1:{port}"
        workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": "sluice", "static_configs": [{"targets": targets}]}],
        }
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")  # closed in stop()
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until /-/ready answers 200; RuntimeError with the log tail otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus did not become ready:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        """The end of Prometheus' log, for failure messages."""
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        """Terminate Prometheus (kill after 10 s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# --- the HTTP API -------------------------------------------------------------------------------------------


def api(url: str, path: str, **params: str) -> dict:
    """GET a Prometheus API path; returns the decoded JSON body, error responses included."""
    full = f"{url}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(full, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:  # 400/422 carry a JSON body saying what failed to parse
        return json.loads(err.read() or b"{}") or {"status": "error", "error": str(err)}


def query(url: str, expr: str, at: float | None = None) -> dict:
    """An instant query through /api/v1/query."""
    params = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    return api(url, "/api/v1/query", **params)


def check(url: str, model_name: str, rate_interval: str = "1m", at: float | None = None,
          require_data: bool = True) -> list[str]:
    """Problems found running every dashboard and alert expression (empty when all is well)."""
    variables = {"model_name": model_name, "__rate_interval": rate_interval, "datasource": "prometheus"}
    dashboard = load_dashboard()
    problems = []
    for where, expr in dashboard_queries(dashboard):
        body = query(url, substitute(expr, variables), at)
        if body.get("status") != "success":
            problems.append(f"{where}: {body.get('errorType')}: {body.get('error')} in {expr}")
        elif require_data and not body["data"]["result"]:
            problems.append(f"{where}: no data for {substitute(expr, variables)}")
    for where, expr in alert_queries(load_rules()):
        body = query(url, expr, at)
        if body.get("status") != "success":
            problems.append(f"{where}: {body.get('errorType')}: {body.get('error')} in {expr}")
    for name, metric, label in variable_queries(dashboard):
        body = api(url, f"/api/v1/label/{label}/values", **{"match[]": metric})
        if require_data and model_name not in body.get("data", []):
            problems.append(f"variable ${name}: {model_name!r} not among label_values({metric}, {label})")
    return problems


def main(argv: list[str] | None = None) -> int:
    """CLI: check the dashboard and alert expressions against a running Prometheus."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL.")
    parser.add_argument("--model-name", required=True, help="Value for the dashboard's $model_name.")
    parser.add_argument("--rate-interval", default="5m", help="Value for $__rate_interval.")
    parser.add_argument("--parse-only", action="store_true", help="Only require that expressions parse.")
    args = parser.parse_args(argv)
    problems = check(args.prometheus, args.model_name, args.rate_interval, require_data=not args.parse_only)
    for p in problems:
        print(p, file=sys.stderr)
    n = len(dashboard_queries(load_dashboard())) + len(alert_queries(load_rules()))
    print(f"{n} expressions checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
