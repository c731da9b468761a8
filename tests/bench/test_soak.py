"""The short soak: `sluice soak` for 6 s on the tiny model (30 s under the deep profile), far past capacity;
the full one is `make soak`."""

from __future__ import annotations

import argparse
import json

import pytest

from sluice.service.bench.soak import add_arguments, run
from tests.support.profiles import pick

# 12 sequences on 24 blocks of 16 tokens with swap for 6 blocks, 8 queue slots, 24 clients: 429s, swap
# preemption and its fallback to recompute all happen within the first seconds.
FLAGS = ("--served-model-name tiny --device cpu --block-size 16 --num-kv-blocks 24 --max-model-len 128 "
         "--swap-space 0.0000458 --max-num-seqs 12 --max-queued-requests 8")


@pytest.mark.timeout(240)
def test_short_soak(model_dir, tmp_path):
    p = argparse.ArgumentParser()
    add_arguments(p)
    duration = pick(6, 30, "SLUICE_SOAK_SECONDS")  # RSS samples in each third (one per 0.5 s), 429s and swaps
    args = p.parse_args(["--model", model_dir, "--serve-flags", FLAGS, "--duration", str(duration),
                         "--concurrency", "24", "--max-rss-growth-mib", "48", "--output", str(tmp_path / "soak.json")])
    result = run(args)
    print(json.dumps(result, indent=1))
    assert result["ok"], result["problems"]
    assert result["failed"] == 0 and result["completed"] > 0
    assert result["rejected"] > 0, "not overloaded: no request was refused with 429"
    assert result["aborted"] > 0, "no client disconnected"
    assert result["sent"] == result["completed"] + result["rejected"] + result["aborted"]
    assert result["server_exit_code"] == 0
    assert sum(result["health_after"]["preemptions"].values()) > 0, "the KV cache was never short"
