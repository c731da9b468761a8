"""`bench peers`: the float pair by the CPU (faked both ways), workload E against a fake llama.cpp server (its
warm-up, one long prompt at a time, RSS after it, the prefill rate) and the machine's matmul rate it is set
against."""

from __future__ import annotations

import json
import sys

import pytest

from sluice.service.bench import isa_cap, peer_plan
from sluice.service.bench.peer_plan import E_SLOT_CTX, Launch, Line, default_pairs, parse_formats, workloads
from sluice.service.bench.peers_report import table

pytestmark = pytest.mark.timeout(120)


def test_float_pair_follows_the_cpu_unless_the_formats_name_it(monkeypatch, capsys):
    import argparse

    from sluice.service.bench import add_bench_subcommands
    from sluice.service.bench.peer_plan import float_pairs

    quantized = (("int4", "Q4_1"), ("Q4_K", "Q4_K_M"), ("Q4_0", "Q4_0"))
    pairs, native = float_pairs(["avx512_bf16"])
    assert pairs == (("bf16", "BF16"),) and native.startswith("bf16 / BF16") and "(avx512_bf16)" in native
    assert default_pairs(["amx_bf16", "avx512_bf16"]) == (("bf16", "BF16"), *quantized)
    pairs, emulated = float_pairs([])
    assert pairs == (("fp32", "F32"), ("f16", "F16")) and "no native bf16" in emulated and "16-bit" in emulated
    assert default_pairs([]) == (("fp32", "F32"), ("f16", "F16"), *quantized)
    parser = argparse.ArgumentParser()
    add_bench_subcommands(parser.add_subparsers(dest="command"))
    # The machine's own flags where none are given, faked both ways: the CLI's plan follows them.
    for flags, present, absent in (([], "360m llama.cpp F16", "BF16"), (["avx512_bf16"], "360m Sluice bf16",
                                                                      "llama.cpp F16")):
        monkeypatch.setattr(peer_plan, "native_bf16_flags", lambda flags=flags: flags)
        monkeypatch.setattr(isa_cap, "native_bf16_flags", lambda flags=flags: flags)
        assert parse_formats("") == default_pairs(flags)
        args = parser.parse_args(["bench", "peers", "--estimate", "--sizes", "360m", "--d-sizes", "none"])
        assert args.func(args) == 0
        out = capsys.readouterr().out
        assert present in out and absent not in out and "360m Sluice int4" in out
        assert parse_formats("bf16,F16") == (("f16", "F16"), ("bf16", "BF16"))  # named: kept, whatever the CPU
        args = parser.parse_args(["bench", "peers", "--estimate", "--sizes", "360m", "--formats", "f32"])
        assert args.func(args) == 0 and "360m llama.cpp F32\n" in capsys.readouterr().out
    text = table({"meta": {"sizes": [], "float_pair": emulated, "formats": ["fp32/F32", "f16/F16"]}, "servers": {},
                  "ratios": {}})
    assert f"Float pair: {emulated}; formats run: fp32/F32, f16/F16." in text


def test_workloads_option_keeps_only_those_on_every_server(capsys):
    import argparse

    from sluice.service.bench import add_bench_subcommands

    lines = peer_plan.plan(("135m",), (("fp32", "F32"),), ("135m",), workloads=("E",))
    assert [line.name for line in lines] == ["135m Sluice fp32", "135m llama.cpp F32"]
    assert all(launch.workloads == ("E",) and launch.slot_ctx == E_SLOT_CTX
               for line in lines for launch in line.launches)
    kept = peer_plan.plan(("135m",), (("fp32", "F32"),), ("135m",), workloads=("B", "D"))
    assert {line.name for line in kept} >= {"135m Sluice fp32 ngram", "135m llama.cpp F32"}
    assert {w for line in kept for launch in line.launches for w in launch.workloads} == {"B", "D"}
    assert peer_plan.parse_workloads(" e, a") == ("A", "E") and peer_plan.parse_workloads("") == peer_plan.WORKLOADS
    with pytest.raises(ValueError, match="unknown workloads"):
        peer_plan.parse_workloads("E,F")
    parser = argparse.ArgumentParser()
    add_bench_subcommands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "peers", "--estimate", "--sizes", "135m", "--workloads", "G"])
    assert args.func(args) == 2 and "unknown workloads" in capsys.readouterr().err


# A llama.cpp-like server for workload E: logs each prompt (its length, its first words, whether another request
# was in flight) after answering it; its "prefill" takes 0.1 s per 2,000 words.
FAKE_SERVER = """
import asyncio, json, sys
from aiohttp import web

log, port, busy = sys.argv[1], int(sys.argv[sys.argv.index("--port") + 1]), []

async def health(request):
    return web.json_response({"status": "ok"})

async def models(request):
    return web.json_response({"data": [{"id": "m"}]})

async def completions(request):
    body = await request.json()
    busy.append(1)
    overlap, words = len(busy) > 1, body["prompt"].split()
    await asyncio.sleep(len(words) / 20000)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(body["max_tokens"]):
        await resp.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": f" t{i}"}]}).encode() + b"\\n\\n")
    usage = {"choices": [], "usage": {"prompt_tokens": len(words), "completion_tokens": body["max_tokens"]}}
    await resp.write(b"data: " + json.dumps(usage).encode() + b"\\n\\ndata: [DONE]\\n\\n")
    busy.pop()
    with open(log, "a") as f:
        f.write(json.dumps({"words": len(words), "head": words[:8], "overlap": overlap}) + "\\n")
    return resp

app = web.Application()
app.router.add_get("/health", health)
app.router.add_get("/v1/models", models)
app.router.add_post("/v1/completions", completions)
web.run_app(app, host="127.0.0.1", port=port, print=None)
"""


def test_workload_e_sends_long_prompts_one_at_a_time_after_a_warm_up_of_its_own(tmp_path, monkeypatch):
    from sluice.service.bench import peers, serve
    from sluice.service.bench.peer_plan import prefill_flops

    monkeypatch.setattr(serve, "load_tokenizer", lambda name: None)  # random words, about a token each
    log = tmp_path / "requests.jsonl"
    line = Line("135m", "llama.cpp", "F32", launches=(Launch(1, E_SLOT_CTX, ("E",)),))
    out = peers._measure(line, [[sys.executable, "-c", FAKE_SERVER, str(log)]], lambda *_: None)
    assert "error" not in out, out.get("error")
    w, e = workloads("135m")["E"], out["E"]
    seen = [json.loads(x) for x in log.read_text().splitlines()]
    # a short warm-up unlike E's first prompt (which it would otherwise hand to the prefix cache), then E's
    assert [r["words"] for r in seen] == [64] + [w.input_len] * w.num_prompts
    assert seen[0]["head"] != seen[1]["head"] and not any(r["overlap"] for r in seen)
    assert e["completed"] == w.num_prompts and e["failed"] == 0 and e["prompt_tokens"] == w.input_len
    assert 100 <= e["ttft_p50_ms"] < 2000 and e["rss_mib"] > 0 and out["rss_mib"] == pytest.approx(e["rss_mib"], 0.5)
    ttft_s = e["ttft_p50_ms"] / 1000
    assert e["prefill_tok_s"] == pytest.approx(w.input_len / ttft_s)
    assert e["prefill_gflop_s"] == pytest.approx(prefill_flops("135m", w.input_len) / ttft_s / 1e9)
    # 2 x 2,000 tokens x SmolLM2-135M's 106M weights outside the embeddings, and attention's 2 x 30 x 576 x 2,000^2
    assert prefill_flops("135m", 2000) == pytest.approx(2 * 2000 * 30 * 3_538_944 + 2 * 30 * 576 * 2000**2
                                                        + 2 * 49152 * 576)


def test_machine_peak_is_a_matmul_rate_on_the_threads_given():
    import torch

    from sluice.service.bench.ceiling import matmul_gflop_s

    before = torch.get_num_threads()
    assert matmul_gflop_s(torch.float32, 1, n=128, reps=2) > 0.05 and torch.get_num_threads() == before
    assert matmul_gflop_s(torch.int8, 1, n=128, reps=2) > 0.05 and torch.get_num_threads() == before
