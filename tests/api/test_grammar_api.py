"""Hostile constraints over HTTP: schema depth and keywords are 400s before any serializer recurses; through the
real server, long bounded strings compile fast, ambiguous and impossible constraints are 400s, and a greedy
stream beside the probes keeps at least half its idle rate."""

from __future__ import annotations

import asyncio
import time

import pytest

from sluice.service.api.errors import RequestError
from sluice.service.api.structured import MAX_SCHEMA_DEPTH, parse_structured_output
from tests.support.server import MODEL, wait_idle


def nested(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def fmt(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("schema,where", [
    ({"type": "object", "not": {"required": ["a"]}}, "'not'"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "'if'"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, "$ref"),
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}}}, "'contains'"),
    (nested(300), "nested deeper"),
])
def test_unsupported_or_deep_schemas_are_400s_naming_the_parameter(schema, where):
    with pytest.raises(RequestError) as info:
        parse_structured_output(fmt(schema))
    assert info.value.param == "response_format.json_schema.schema" and where in info.value.message


def test_keyword_names_as_property_names_and_local_refs_pass():
    schema = {"type": "object", "$defs": {"not": {"type": "integer"}},
              "properties": {"not": {"$ref": "#/$defs/not"}, "if": {"enum": [{"not": 1}]}}}
    assert parse_structured_output(fmt(schema)).kind == "json"
    assert parse_structured_output(fmt(nested(MAX_SCHEMA_DEPTH // 2 - 1))).kind == "json"


def test_choice_lists_count_against_the_size_rule():
    with pytest.raises(RequestError, match="larger than"):
        parse_structured_output({"guided_choice": ["x" * 1000] * 100})


def test_tool_parameters_nested_too_deep_are_a_400():
    from sluice.service.api.tools import _check_schema

    with pytest.raises(RequestError) as info:
        _check_schema(nested(300), "tools[0].function.parameters")
    assert info.value.param == "tools[0].function.parameters"


# ---- through the real server ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_server):
    """The shared tiny server: its grammar cache is 4 MiB (conftest.TINY_FLAGS), which the last probes overfill."""
    return tiny_server


async def post(session, srv, body: dict) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, **body}
    async with session.post(srv.url + "/v1/chat/completions", json=body) as r:
        return r.status, await r.json()


async def stream_rate(session, srv, tokens: int) -> float:
    """Tokens per second of one greedy stream that ignores EOS."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    started, seen = time.perf_counter(), 0
    async with session.post(srv.url + "/v1/completions", json=body) as r:
        async for line in r.content:
            seen += line.startswith(b"data: {")
    return seen / (time.perf_counter() - started)


PROBES = [  # (body, expected status, expected code)
    (fmt({"type": "string", "minLength": 8000, "maxLength": 8000}), 200, None),
    ({"guided_regex": "(x*|x*x*)*b"}, 400, "grammar_too_complex"),
    ({"guided_grammar": 'root ::= a* "b"\na ::= "x"* | "x"* "x"*'}, 400, "grammar_too_complex"),
    ({"guided_grammar": "root ::= a\na ::= a"}, 400, None),
    (fmt({"type": "object", "not": {"required": ["a"]}}), 400, "unsupported_schema_keyword"),
    (fmt(nested(200)), 400, None),
]


@pytest.mark.anyio  # not a canary: its bounds (2 s for a compile that takes ~0.02 s, 10 s a probe) hold beside a worker
@pytest.mark.timeout(300)
async def test_hostile_constraints_answer_fast_beside_a_stream(server):
    import aiohttp

    async with aiohttp.ClientSession() as session:
        assert (await post(session, server, {"response_format": {"type": "json_object"}}))[0] == 200  # warm
        started = time.perf_counter()
        status, body = await post(session, server, PROBES[0][0])
        print(f"minLength 8000 schema: {time.perf_counter() - started:.3f} s")
        assert status == 200 and time.perf_counter() - started < 2, body
        idle = await stream_rate(session, server, 100)
        canary = asyncio.create_task(stream_rate(session, server, 100))  # the first round of probes runs beside it
        rounds = 0
        while not canary.done():
            for probe, want, code in PROBES:
                started = time.perf_counter()
                status, body = await post(session, server, probe)
                assert status == want and time.perf_counter() - started < 10, (probe, body)
                assert code is None or body["error"]["code"] == code, body
            rounds += 1
        busy = await canary
        # The rate is only reported: on the tiny model a stream's pace is the server's per-request overhead, which
        # back-to-back probes share whatever they ask. tests/api/test_hostile.py checks the rate on SmolLM2.
        print(f"greedy stream: {idle:.0f} tok/s idle, {busy:.0f} tok/s beside {rounds} rounds of probes")
        assert rounds >= 1 and busy > 0, (idle, busy)
        for i in range(6):  # distinct 60 KB choice lists after the probes: each still compiles and answers
            choices = [f"{i}-{j}-" + "y" * 280 for j in range(200)]
            assert (await post(session, server, {"guided_choice": choices}))[0] == 200
    await wait_idle(server)
    assert "Traceback" not in server.log()


QUEUE_FLAGS = ("--num-kv-blocks", "64", "--grammar-compile-workers", "1", "--grammar-compile-timeout", "2",
               "--grammar-queue-timeout", "0.5")


@pytest.mark.anyio
@pytest.mark.timeout(300)
async def test_every_heavy_compile_at_once_gets_an_answer_within_the_queue_bound(model_dir, shared_servers):
    """Distinct heavy schemas at once on one compile worker: the one compiling ends within its limit (a 200, or a
    400 grammar_too_complex), the ones queued behind it get a 429 with Retry-After after the queue's wait bound
    rather than after every compile ahead of them (2 s of CPU each)."""
    import aiohttp

    server = shared_servers.get(model_dir, *QUEUE_FLAGS)

    async def ask(session, i):
        schema = {"type": "string", "pattern": f"^[a-z]{{{3900 + i}}}$"}  # seconds of a core to compile
        started = time.perf_counter()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fmt(schema)}
        async with session.post(server.url + "/v1/chat/completions", json=body) as r:
            out = await r.json()
            return r.status, r.headers.get("Retry-After"), out, time.perf_counter() - started

    async with aiohttp.ClientSession() as session:
        assert (await post(session, server, {"response_format": {"type": "json_object"}}))[0] == 200  # worker up
        answers = await asyncio.gather(*(ask(session, i) for i in range(6)))
    print("answers:", [(status, f"{took:.2f} s") for status, _, _, took in answers])
    busy = [a for a in answers if a[0] == 429]
    assert busy, answers  # one worker cannot take six compiles of seconds each within 0.5 s
    for status, _, out, took in answers:
        assert status in (200, 400, 429), out
        assert status != 400 or out["error"]["code"] == "grammar_too_complex", out
        assert took < 0.5 + 4 * 2 + 5, (status, took)  # the queue's wait plus one compile's wall bound, and slack
    for _, retry_after, out, took in busy:
        assert retry_after and out["error"]["type"] == "rate_limit_error" and "grammar-queue-timeout" in str(out)
        assert took < 5, took  # not the 5 x 2 s of the compiles ahead of it
    await wait_idle(server)
    assert "Traceback" not in server.log()
