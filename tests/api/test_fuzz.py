"""Hostile input: a hand-written list of malformed bodies, then schemathesis cases generated from our own
/openapi.json. Every answer is a 4xx in OpenAI's shape (or a well-formed 200), never a 5xx or a hang; the
engine is left idle, and a good request afterwards is answered."""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import pytest

from tests.support.http import MODEL, check_error, parse_sse
from tests.support.profiles import examples
from tests.support.server import Server, is_idle, wait_idle

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]
TIMEOUT = aiohttp.ClientTimeout(total=30)  # a case that takes longer is a hang
C, H = "/v1/completions", "/v1/chat/completions"
STATS = {"hand_written": 0, "generated": 0, "failures": []}  # reported when the module ends (fixture `report`)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # A short context keeps the generated-but-valid requests cheap.
    srv = Server(model_dir, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "64", "--max-model-len", "40",
                 "--max-num-seqs", "64").wait_ready()
    yield srv
    assert srv.stop() == 0
    assert "Traceback" not in srv.log()


def j(obj) -> bytes:
    return json.dumps(obj).encode()


def msgs(content="Hi", role="user") -> list[dict]:
    return [{"role": role, "content": content}]


P = {"model": MODEL, "prompt": "Hi"}
M = {"model": MODEL, "messages": msgs()}
# (name, path, raw body). Built by hand from the list; each must be refused with a 4xx.
CASES: list[tuple[str, str, bytes]] = [
    *[(f"invalid json {i}", path, raw) for path in (C, H) for i, raw in enumerate([
        b"{not json", b"", b"   ", b"{", b'{"prompt": "x",}', b"\xef\xbb\xbf{}", b"{'prompt': 'x'}"])],
    *[(f"not an object {i}", path, raw) for path in (C, H) for i, raw in enumerate([b"null", b"[]", b'"x"', b"42"])],
    ("missing prompt", C, j({"model": MODEL})),
    ("missing messages", H, j({"model": MODEL})),
    ("message without role", H, j({**M, "messages": [{"content": "Hi"}]})),
    ("message without content", H, j({**M, "messages": [{"role": "user"}]})),
    *[(f"wrong type {k}={v!r}", C, j({**P, k: v})) for k, v in [
        ("prompt", 123), ("prompt", {"a": 1}), ("prompt", [1, "a"]), ("prompt", [[]]), ("prompt", [["x"]]),
        ("prompt", [True, False]), ("prompt", [1.5]), ("max_tokens", "10"), ("max_tokens", 1.5),
        ("max_tokens", True), ("temperature", "hot"), ("stream", "yes"), ("stream", 1), ("n", "2"), ("stop", 5),
        ("stop", [1, 2]), ("stop", {"a": "b"}), ("logprobs", "x"), ("logprobs", True), ("seed", 1.5),
        ("priority", "high"), ("stream_options", "yes"), ("user", 5), ("model", 5), ("stop_token_ids", "1"),
        ("stop_token_ids", [1.5]), ("ignore_eos", "true"), ("top_k", 2.5), ("logit_bias", {"5": "x"}),
        ("allowed_token_ids", "1"), ("bad_words", [5]), ("skip_special_tokens", 1)]],
    *[(f"wrong type chat {k}={v!r}", H, j({**M, k: v})) for k, v in [
        ("messages", "Hi"), ("messages", [1]), ("messages", [[]]), ("messages", msgs(5)),
        ("messages", msgs([{"type": "image_url", "image_url": {"url": "http://x"}}])),
        ("messages", msgs([{"type": "text", "text": 5}])), ("messages", [{"role": "user", "content": "x", "name": 5}]),
        ("logprobs", 1), ("top_logprobs", 3), ("tools", [{"type": "function"}]),
        ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}),
        ("guided_regex", "(unclosed"), ("guided_grammar", "root ::= "), ("structured_outputs", {"json": 5})]],
    *[(f"out of range {k}={v!r}", C, j({**P, k: v})) for k, v in [
        ("max_tokens", -1), ("max_tokens", 0), ("max_tokens", 2**31 + 1), ("max_tokens", 10**30), ("n", 0),
        ("n", -1), ("n", 1000), ("best_of", 3), ("temperature", -1), ("temperature", 1e308), ("temperature", 2.5),
        ("top_p", 0), ("top_p", 2), ("top_k", -5), ("min_p", -0.1), ("logprobs", 100), ("seed", 2**70),
        ("seed", -(2**64)), ("priority", 2**40), ("min_tokens", -1), ("presence_penalty", 5),
        ("frequency_penalty", -2.5), ("repetition_penalty", 0), ("logit_bias", {"5": 500}),
        ("logit_bias", {"999999": 1}), ("allowed_token_ids", [10**6]), ("stop_token_ids", [-1]),
        ("stop_token_ids", [10**6]), ("stop_token_ids", list(range(300)))]],
    ("min_tokens above max_tokens", C, j({**P, "max_tokens": 2, "min_tokens": 5})),
    ("max_tokens beyond context", C, j({**P, "max_tokens": 10**6})),
    ("max_completion_tokens beyond context", H, j({**M, "max_completion_tokens": 41})),
    ("prompt beyond context", C, j({**P, "prompt": [42] * 41, "max_tokens": 1})),
    ("prompt text beyond context", C, j({**P, "prompt": "Hello " * 200})),
    ("chat beyond context", H, j({**M, "messages": msgs("Hello " * 200)})),
    ("too many prompts x n", C, j({**P, "prompt": ["x"] * 64, "n": 2})),
    ("too many prompts", C, j({**P, "prompt": ["x"] * 65})),
    *[(f"empty prompt {v!r}", C, j({**P, "prompt": v})) for v in ("", [], [""], [[]], None, ["x", ""])],
    ("empty messages", H, j({**M, "messages": []})),
    *[(f"unknown role {r!r}", H, j({**M, "messages": msgs(role=r)})) for r in ("bot", "", None, "System", 1, "admin")],
    ("invalid utf-8 in a string", C, b'{"model": "tiny", "prompt": "\xff\xfe"}'),
    ("invalid utf-8 sequence", C, b'{"model": "tiny", "prompt": "\xc3\x28"}'),
    ("overlong utf-8", H, b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}'),
    ("lone surrogate escape", C, b'{"model": "tiny", "prompt": "\\ud800"}'),
    ("lone low surrogate escape", H, b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
    ("deeply nested array", C, b"[" * 100_000 + b"]" * 100_000),
    ("deeply nested prompt", C, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("deeply nested message", H, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("oversized body", C, j({**P, "prompt": "x" * (2 << 20)})),
    ("oversized chat body", H, j({**M, "messages": msgs("x" * (2 << 20))})),
    ("thousands of stop strings", C, j({**P, "stop": [f"s{i}" for i in range(5000)]})),
    ("a very long stop string", C, j({**P, "stop": "x" * 100_000})),
    ("an empty stop string", H, j({**M, "stop": [""]})),
    *[(f"non-finite {lit}", path, b'{"model": "tiny", %s "temperature": %s}' % (body, lit))
      for lit in (b"NaN", b"Infinity", b"-Infinity", b"1e999", b"nan")
      for path, body in ((C, b'"prompt": "x",'), (H, b'"messages": [{"role": "user", "content": "x"}],'))],
    *[(f"token id {t!r}", C, j({**P, "prompt": [42, t]})) for t in (400, 10**6, -1, 2**31, 2**63, 2**64)],
    ("unknown model", C, j({**P, "model": "gpt-4"})),
    ("stream_options without stream", C, j({**P, "stream_options": {"include_usage": True}})),
    ("streamed and invalid", H, j({**M, "stream": True, "temperature": -3})),
]


async def send(url: str, path: str, raw: bytes) -> tuple[int, bytes]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.post(
            url + path, data=raw, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.read()


async def answered(url: str) -> None:
    """A good one-token request is answered correctly."""
    status, raw = await send(url, C, j({**P, "max_tokens": 1, "ignore_eos": True}))
    body = json.loads(raw)
    assert status == 200 and body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("name,path,raw", CASES, ids=[c[0] for c in CASES])
async def test_hand_written_case_is_a_clean_4xx(server, name, path, raw):
    STATS["hand_written"] += 1
    try:
        status, body = await send(server.url, path, raw)
        assert 400 <= status < 500, (status, body[:300])
        check_error(status, json.loads(body), status)
        h = await asyncio.to_thread(server.health)
        assert is_idle(h), h
        await answered(server.url)
    except BaseException as e:
        STATS["failures"].append(f"{name}: {e!r}"[:500])
        raise


VALID_ODDITIES = [
    ("NUL and control characters", C, {**P, "prompt": "a\x00b\x01\x1f\x7f"}),
    ("emoji, RTL and combining marks", H, {**M, "messages": msgs("😀\u202eمر e\u0301\ufeff"), "max_tokens": 4}),
    # Found by the generated cases: both used to return a token id past the vocabulary or crash the sampler.
    ("a subnormal temperature", C, {**P, "temperature": 1e-40, "max_tokens": 4}),
    ("a tiny temperature", H, {**M, "temperature": 1e-30, "max_tokens": 4}),
    ("a top_p below float32's range", C, {**P, "top_p": 1e-300, "max_tokens": 4}),
    ("a subnormal top_p", H, {**M, "top_p": 1e-45, "max_tokens": 4}),
    ("a stop string of 256 emoji", C, {**P, "stop": "😀" * 256}),
    ("16 stop strings", C, {**P, "stop": [chr(0x4e00 + i) for i in range(16)]}),
    ("the largest ids in the vocabulary", C, {**P, "prompt": [399, 398, 0, 1, 2]}),
    ("special tokens as text", H, {**M, "messages": msgs("<|im_end|><|im_start|>system\nhi")}),
    ("every optional field null", C, {**P, **dict.fromkeys(("max_tokens", "temperature", "top_p", "n", "stop",
                                                             "seed", "logprobs", "user", "stream"))}),
    ("deep but legal nesting in an unknown field", C, {**P, "metadata": json.loads("[" * 200 + "]" * 200)}),
    ("n=16, streamed, with logprobs", C, {**P, "n": 16, "max_tokens": 4, "logprobs": 20, "stream": True}),
]


@pytest.mark.parametrize("name,path,body", VALID_ODDITIES, ids=[c[0] for c in VALID_ODDITIES])
async def test_odd_but_valid_input_is_served(server, name, path, body):
    STATS["hand_written"] += 1
    try:
        status, raw = await send(server.url, path, j(body))
        assert status == 200, raw[:300]
        if body.get("stream"):
            assert parse_sse(raw)
        else:
            assert json.loads(raw)["choices"]
        await wait_idle(server)
    except BaseException as e:
        STATS["failures"].append(f"{name}: {e!r}"[:500])
        raise


# ---- generated from the OpenAPI description --------------------------------------------------------

def check_generated(status: int, raw: bytes, stream: bool) -> None:
    """4xx: OpenAI's error shape. 200: a complete response or SSE stream. Anything else is a failure."""
    assert status < 500, (status, raw[:300])
    if status >= 400:
        check_error(status, json.loads(raw), status)
    elif stream and raw.startswith(b"event: "):  # /v1/responses: typed events, the last one the response
        events = [json.loads(e.split("\ndata: ", 1)[1]) for e in raw.decode().split("\n\n") if e]
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    elif stream:
        events = parse_sse(raw)
        assert all("error" not in e for e in events), events[-1]
    else:
        body = json.loads(raw)
        if body.get("object") == "response":  # /v1/responses
            assert body["status"] in ("completed", "incomplete") and body["output"], body
            return
        if body.get("object") == "list":  # /v1/embeddings
            assert body["data"] and all(d["object"] == "embedding" for d in body["data"]), body
            return
        assert body["choices"] and all(c["finish_reason"] in ("stop", "length") for c in body["choices"]), body


def test_generated_cases(server):
    """schemathesis: positive and negative cases for both endpoints (4 x SLUICE_FUZZ_EXAMPLES), as raw JSON."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from sluice.service.api.openapi import openapi_spec

    schema = schemathesis.openapi.from_dict(openapi_spec("test"))
    n = examples(25, 250, "SLUICE_FUZZ_EXAMPLES")
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    strategy = st.one_of(*[op.ok().as_strategy(generation_mode=m) for op in schema.get_all_operations() for m in modes])
    loop = asyncio.new_event_loop()

    @settings(max_examples=n * 4, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=strategy, use_our_model=st.booleans())
    def run(case, use_our_model):
        body = case.body
        if use_our_model and isinstance(body, dict):  # half the valid ones get past the model check to the engine
            body = {**body, "model": MODEL}
        raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
        STATS["generated"] += 1
        started = time.monotonic()
        try:
            status, out = loop.run_until_complete(send(server.url, case.path, raw))
            check_generated(status, out, isinstance(body, dict) and body.get("stream") is True)
        except BaseException as e:
            STATS["failures"].append(f"{case.path} {raw[:200]!r}: {e!r}"[:500])
            raise
        assert time.monotonic() - started < 30

    try:
        run()
        loop.run_until_complete(wait_idle(server))
        loop.run_until_complete(answered(server.url))
    finally:
        loop.close()


@pytest.fixture(scope="module", autouse=True)
def report():
    """After the module's tests: the counts, printed and (with SLUICE_FUZZ_REPORT) written as JSON. The tests fail
    on their own; this only reports what they sent."""
    yield
    print(f"\nfuzz: {STATS['hand_written']} hand-written + {STATS['generated']} generated cases, "
          f"{len(STATS['failures'])} failures")
    if os.environ.get("SLUICE_FUZZ_REPORT"):
        with open(os.environ["SLUICE_FUZZ_REPORT"], "w") as f:
            json.dump(STATS, f, indent=2)
