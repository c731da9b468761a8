"""`sluice bench serve --mixed` against a fake server whose streams slow down while long prompts are in flight."""

from __future__ import annotations

import argparse
import asyncio

import orjson
import pytest
from aiohttp import web

from sluice.service.bench import add_bench_subcommands
from sluice.service.bench.mixed import SMALL_GRAMMAR, MixedWorkload, mixed_lines, run_mixed
from sluice.service.bench.serve import ServeConfig

pytestmark = pytest.mark.timeout(60)
IDLE_GAP, LOADED_GAP, LONG_S = 0.02, 0.04, 0.6  # the fake's stream pace alone and beside the long prompts


def fake_app(seen: list[dict]) -> web.Application:
    state = {"long": 0}

    async def models(request):
        return web.json_response({"data": [{"id": "fake"}]})

    async def sse(request, chunks):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        async for chunk in chunks:
            await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def stream(max_tokens, chat):
        for i in range(max_tokens):
            await asyncio.sleep(LOADED_GAP if state["long"] else IDLE_GAP)
            yield {"choices": [{"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": f" w{i}"}]}

    async def long_prompts(prompts):
        state["long"] += 1
        try:
            for i in range(len(prompts)):  # one prompt's token after another
                await asyncio.sleep(LONG_S / len(prompts))
                yield {"choices": [{"index": i, "text": "t", "finish_reason": "length"}]}
        finally:
            state["long"] -= 1

    async def completions(request):
        body = await request.json()
        seen.append(body | {"tenant": request.headers.get("x-tenant")})
        prompt = body["prompt"]
        if isinstance(prompt, list):
            return await sse(request, long_prompts(prompt))
        if body["max_tokens"] == 1:  # a long prompt sent on its own
            return await sse(request, long_prompts([prompt]))
        return await sse(request, stream(body["max_tokens"], chat=False))

    async def chat(request):
        body = await request.json()
        seen.append(body | {"tenant": request.headers.get("x-tenant")})
        return await sse(request, stream(body["max_tokens"], chat=True))

    async def embeddings(request):
        body = await request.json()
        seen.append(body)
        state["long"] += 1
        try:
            await asyncio.sleep(LONG_S)
        finally:
            state["long"] -= 1
        return web.json_response({"data": [{"index": i, "embedding": [0.0]} for i in range(len(body["input"]))]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def run(w: MixedWorkload, seen: list[dict]):
    async def main():
        runner = web.AppRunner(fake_app(seen))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await run_mixed(ServeConfig(base_url=f"http://127.0.0.1:{port}", progress=False), w)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_mixed_reports_stream_pace_long_prompts_and_the_probe():
    seen: list[dict] = []
    r = run(MixedWorkload(streams=2, long_prompts=4, long_input_len=20, idle_s=0.5, probe_delay_s=0.1, alone=True),
            seen)
    assert not r.errors, r.errors
    assert r.stream_idle_itl_ms.p50 == pytest.approx(1e3 * IDLE_GAP, rel=0.5)
    assert r.stream_loaded_itl_ms.p50 == pytest.approx(1e3 * LOADED_GAP, rel=0.5)
    assert 0.3 < r.rate_ratio < 0.8  # the fake halves the streams' pace
    assert r.long_ttft_ms.count == 4 and r.long_ttft_ms.max <= 1e3 * LONG_S * 1.5
    assert r.long_completion_s == pytest.approx(LONG_S, rel=0.5) and r.slowdown == pytest.approx(1.0, rel=0.5)
    assert r.probe_ttft_ms is not None and r.probe_ttft_ms < 1e3 * LONG_S
    lists = [b for b in seen if isinstance(b["prompt"] if "prompt" in b else None, list)]
    assert len(lists) == 2 and all(len(b["prompt"]) == 4 and b["max_tokens"] == 1 for b in lists)
    assert any("messages" in b for b in seen)  # the probe is a chat
    text = "\n".join(mixed_lines(r))
    assert "Stream ITL loaded" in text and "One-line chat TTFT" in text


def test_mixed_can_send_the_long_prompts_as_separate_requests():
    seen: list[dict] = []
    r = run(MixedWorkload(streams=1, long_prompts=3, long_input_len=10, idle_s=0.3, probe_delay_s=0.0,
                          large="separate"), seen)
    assert not r.errors and r.long_ttft_ms.count == 3
    assert sum(1 for b in seen if b.get("max_tokens") == 1 and isinstance(b.get("prompt"), str)) == 3


def test_mixed_can_send_the_large_request_and_the_streams_as_two_tenants():
    seen: list[dict] = []
    r = run(MixedWorkload(streams=1, long_prompts=3, long_input_len=10, idle_s=0.3, probe_delay_s=0.0,
                          large="separate", tenant_header="x-tenant"), seen)
    assert not r.errors
    assert {b["tenant"] for b in seen if b.get("max_tokens") == 1} == {"bulk"}
    assert {b["tenant"] for b in seen if b.get("max_tokens") != 1} == {"interactive"}  # the stream and the chat
    seen.clear()
    run(MixedWorkload(streams=1, long_prompts=3, long_input_len=10, idle_s=0.3, probe_delay_s=0.0), seen)
    assert {b["tenant"] for b in seen} == {None}


def test_mixed_can_send_embedding_inputs_or_a_prompt_list_under_a_grammar():
    seen: list[dict] = []
    r = run(MixedWorkload(streams=1, long_prompts=5, long_input_len=10, idle_s=0.3, probe_delay_s=0.0,
                          large="embeddings"), seen)
    assert not r.errors and r.long_ttft_ms.count == 5 and 0.3 < r.rate_ratio < 0.8
    assert [len(b["input"]) for b in seen if "input" in b] == [5]
    seen.clear()
    r = run(MixedWorkload(streams=1, long_prompts=4, long_input_len=10, long_output_len=6, idle_s=0.3,
                          probe_delay_s=0.0, large="grammar"), seen)
    assert not r.errors
    held = [b for b in seen if isinstance(b.get("prompt"), list)]
    assert len(held) == 1 and held[0]["structured_outputs"] == SMALL_GRAMMAR and held[0]["max_tokens"] == 6
    with pytest.raises(ValueError, match="large must be one of"):
        MixedWorkload(large="tools").validate()


def test_cli_builds_the_mixed_workload():
    parser = argparse.ArgumentParser()
    add_bench_subcommands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "serve", "--mixed", "--mixed-long-prompts", "8", "--mixed-large", "separate"])
    from sluice.service.bench.cli import _mixed

    w = _mixed(args)
    assert (w.long_prompts, w.large, w.streams) == (8, "separate", 2)
    assert _mixed(parser.parse_args(["bench", "serve"])) is None
