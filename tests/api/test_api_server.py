"""End to end: `sluice serve` as a subprocess on a tiny random model, spoken to over HTTP."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import pytest

from tests.support.http import (
    TIMEOUT,
    check_chunks,
    check_error,
    finish_reasons,
    get,
    good_request,
    joined,
    parse_sse,
    post,
    stream,
)
from tests.support.server import MODEL, Server
from tests.support.tiny import tokenizer as tiny_tokenizer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


# Each server takes seconds to import torch and load the model, so there are only two, started in parallel.
SERVER_FLAGS = {
    "main": ["--num-kv-blocks", "512", "--max-model-len", "256", "--max-num-seqs", "64",
             "--max-num-batched-tokens", "512"],
    # API key, one sequence at a time, one waiting request at most, 4 KiB bodies; the drain test ends it.
    "limited": ["--num-kv-blocks", "64", "--max-model-len", "512", "--api-key", "sekrit", "--max-num-seqs", "1",
                "--max-queued-requests", "1", "--max-request-body-bytes", "4096", "--shutdown-timeout", "60"],
}


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    started = {name: Server(model_dir, logs, *flags) for name, flags in SERVER_FLAGS.items()}
    yield started
    for srv in started.values():
        srv.stop()


@pytest.fixture(scope="module")
def server(servers):
    srv = servers["main"].wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()[-4000:]


@pytest.fixture(scope="module")
def limited(servers):
    srv = servers["limited"].wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()[-4000:]  # already stopped by the drain test, with exit code 0


# ---- HTTP helpers ---------------------------------------------------------------------------------


GREEDY = {"model": MODEL, "temperature": 0, "ignore_eos": True}


# ---- the happy paths ------------------------------------------------------------------------------

async def test_probes_and_metadata(server):
    status, body, _ = await get(server.url, "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert (await get(server.url, "/ready"))[0] == 200
    status, body, headers = await get(server.url, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain") and b"# HELP" in body
    status, body, _ = await get(server.url, "/v1/models")
    data = json.loads(body)["data"]
    assert status == 200 and data[0]["id"] == MODEL and data[0]["object"] == "model"
    assert json.loads((await get(server.url, "/version"))[1])["version"]
    spec = json.loads((await get(server.url, "/openapi.json"))[1])
    assert spec["openapi"].startswith("3.") and {"/v1/completions", "/v1/chat/completions"} <= set(spec["paths"])


async def test_completion_non_stream(server):
    status, body, headers = await post(server.url, "/v1/completions",
                                       {**GREEDY, "prompt": "The capital of France is", "max_tokens": 8},
                                       {"X-Request-Id": "my-req-1"})
    assert status == 200 and headers["X-Request-Id"] == "my-req-1"
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    n_prompt = len(tiny_tokenizer().encode("The capital of France is"))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 8, "total_tokens": n_prompt + 8,
                             "prompt_tokens_details": body["usage"]["prompt_tokens_details"]}


async def test_completion_stream_equals_non_stream(server):
    req = {**GREEDY, "prompt": "Hello world", "max_tokens": 20}
    _, body, _ = await post(server.url, "/v1/completions", req)
    chunks = await stream(server.url, "/v1/completions", {**req, "stream": True,
                                                           "stream_options": {"include_usage": True}})
    check_chunks(chunks, "text_completion")
    *content, usage = chunks
    assert usage["choices"] == [] and usage["usage"] == body["usage"]
    assert all(c["usage"] is None for c in content)
    assert joined(content) == body["choices"][0]["text"]
    assert finish_reasons(content) == ["length"] and content[-1]["choices"][0]["finish_reason"] == "length"


async def test_chat_stream_and_non_stream(server):
    req = {**GREEDY, "messages": [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12}
    status, body, _ = await post(server.url, "/v1/chat/completions", req)
    assert status == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and body["choices"][0]["finish_reason"] == "length"
    tok = tiny_tokenizer()
    templ = tok.apply_chat_template(req["messages"], tokenize=False, add_generation_prompt=True)
    assert body["usage"]["prompt_tokens"] == len(tok.encode(templ, add_special_tokens=False))
    chunks = await stream(server.url, "/v1/chat/completions", {**req, "stream": True})
    check_chunks(chunks, "chat.completion.chunk")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert joined(chunks) == msg["content"] and finish_reasons(chunks) == ["length"]
    assert "usage" not in chunks[-1]


async def test_chat_default_max_tokens_uses_remaining_context(server):
    tok = tiny_tokenizer()

    def n_tokens(text: str) -> int:
        msgs = [{"role": "user", "content": text}]
        return len(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                              add_special_tokens=False))

    text = "hi"
    while n_tokens(text + " hello") <= 246:  # a long prompt leaves few tokens to generate
        text += " hello"
    status, body, _ = await post(server.url, "/v1/chat/completions", {
        **GREEDY, "messages": [{"role": "user", "content": text}]})
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == 256


async def test_stop_string_is_cut(server):
    req = {**GREEDY, "prompt": "Once upon a time", "max_tokens": 40}
    _, body, _ = await post(server.url, "/v1/completions", req)
    text = body["choices"][0]["text"]
    # A stop string that first occurs in the middle of the output.
    k = next((k for k in range(4, len(text) - 3) if text.find(text[k:k + 3]) == k and text[k:k + 3].strip()), None)
    if k is None:
        pytest.skip(f"random model output too repetitive for a stop test: {text!r}")
    stop = text[k:k + 3]
    _, cut, _ = await post(server.url, "/v1/completions", {**req, "stop": [stop, "\x00never"]})
    assert cut["choices"][0]["text"] == text[:k] and cut["choices"][0]["finish_reason"] == "stop"
    chunks = await stream(server.url, "/v1/completions", {**req, "stop": stop, "stream": True})
    assert joined(chunks) == text[:k] and finish_reasons(chunks) == ["stop"]
    _, inc, _ = await post(server.url, "/v1/completions", {**req, "stop": stop, "include_stop_str_in_output": True})
    assert inc["choices"][0]["text"] == text[:k + 3]


async def test_text_held_back_for_a_stop_string_is_released_at_the_end(server):
    req = {**GREEDY, "prompt": "Once upon a time", "max_tokens": 12}
    text = (await post(server.url, "/v1/completions", req))[1]["choices"][0]["text"]
    if not text:
        pytest.skip("random model produced no text")
    # The last character might begin this stop string, so it is held back until the request ends.
    req["stop"] = text[-1] + "\x00"
    _, body, _ = await post(server.url, "/v1/completions", req)
    assert body["choices"][0]["text"] == text and body["choices"][0]["finish_reason"] == "length"
    assert joined(await stream(server.url, "/v1/completions", {**req, "stream": True})) == text


async def test_seed_reproduces_sampled_output(server):
    req = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    outs = [(await post(server.url, "/v1/completions", {**req, "seed": s}))[1]["choices"][0]["text"]
            for s in (1234, 1234, 99)]
    assert outs[0] == outs[1] and outs[0] != outs[2]
    # n=2 with a seed: choice i is sampled with seed + i.
    _, two, _ = await post(server.url, "/v1/completions", {**req, "seed": 98, "n": 2})
    assert [c["text"] for c in sorted(two["choices"], key=lambda c: c["index"])][1] == outs[2]


async def test_n2_non_stream_and_stream(server):
    req = {"model": MODEL, "prompt": "Hello", "max_tokens": 6, "ignore_eos": True, "n": 2, "seed": 5}
    status, body, _ = await post(server.url, "/v1/completions", req)
    assert status == 200 and sorted(c["index"] for c in body["choices"]) == [0, 1]
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["prompt_tokens"] == len(tiny_tokenizer().encode("Hello"))
    chunks = await stream(server.url, "/v1/completions", {**req, "stream": True})
    for i in (0, 1):
        assert finish_reasons(chunks, i) == ["length"]
        assert joined(chunks, i) == next(c["text"] for c in body["choices"] if c["index"] == i)


async def test_token_id_prompts_and_multiple_prompts(server):
    ids = tiny_tokenizer().encode("Hello world")
    _, by_text, _ = await post(server.url, "/v1/completions", {**GREEDY, "prompt": "Hello world", "max_tokens": 5})
    _, by_ids, _ = await post(server.url, "/v1/completions", {**GREEDY, "prompt": ids, "max_tokens": 5})
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    status, many, _ = await post(server.url, "/v1/completions",
                                 {**GREEDY, "prompt": [ids, ids[:2]], "max_tokens": 5, "n": 2})
    assert status == 200 and sorted(c["index"] for c in many["choices"]) == [0, 1, 2, 3]
    assert many["usage"]["prompt_tokens"] == len(ids) + 2 and many["usage"]["completion_tokens"] == 20
    first = [c for c in many["choices"] if c["index"] in (0, 1)]
    assert all(c["text"] == by_text["choices"][0]["text"] for c in first)  # greedy: both samples agree


async def test_logprobs(server):
    _, body, _ = await post(server.url, "/v1/completions", {**GREEDY, "prompt": "Hi", "max_tokens": 4, "logprobs": 2})
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert all(v <= 0 for v in lp["token_logprobs"]) and all(len(t) <= 2 for t in lp["top_logprobs"])
    _, body, _ = await post(server.url, "/v1/chat/completions", {
        **GREEDY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True,
        "top_logprobs": 2})
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)


# ---- errors ----------------------------------------------------------------------------------------

ERRORS = [
    ("POST", "/v1/completions", b"{not json", 400, None),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 5}, 400, "temperature"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": [5] * 250, "max_tokens": 10}, 400, "prompt"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": [5] * 300, "max_tokens": 1}, 400, "prompt"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": [1, 10**6]}, 400, "prompt"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ("POST", "/v1/completions", {"model": "gpt-5", "prompt": "x"}, 404, "model"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "bot", "content": "x"}]}, 400, None),
    ("POST", "/v1/nope", {}, 404, None),
    ("GET", "/v1/completions", None, 405, None),
]


@pytest.mark.parametrize("method,path,body,want,param", ERRORS)
async def test_errors_have_openai_shape_and_server_survives(server, method, path, body, want, param):
    if method == "GET":
        status, raw, _ = await get(server.url, path)
        err = json.loads(raw)
    else:
        status, err, _ = await post(server.url, path, body)
    check_error(status, err, want, param)
    if want == 400 and param == "prompt" and "max_tokens" in (body or {}):
        assert err["error"]["message"].startswith("This model's maximum context length is 256 tokens")
    await good_request(server.url)


AUTH = {"Authorization": "Bearer sekrit"}


async def test_auth(limited):
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        status, err, h = await post(limited.url, "/v1/completions", {"prompt": "x"}, headers)
        check_error(status, err, 401)
        assert err["error"]["code"] == "invalid_api_key"
    status, raw, _ = await get(limited.url, "/v1/models")
    check_error(status, json.loads(raw), 401)
    for probe in ("/health", "/ready", "/metrics"):
        assert (await get(limited.url, probe))[0] == 200
    assert (await get(limited.url, "/v1/models", AUTH))[0] == 200
    await good_request(limited.url, AUTH)


async def test_body_too_large(limited):
    status, err, _ = await post(limited.url, "/v1/completions", {"prompt": "x" * 5000}, AUTH)
    check_error(status, err, 413)
    await good_request(limited.url, AUTH)


async def test_queue_full_gets_429(limited):
    long = {"model": MODEL, "prompt": "Hi", "max_tokens": 300, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        async with s.post(limited.url + "/v1/completions", json=long, headers=AUTH) as running:
            await running.content.readline()  # the first chunk: it runs (max_num_seqs=1)
            waiting = asyncio.ensure_future(post(limited.url, "/v1/completions", {**long, "stream": False,
                                                                                  "max_tokens": 2}, AUTH))
            for _ in range(100):  # until the second one is queued
                health = json.loads((await get(limited.url, "/health"))[1])
                if health["waiting"] == 1:
                    break
                await asyncio.sleep(0.02)
            status, err, headers = await post(limited.url, "/v1/completions", {"prompt": "x"}, AUTH)
            check_error(status, err, 429)
            assert headers["Retry-After"].isdigit()
        assert (await waiting)[0] == 200
    await good_request(limited.url, AUTH)


# ---- disconnects and drain ------------------------------------------------------------------------

async def wait_idle(url: str, timeout: float = 15) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = json.loads((await get(url, "/health"))[1])
        if h["running"] == h["waiting"] == h["open_streams"] == 0 and h["kv_free_blocks"] == h["kv_total_blocks"]:
            return h
        assert time.monotonic() < deadline, f"engine not idle: {h}"
        await asyncio.sleep(0.05)


async def test_disconnects_free_everything(server):
    req = {"model": MODEL, "prompt": "Stream me something long", "max_tokens": 32, "ignore_eos": True,
           "stream": True}

    async def one(i: int, session: aiohttp.ClientSession):
        resp = await session.post(server.url + "/v1/completions", json={**req, "seed": i})
        try:
            assert resp.status == 200
            if i % 2:  # drop after the first token
                while not (await resp.content.readline()).startswith(b"data: {"):
                    pass
                return None
            return parse_sse(await resp.read())
        finally:
            resp.close()  # closes the connection: the server sees the client leave

    async def mid_prefill(session):  # gone before any output
        with pytest.raises(asyncio.TimeoutError):
            async with session.post(server.url + "/v1/completions", json={**req, "stream": False, "prompt": [7] * 150},
                                    timeout=aiohttp.ClientTimeout(total=0.05)) as r:
                await r.read()

    async with aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=0)) as session:
        results = await asyncio.gather(*(one(i, session) for i in range(40)), mid_prefill(session))
    for chunks in results[0:40:2]:
        assert finish_reasons(chunks) == ["length"]
    await wait_idle(server.url)
    await good_request(server.url)


async def test_drain_on_sigterm(limited):
    """SIGTERM with one stream running and one waiting: both finish, newcomers get 503, exit code 0.

    Runs last among the `limited` tests: it shuts that server down.
    """
    req = {"model": MODEL, "prompt": "Go on", "max_tokens": 60, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(timeout=TIMEOUT, headers=AUTH) as s:
        running = await s.post(limited.url + "/v1/completions", json=req)
        first = await running.content.readline()
        assert first.startswith(b"data: {")
        waiting = asyncio.ensure_future(stream(limited.url, "/v1/completions", req, AUTH))
        for _ in range(100):
            if json.loads((await get(limited.url, "/health"))[1])["waiting"] == 1:
                break
            await asyncio.sleep(0.02)
        limited.proc.send_signal(signal.SIGTERM)
        for _ in range(100):
            if (await get(limited.url, "/ready"))[0] == 503:
                break
            await asyncio.sleep(0.02)
        status, err, _ = await post(limited.url, "/v1/completions", {"model": MODEL, "prompt": "x"}, AUTH)
        check_error(status, err, 503)
        assert finish_reasons(parse_sse(first + await running.read())) == ["length"]
        assert finish_reasons(await waiting) == ["length"]
    assert limited.proc.wait(30) == 0, limited.log()[-4000:]
    assert "Traceback" not in limited.log()


# ---- the real model --------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_smollm2_knows_paris(smol_server):  # `sluice serve --model default`, shared with the other slow tests
    question = [{"role": "user", "content": "What is the capital of France?"}]
    status, body, _ = await post(smol_server.url, "/v1/chat/completions", {
        "model": MODEL, "temperature": 0, "max_tokens": 40, "messages": question})
    assert status == 200 and "Paris" in body["choices"][0]["message"]["content"], body
    chunks = await stream(smol_server.url, "/v1/chat/completions", {
        "model": MODEL, "temperature": 0, "max_tokens": 40, "stream": True, "messages": question})
    assert joined(chunks) == body["choices"][0]["message"]["content"]
