"""`make gpu-check --tiny`: the GPU check script's CPU self-test, so it keeps working without a GPU in CI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO as ROOT


@pytest.mark.deep  # slow (builds or a long end-to-end run): `make test-deep`
@pytest.mark.timeout(300)
def test_gpu_check_tiny_runs_on_cpu_and_writes_its_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--tiny", "--output", str(out)],
                          capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["tiny"] and report["device"] == "cpu"
    assert report["parity"]["fp32_exact"] and report["attention"]["ok"] and report["attention_flex"]["ok"]
    assert {"torch/float32", "torch/bfloat16"} <= set(report["attention"])
    assert {"flex/float32", "flex/bfloat16"} == {k for k in report["attention_flex"] if "/" in k}
    assert {k.split("/")[0] for k in report["parity"] if "/" in k} >= {"torch", "flex"}
    for run in ("A", "B"):
        figures = report["bench"][run]
        assert figures["failed"] == 0 and figures["output_tokens"] > 0 and figures["tpot_ms_p50"] > 0
    assert report["bench"]["A"]["requests"] == 64 and report["bench"]["A"]["hf_generate_tokens_per_s"] > 0
    assert report["bench"]["B"]["hf_generate_tpot_ms"] > 0


def test_the_budget_is_shared_among_the_stages_that_run(tmp_path, monkeypatch):
    """--only-bench gives the benchmark the whole budget; --skip-bench shares it among the checks."""
    from sluice.service.bench import gpu_check

    seen = {}

    def fake_stages(stages, report, write):
        seen.update({stage.name: stage.budget_s for stage in stages})
        for stage in stages:
            report[stage.name] = {"ok": True, "fp32_exact": True}
        return report

    monkeypatch.setattr(gpu_check, "run_stages", fake_stages)
    gpu_check.main(["--tiny", "--only-bench", "--budget-s", "100", "--output", str(tmp_path / "a.json")])
    assert seen == {"bench": 100}
    seen.clear()
    gpu_check.main(["--tiny", "--skip-bench", "--budget-s", "110", "--output", str(tmp_path / "b.json")])
    assert set(seen) == {"attention", "attention_flex", "parity", "sampler_syncs"}
    assert abs(sum(seen.values()) - 110) < 1e-9 and seen["parity"] > seen["attention_flex"] > seen["attention"]


def test_main_in_process_leaves_the_callers_logging_alone(tmp_path, monkeypatch):
    """Only the script sets up the engine's log lines: an in-process main() must not turn INFO on for the
    process (a later test counting the native build's log lines saw an extra one)."""
    import logging

    from sluice.service.bench import gpu_check

    def passing_stages(stages, report, write):
        report.update({stage.name: {"ok": True} for stage in stages})
        return report

    monkeypatch.setattr(gpu_check, "run_stages", passing_stages)
    logger = logging.getLogger("sluice")
    before = (logger.level, list(logger.handlers))
    gpu_check.main(["--tiny", "--only-bench", "--output", str(tmp_path / "a.json")])
    assert (logger.level, list(logger.handlers)) == before
