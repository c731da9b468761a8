"""Random deep, wide and malformed bodies against the real server: no 5xx, no hang, no leaked block, alive after.

Each body starts from a valid completions or chat request and takes a few random mutations: a known parameter
(or a value nested inside one: a message's content, a tool's parameters, a schema) replaced with a random JSON
value (deep, wide, huge, odd numbers, wrong types), a key removed, or the bytes themselves cut or flipped. The
count is 2000 (20,000 under the deep hypothesis profile, `make test-deep`; SLUICE_FUZZ_BODIES overrides); the seed
is fixed, so a failure replays.
"""

from __future__ import annotations

import asyncio
import json
import os
import random

import aiohttp
import pytest

from tests.support.profiles import examples
from tests.support.server import Server, wait_idle

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]
COUNT = examples(2000, 20000, "SLUICE_FUZZ_BODIES")
SEED = int(os.environ.get("SLUICE_FUZZ_SEED", "21"))
CONCURRENCY = 8
MODEL = "tiny"
PARAMS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "best_of", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
          "include_stop_str_in_output", "response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "logit_bias", "allowed_token_ids", "bad_words", "skip_special_tokens", "stream", "stream_options",
          "priority", "user", "echo", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
          "suffix", "metadata"]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
BASES = [
    ("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4}),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 3, "stream": True,
                         "logprobs": 2, "stop": ["x"], "logit_bias": {"5": 3}}),
    ("/v1/completions", {"model": MODEL, "prompt": "Pick", "max_tokens": 6, "guided_choice": ["yes", "no"]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": "Be brief"},
                                                            {"role": "user", "content": [{"type": "text",
                                                                                          "text": "Hi"}]}],
                              "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 8,
                              "tools": [TOOL], "tool_choice": "auto"}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "JSON"}], "max_tokens": 8,
                              "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {
                                  "type": "object", "properties": {"a": {"type": "integer"}}}}}}),
]
ODD_NUMBERS = [0, -1, 1, 2**31, 2**63, 2**70, -(2**70), 1e308, -1e308, 0.5, 1e-320, 3.0, 17, 100_000]
ODD_STRINGS = ["", " ", "\u0000", "\ud7ff", "😀" * 50, "a" * 100_000, "<|im_end|>", "[[[[", '{"', "\\", "%s%n",
               "root ::= a", "(x*|x*x*)*b", "tiny", "function", "none", "required", "auto", "json_object", "text"]


def random_value(rng: random.Random, depth: int = 0):
    """A random JSON value; deep and wide ones are likely enough to matter."""
    roll = rng.random()
    if roll < 0.06:
        width = rng.choice([1, 2, 300])
        inner = random_value(rng, depth + 1) if depth < 2 else 1
        return [inner] * width if rng.random() < 0.5 else {f"k{i}": inner for i in range(width)}
    if roll < 0.12:  # deep
        node = rng.choice([[], {}, "x", 1])
        for _ in range(rng.choice([10, 100, 200, 300])):
            node = [node] if rng.random() < 0.5 else {"a": node}
        return node
    if roll < 0.35:
        return rng.choice(ODD_NUMBERS)
    if roll < 0.6:
        return rng.choice(ODD_STRINGS)
    if roll < 0.7:
        return rng.choice([True, False, None])
    if roll < 0.85 and depth < 3:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if depth < 3:
        return {rng.choice([*PARAMS, "type", "role", "content", "function", "name", "schema", "json_schema"]):
                random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return rng.choice(ODD_STRINGS)


def containers(value, path=()):
    """Every (container, key) inside a JSON value, so a mutation can reach nested parameters."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield value, k
            yield from containers(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield value, i
            yield from containers(v, (*path, i))


def mutate(rng: random.Random) -> tuple[str, bytes]:
    path, base = rng.choice(BASES)
    body = json.loads(json.dumps(base))
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.45:
            body[rng.choice(PARAMS)] = random_value(rng)
        elif roll < 0.8:
            spots = list(containers(body))
            parent, key = rng.choice(spots)
            parent[key] = random_value(rng)
        elif body:
            body.pop(rng.choice(list(body)))
    raw = json.dumps(body).encode()
    if rng.random() < 0.08:  # malformed bytes
        cut = rng.randrange(len(raw) + 1)
        raw = raw[:cut] if rng.random() < 0.5 else raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:]
    return path, raw


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "64", "--max-model-len", "64",
                 "--max-num-seqs", "32", "--max-queued-requests", "1024").wait_ready()
    yield srv
    assert srv.stop() == 0
    assert "Traceback" not in srv.log()


async def test_random_bodies_never_get_a_5xx_and_leak_nothing(server):
    rng = random.Random(SEED)
    cases = [mutate(rng) for _ in range(COUNT)]
    failures: list[str] = []
    statuses: dict[int, int] = {}
    queue: asyncio.Queue = asyncio.Queue()
    for i, case in enumerate(cases):
        queue.put_nowait((i, case))

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            i, (path, raw) = queue.get_nowait()
            try:
                async with session.post(server.url + path, data=raw,
                                        headers={"Content-Type": "application/json"}) as r:
                    data = await r.read()
                    status = r.status
            except asyncio.TimeoutError:
                failures.append(f"case {i}: no answer in time: {raw[:300]!r}")
                continue
            statuses[status] = statuses.get(status, 0) + 1
            if status >= 500:
                failures.append(f"case {i}: {status} {data[:300]!r} for {raw[:300]!r}")
            elif status >= 400:
                err = json.loads(data).get("error", {})
                if not isinstance(err.get("message"), str) or "Traceback" in err["message"]:
                    failures.append(f"case {i}: bad error shape {data[:300]!r}")
            elif b"text/event-stream" in r.headers.get("Content-Type", "").encode():
                if not data.endswith(b"data: [DONE]\n\n") or b'"internal_error"' in data:
                    failures.append(f"case {i}: broken stream {data[-300:]!r} for {raw[:300]!r}")

    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(CONCURRENCY)))
    print(f"\n{COUNT} fuzzed bodies, statuses {dict(sorted(statuses.items()))}")
    assert not failures, "\n".join(failures[:20])
    assert sum(n for s, n in statuses.items() if s == 200) > COUNT // 20, statuses  # not all refused: it fuzzes
    await wait_idle(server)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
            server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                                                  "ignore_eos": True}) as r:
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 3
