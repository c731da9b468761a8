"""Security: the API key guards every route but the probes, prompts and outputs stay out of the log at the
default level, and oversized bodies, headers and request lines are refused rather than hung on."""

from __future__ import annotations

import asyncio
import hmac
import json
import time

import aiohttp
import pytest

from sluice.service.api.anthropic_errors import speaks_anthropic
from sluice.service.api.api_server import create_app
from sluice.service.api.middlewares import OPEN_PATHS
from sluice.service.config import SluiceConfig
from tests.support.http import MODEL, TIMEOUT, check_error, good_request, parse_sse
from tests.support.server import Server, wait_idle

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
KEY = "s3cr3t-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SECRET_PROMPT = "zebra quokka marmalade 9731"  # distinctive: must never reach the log


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("logs"), "--api-key", KEY, "--num-kv-blocks", "128",
                 "--max-model-len", "256", "--max-request-body-bytes", "65536").wait_ready()
    yield srv
    assert srv.stop() == 0


def routes() -> list[tuple[str, str]]:
    """Every (method, path) the app serves, read from its router so a new endpoint cannot be missed."""
    app = create_app(SluiceConfig())
    out = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    return sorted(out)


async def call(url: str, method: str, path: str, headers=None, body=None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.request(method, url + path, json=body,
                                                                     headers=headers) as r:
        return r.status, await r.read()


BODIES = {"/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
          "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
          "/tokenize": {"model": MODEL, "prompt": "Hi"}, "/detokenize": {"model": MODEL, "tokens": [5, 6]},
          "/v1/embeddings": {"model": MODEL, "input": "Hi"},
          "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 2},
          **{path: {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
             for path in ("/v1/messages", "/v1/messages/count_tokens")}}
# Past the key, a server without --allow-runtime-lora answers the adapter routes with 404 runtime_lora_disabled
# (their handlers ran: an unknown path answers code not_found).
PAST_THE_KEY = {"/v1/load_lora_adapter": (404, "runtime_lora_disabled"),
               "/v1/unload_lora_adapter": (404, "runtime_lora_disabled"),
               # rerank and score on a generate-runner server (tests/api/test_rerank_api.py serves them)
               **{path: (404, "pooling_runner_disabled")
                  for path in ("/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score")}}


async def test_every_route_but_the_probes_needs_the_key(server):
    seen = routes()
    assert {p for _, p in seen} >= {"/openapi.json", "/v1/models", "/version", "/v1/completions",
                                    "/v1/chat/completions", *OPEN_PATHS}
    bad_keys = [None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"bearer {KEY}"},
                {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"},
                {"Authorization": "Bearer " + "é" * 20}, {"x-api-key": KEY[:-1]}, {"x-api-key": f"Bearer {KEY}"}]
    for method, path in seen:
        body = BODIES.get(path)
        if path in OPEN_PATHS:
            assert (await call(server.url, method, path))[0] == 200, path
            continue
        for headers in bad_keys:
            status, raw = await call(server.url, method, path, headers, body)
            if speaks_anthropic(path):  # Anthropic's error shape (tests/api/test_anthropic_api.py)
                assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error", raw
            else:
                check_error(status, json.loads(raw), 401)
        status, raw = await call(server.url, method, path, AUTH, body)
        if path in PAST_THE_KEY:
            assert (status, json.loads(raw)["error"]["code"]) == PAST_THE_KEY[path], (path, raw[:300])
        else:
            assert status == 200, (path, raw[:300])
    # Unknown paths answer 401 too without the key: nothing about the API can be probed anonymously.
    status, raw = await call(server.url, "GET", "/v1/secret-admin")
    check_error(status, json.loads(raw), 401)
    status, raw = await call(server.url, "GET", "/v1/secret-admin", AUTH)
    check_error(status, json.loads(raw), 404)


def test_key_is_compared_in_constant_time(monkeypatch):
    """The auth middleware compares with hmac.compare_digest (never ==, which stops at the first difference)."""
    import sluice.service.api.middlewares as api

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(api.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    config = SluiceConfig()
    config.server.api_key = KEY
    create_app(config)  # the middleware is built per app

    async def run():
        from aiohttp.test_utils import TestClient, TestServer

        client = TestClient(TestServer(create_app(config)))
        await client.start_server()
        try:
            assert (await client.get("/version", headers={"Authorization": "Bearer nope"})).status == 401
            assert (await client.get("/version", headers=AUTH)).status == 200
        finally:
            await client.close()

    asyncio.run(run())
    assert calls == [(b"Bearer nope", f"Bearer {KEY}".encode()), (f"Bearer {KEY}".encode(),) * 2]


async def test_prompts_and_outputs_stay_out_of_the_log(server):
    before = len(server.log())
    outputs = []
    for path, body in (("/v1/completions", {"prompt": SECRET_PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET_PROMPT}]})):
        req = {"model": MODEL, "max_tokens": 24, "ignore_eos": True, "temperature": 0, **body}
        status, raw = await call(server.url, "POST", path, AUTH, req)
        assert status == 200
        choice = json.loads(raw)["choices"][0]
        outputs.append(choice.get("text") or choice["message"]["content"])
        status, raw = await call(server.url, "POST", path, AUTH, {**req, "stream": True})
        assert status == 200 and parse_sse(raw)
        # A bad request that quotes client input must not echo it into the log either.
        status, raw = await call(server.url, "POST", path, AUTH, {**req, "stop": [SECRET_PROMPT] * 20})
        assert status == 400
    await wait_idle(server)
    log = server.log()[before:]
    assert "POST /v1/completions" in log  # the access log is there, just not the content
    for secret in (SECRET_PROMPT, "quokka", KEY, *[o for o in outputs if len(o.strip()) >= 8]):
        assert secret not in log, f"{secret!r} leaked into the log"


async def raw_exchange(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send raw bytes, return what comes back until the server closes or `timeout` passes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), timeout)
    except (ConnectionError, OSError):
        return b"<reset>"
    finally:
        writer.close()


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith((b"HTTP/1.0 ", b"HTTP/1.1 ")) else 0


HUGE = [
    ("a huge header value", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n"),
    ("a huge header name", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X" * 100_000 + b": 1\r\n\r\n"),
    ("a huge request line", b"GET /health?" + b"q" * 100_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("ten thousand headers", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(
        b"X-H%d: 1\r\n" % i for i in range(10_000)) + b"\r\n"),
    ("a huge Authorization header", b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b"k" * 100_000
     + b"\r\n\r\n"),
]


@pytest.mark.parametrize("what,data", HUGE, ids=[h[0] for h in HUGE])
async def test_oversized_headers_get_a_4xx_not_a_hang(server, what, data):
    started = time.monotonic()
    reply = await raw_exchange(server.port, data)
    assert 400 <= status_of(reply) < 500, (what, reply[:200])
    assert time.monotonic() - started < 5
    await good_request(server.url, AUTH)


async def test_oversized_bodies_get_413(server):
    big = {"model": MODEL, "prompt": "x" * 70_000}
    status, raw = await call(server.url, "POST", "/v1/completions", AUTH, big)
    check_error(status, json.loads(raw), 413)

    async def chunks():  # no Content-Length: the limit must hold for chunked bodies too
        for _ in range(100):
            yield b"x" * 1024

    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.post(server.url + "/v1/completions", data=chunks(),
                                                                   headers=AUTH) as r:
        check_error(r.status, await r.json(content_type=None), 413)
    await good_request(server.url, AUTH)
