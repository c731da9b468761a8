"""The HTTP layer in-process over a fake engine: failure paths a real model cannot be made to hit on demand."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from sluice.service.api.api_server import create_app
from sluice.service.api.middlewares import STATE
from sluice.service.config import SluiceConfig
from sluice.service.engine.async_engine import AsyncEngine
from tests.support.fake_engine import FakeEngine
from tests.support.tiny import tokenizer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]
BODY = {"model": "fake", "prompt": "Hello", "max_tokens": 5}


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def client_for(fake: FakeEngine | None, **server) -> TestClient:
    config = SluiceConfig()
    for k, v in server.items():
        setattr(config.server, k, v)
    app = create_app(config)
    if fake is not None:
        engine = AsyncEngine(fake)
        engine.start()
        app[STATE].engine = engine
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


def assert_error(body: dict, status_code: str | None = None) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    if status_code:
        assert body["error"]["code"] == status_code
    return body["error"]


async def test_loading_state():
    client = await client_for(None)
    try:
        r = await client.get("/health")
        assert r.status == 200 and (await r.json())["status"] == "loading"
        r = await client.get("/ready")
        assert r.status == 503 and assert_error(await r.json(), "loading")
        r = await client.post("/v1/completions", json=BODY)
        assert r.status == 503 and assert_error(await r.json(), "loading")
    finally:
        await client.close()


async def test_internal_error_is_a_500_without_internals():
    fake = FakeEngine(tokenizer=tokenizer())
    fake.add_error = RuntimeError("secret internal detail")
    client = await client_for(fake)
    try:
        r = await client.post("/v1/completions", json=BODY, headers={"X-Request-Id": "rid-42"})
        body = await r.json()
        assert r.status == 500 and "secret" not in json.dumps(body) and "rid-42" in assert_error(body)["message"]
        assert r.headers["X-Request-Id"] == "rid-42"
        fake.add_error = None
        assert (await client.post("/v1/completions", json=BODY)).status == 200
    finally:
        await client.close()


async def test_generation_error_mid_stream_is_an_error_event():
    fake = FakeEngine(tokenizer=tokenizer())
    fake.error_at_token = 3
    client = await client_for(fake)
    try:
        r = await client.post("/v1/completions", json={**BODY, "stream": True})
        assert r.status == 200
        events = (await r.text()).split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        err = assert_error(json.loads(events[-3].removeprefix("data: ")), "internal_error")
        assert "CUDA" not in err["message"]
        assert [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-3]] == ["x", "x"]
        r = await client.post("/v1/completions", json=BODY)
        assert r.status == 500 and assert_error(await r.json(), "internal_error")
    finally:
        await client.close()


async def test_dead_engine_fails_health_and_requests():
    fake = FakeEngine(tokenizer=tokenizer(), fail_at_step=2)
    client = await client_for(fake)
    try:
        r = await client.post("/v1/completions", json=BODY)  # in flight when the loop dies
        assert r.status == 503 and assert_error(await r.json(), "engine_dead")
        assert r.headers["x-should-retry"] == "true"  # a restarted pod or another replica can serve it
        r = await client.get("/health")
        assert r.status == 503 and assert_error(await r.json(), "engine_dead")
        assert (await client.get("/ready")).status == 503
        r = await client.post("/v1/completions", json=BODY)
        assert r.status == 503 and assert_error(await r.json(), "engine_dead")
    finally:
        await client.close()


async def test_request_id_generated_when_missing_or_unsafe():
    client = await client_for(FakeEngine(tokenizer=tokenizer()))
    try:
        for headers in ({}, {"X-Request-Id": "bad id\twith spaces"}, {"X-Request-Id": "x" * 500}):
            r = await client.get("/v1/models", headers=headers)
            assert r.status == 200 and len(r.headers["X-Request-Id"]) == 32
    finally:
        await client.close()


async def test_draining_refuses_new_work():
    client = await client_for(FakeEngine(tokenizer=tokenizer()))
    try:
        client.server.app[STATE].draining = True
        r = await client.post("/v1/completions", json=BODY)
        assert r.status == 503 and assert_error(await r.json(), "draining")
        assert (await client.get("/ready")).status == 503
        assert (await client.get("/health")).status == 200
    finally:
        await client.close()
