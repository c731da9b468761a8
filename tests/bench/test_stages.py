"""The one-shot check runner (service/bench/stages.py): a stage that raises, overruns or recompiles still leaves every
other stage's figures, and why, in the report written after each stage."""

from __future__ import annotations

import time

import torch

from sluice.service.bench.stages import Stage, run_stages


def test_each_stage_keeps_its_own_outcome_and_the_report_is_written_after_each():
    def recompiling():
        double = torch.compile(lambda x: x * 2, dynamic=False, backend="eager")
        for n in (2, 3):
            double(torch.ones(n))
        return {"ok": True}

    def overrunning():
        while True:
            time.sleep(0.01)

    def broken():
        raise ValueError("boom")

    written = []
    report = run_stages([Stage("overrunning", overrunning, 0.3), Stage("broken", broken, 5),
                         Stage("recompiling", recompiling, 60)], {"device": "cpu"},
                        lambda r: written.append(list(r)))
    assert list(report)[:4] == ["device", "overrunning", "elapsed_s", "broken"]
    assert "over its budget" in report["overrunning"]["error"] and "overrunning" in report["overrunning"]["traceback"]
    assert report["broken"]["error"] == "ValueError: boom" and "raise ValueError" in report["broken"]["traceback"]
    assert report["recompiling"]["ok"] and report["recompiling"]["graphs_compiled"] == 2
    assert any("size mismatch" in line for line in report["recompiling"]["recompiles"])
    stages = ["overrunning", "broken", "recompiling"]
    assert [[name for name in keys if name in stages] for keys in written] == [stages[:1], stages[:2], stages]
