"""The bench package: stats math, the strict SSE parser, the serve client against a fake server, the offline bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import math

import orjson
import pytest
from aiohttp import web

from sluice.service.bench import add_bench_subcommands
from sluice.service.bench.serve import ServeConfig, run_serve
from sluice.service.bench.sse import CompletionStream, SSEError, SSEEvent, SSEParser
from sluice.service.bench.stats import RequestRecord, distribution, percentile, summarize
from sluice.service.bench.workloads import (
    Workload,
    arrival_offsets,
    sample_lengths,
    text_prompts,
    token_prompts,
)

pytestmark = pytest.mark.timeout(120)


# --- stats ---------------------------------------------------------------------------------------


def test_percentiles_match_numpy_linear_interpolation():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile(values, 100) == 5.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) == 0.0
    d = distribution([0.001, 0.002, 0.003])
    assert (d.mean, d.p50, d.max, d.count) == (pytest.approx(2.0), pytest.approx(2.0), pytest.approx(3.0), 3)


def test_summarize_ttft_tpot_itl_and_throughput():
    ok = RequestRecord(10, 4, start=0.0, end=0.5, token_times=[0.1, 0.2, 0.3, 0.4], output_tokens=4, ok=True)
    bad = RequestRecord(10, 4, start=0.0, end=0.1, ok=False, error="HTTP 500: boom")
    r = summarize("x", [ok, bad], duration_s=2.0)
    assert (r.completed, r.failed, r.output_tokens, r.input_tokens) == (1, 1, 4, 10)
    assert r.output_throughput == pytest.approx(2.0)
    assert r.ttft_ms.p50 == pytest.approx(100.0)
    assert r.tpot_ms.p50 == pytest.approx(100.0)  # (0.4 - 0.1) / (4 - 1)
    assert r.itl_ms.count == 3 and r.itl_ms.p50 == pytest.approx(100.0)
    assert r.e2el_ms.p50 == pytest.approx(500.0)
    assert r.errors == ["HTTP 500: boom"]


# --- workloads -----------------------------------------------------------------------------------


def test_workload_prompts_lengths_prefix_and_arrivals():
    w = Workload(num_prompts=20, input_len=50, output_len=10, random_range_ratio=0.2, prefix_len=16, seed=3)
    lengths = sample_lengths(w)
    assert all(40 <= n <= 60 and 8 <= m <= 12 for n, m in lengths)
    prompts = token_prompts(w, 400, exclude={0, 1, 2})
    assert [len(p) for p in prompts] == [n for n, _ in lengths]
    assert all(p[:16] == prompts[0][:16] for p in prompts) and len({tuple(p[16:]) for p in prompts}) == 20
    assert not any(t in (0, 1, 2) for p in prompts for t in p)
    assert token_prompts(w, 400) == token_prompts(w, 400)  # reproducible
    words = text_prompts(Workload(num_prompts=3, input_len=30, prefix_len=5))
    assert all(len(text.split()) == 30 and text.split()[:5] == words[0][0].split()[:5] for text, _, _ in words)
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    gaps = arrival_offsets(2000, 50.0, seed=1)
    assert gaps == sorted(gaps) and (gaps[-1] / 1999) == pytest.approx(1 / 50, rel=0.1)


# --- SSE -----------------------------------------------------------------------------------------


def test_sse_parser_handles_split_lines_crlf_comments_and_multiline_data():
    body = "\ufeff: keep-alive\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\nevent: x\nid: 7\ndata:no-space\n\ndata: [DONE]\r\r"
    raw = body.encode()
    for size in (1, 2, 3, 7, len(raw)):  # every way of cutting the bytes gives the same events
        parser, events = SSEParser(), []
        for i in range(0, len(raw), size):
            events += parser.feed(raw[i : i + size])
        events += parser.close()
        assert events == [SSEEvent('{"a":\n1}'), SSEEvent("no-space", "x", "7"), SSEEvent("[DONE]", "message", "7")]


def test_sse_parser_rejects_truncated_streams_and_bad_utf8():
    parser = SSEParser()
    parser.feed(b"data: {\"a\": 1}\n")
    with pytest.raises(SSEError, match="inside an event"):
        parser.close()
    parser = SSEParser()
    parser.feed("data: é".encode()[:-1])
    with pytest.raises(SSEError, match="UTF-8"):
        parser.close()
    with pytest.raises(SSEError, match="UTF-8"):
        SSEParser().feed(b"data: \xff\n\n")
    split = "data: é\n\n".encode()  # a multi-byte character cut between chunks is fine
    parser = SSEParser()
    assert parser.feed(split[:7]) == [] and parser.feed(split[7:]) == [SSEEvent("é")]


def test_completion_stream_contract():
    stream = CompletionStream()
    chunk = stream.on_event(SSEEvent('{"choices": [{"index": 0, "text": "hi", "finish_reason": null}]}'))
    assert chunk.text == "hi"
    assert stream.on_event(SSEEvent('{"choices": [], "usage": {"completion_tokens": 3}}')).completion_tokens == 3
    with pytest.raises(SSEError, match="DONE"):
        stream.finish()
    assert stream.on_event(SSEEvent("[DONE]")).done
    stream.finish()
    with pytest.raises(SSEError, match="after"):
        stream.on_event(SSEEvent("{}"))
    for bad, message in (("not json", "not JSON"), ('{"error": {"message": "overloaded"}}', "overloaded"),
                         ('{"id": 1}', "choices"), ("[1]", "object")):
        with pytest.raises(SSEError, match=message):
            CompletionStream().on_event(SSEEvent(bad))
    chat = CompletionStream(chat=True)
    assert chat.on_event(SSEEvent('{"choices": [{"delta": {"content": "yo"}}]}')).text == "yo"


# --- serve client against an in-process fake server ------------------------------------------------

DELAY = 0.03


def fake_app(bodies: list[dict]) -> web.Application:
    """Streams max_tokens one-word chunks DELAY apart; prompts containing 'BROKEN' end without [DONE]."""

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        bodies.append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(DELAY)
            chunk = {"choices": [{"index": 0, "text": f" w{i}", "finish_reason": "length" if i == n - 1 else None}]}
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if "BROKEN" in body["prompt"]:
            return resp
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": {"completion_tokens": n}}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


def run_against_fake(cfg: ServeConfig, bodies: list[dict]):
    async def main():
        runner = web.AppRunner(fake_app(bodies))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        cfg.base_url = f"http://127.0.0.1:{port}"
        try:
            return await run_serve(cfg)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_serve_client_measures_a_fake_server():
    bodies: list[dict] = []
    w = Workload("fake", num_prompts=6, input_len=20, output_len=5, max_concurrency=2)
    result = run_against_fake(ServeConfig(w, progress=False), bodies)
    assert (result.completed, result.failed, result.output_tokens) == (6, 0, 30)
    assert len(bodies) == 6 and all(
        b["stream"] and b["ignore_eos"] and b["max_tokens"] == 5 and b["model"] == "fake-model" for b in bodies
    )
    assert result.ttft_ms.p50 == pytest.approx(1000 * DELAY, abs=25)
    assert result.itl_ms.p50 == pytest.approx(1000 * DELAY, abs=20)
    assert result.tpot_ms.p50 == pytest.approx(1000 * DELAY, abs=20)
    # 6 requests, 2 at a time, ~5 * DELAY each: about three rounds
    assert result.duration_s >= 3 * 5 * DELAY * 0.9


def test_serve_client_counts_truncated_streams_as_failed():
    bodies: list[dict] = []
    w = Workload("broken", num_prompts=2, input_len=4, output_len=2)
    cfg = ServeConfig(w, progress=False, extra_body={"prompt": "BROKEN"})
    result = run_against_fake(cfg, bodies)
    assert (result.completed, result.failed) == (0, 2)
    assert "DONE" in result.errors[0]


def test_cli_parses_bench_subcommands():
    parser = argparse.ArgumentParser()
    add_bench_subcommands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "serve", "--request-rate", "2.5", "--max-concurrency", "4"])
    assert (args.request_rate, args.max_concurrency, args.base_url) == (2.5, 4, "http://127.0.0.1:8000")
    args = parser.parse_args(["bench", "offline", "--standard", "--no-prefix-caching", "--max-num-seqs", "8"])
    assert args.standard and callable(args.func)


# --- offline bench on a tiny random model --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from tests.support.tiny import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("bench") / "tiny"))


def test_offline_bench_with_all_baselines(tiny_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_subcommands(parser.add_subparsers(dest="command"))
    out = tmp_path / "results.json"
    args = parser.parse_args([
        "bench", "offline", "--model", tiny_dir, "--device", "cpu", "--num-kv-blocks", "64",
        "--num-prompts", "6", "--input-len", "20", "--output-len", "5", "--output", str(out),
    ])
    assert args.func(args) == 0
    results = json.loads(out.read_text())
    entry = results["workloads"]["custom"]
    assert entry["sluice"]["completed"] == 6 and entry["sluice"]["output_tokens"] == 30
    assert entry["generate"]["output_tokens"] == 30 and entry["generate_batch"]["output_tokens"] == 30
    assert entry["ceiling"]["tokens_per_s"] > 0 and entry["ceiling"]["prefill_groups"] >= 1
    assert set(entry["ratios"]) == {"vs_ceiling", "vs_generate", "vs_generate_batch"}
    assert "| custom |" in out.with_suffix(".md").read_text()


def test_profile_and_ceiling_pieces(tiny_dir):
    from sluice.service.bench.ceiling import RawForward, measure_ceiling, sdpa_copy
    from sluice.service.bench.offline import run_workload
    from sluice.service.bench.profile import PHASES, profile_decode
    from sluice.service.bench.sched_micro import scheduler_scaling
    from sluice.service.config import SluiceConfig
    from sluice.service.engine.engine import LLMEngine

    config = SluiceConfig()
    config.model.device, config.cache.num_kv_blocks = "cpu", 64
    from sluice.service.executor.model_loader import load_model

    model, tok = load_model(tiny_dir, "cpu", "float32")
    engine = LLMEngine(config, model=model, tokenizer=tok)
    p = profile_decode(engine, 4, input_len=10, output_len=6, op_steps=1)
    assert set(p.phase_ms) == set(PHASES) and p.steps >= 2 and p.top_ops
    assert sum(p.phase_ms.values()) == pytest.approx(p.step_ms, rel=1e-6)
    assert p.phase_ms["attention"] > 0 and p.phase_ms["sampling"] > 0
    run = run_workload(engine, Workload("t", num_prompts=5, input_len=12, output_len=4, max_concurrency=2))
    decodes = [s.num_decodes for s in run.steps if s.num_decodes]
    assert max(decodes) <= 2 and run.result.completed == 5
    ceiling = measure_ceiling(run, RawForward(sdpa_copy(engine.model), reps=1))
    assert ceiling.decode_s > 0 and ceiling.output_tokens == 20
    points = scheduler_scaling((8, 32), steps=3)
    assert [q.num_running for q in points] == [8, 32] and all(q.step_us > 0 for q in points)


def test_shape_configs_keep_the_size_and_change_only_the_layer_layout():
    from sluice.service.bench.shapes import ARCHS, config_of

    configs = {arch: config_of(arch, "360m") for arch in ARCHS}
    assert ({c.hidden_size for c in configs.values()} == {960}
            and {c.num_hidden_layers for c in configs.values()} == {32})
    assert type(configs["qwen3"]).__name__ == "Qwen3Config" and configs["qwen3"].head_dim == 64
    with pytest.raises(ValueError, match="unknown architecture"):
        config_of("gpt2", "135m")


def test_server_process_waits_for_ready_and_stops_on_leaving(tmp_path):
    import sys
    import urllib.request

    from sluice.service.bench.server_process import ServerProcess

    script = tmp_path / "serve.py"  # a stand-in server taking --host/--port as Sluice and llama-server do
    script.write_text("import argparse, http.server\np = argparse.ArgumentParser(); p.add_argument('--host');"
                      " p.add_argument('--port', type=int)\na = p.parse_args()\n"
                      "http.server.ThreadingHTTPServer((a.host, a.port), http.server.SimpleHTTPRequestHandler)"
                      ".serve_forever()\n")
    log = tmp_path / "server.log"
    with ServerProcess([sys.executable, str(script)], "/", log) as server:
        with urllib.request.urlopen(server.base + "/") as reply:
            assert reply.status == 200
        assert server.peak_rss_mib() >= server.rss_mib() > 0  # no children: the tree is the process
    assert server.proc.poll() is not None and "GET / " in log.read_text()
    with pytest.raises(RuntimeError, match="server exited"):  # the silent form (no log), as bench peers runs
        ServerProcess([sys.executable, "-c", "raise SystemExit(3)"], "/")
