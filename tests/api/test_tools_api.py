"""Tool calling over HTTP with the official `openai` client (and LangChain where it installs): forced calls always
name a declared function with arguments that validate, streamed calls reassemble to the non-streamed ones,
tool history is accepted, bad tools are 400s naming the parameter, and SmolLM2 makes a full auto round trip."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.http import stream_chat
from tests.support.server import MODEL, Server, wait_idle
from tests.support.tools import NATIVE_TEMPLATE, long_tiny

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two small integers.",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny(model_dir, tmp_path_factory):
    """The tiny model, whose template knows nothing of tools: the prompted path."""
    path = long_tiny(model_dir, tmp_path_factory.mktemp("tiny") / "model")
    srv = Server(path, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "512").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tiny_native(model_dir, tmp_path_factory):
    """The tiny model with a Hermes-style template that renders tools: the native path."""
    path = long_tiny(model_dir, tmp_path_factory.mktemp("tiny") / "model", NATIVE_TEMPLATE)
    srv = Server(path, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "512").wait_ready()
    yield srv
    srv.stop()


def client(srv) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def check_calls(calls, allowed=tuple(SCHEMAS)) -> list[tuple[str, dict]]:
    """Every call names an allowed function and its arguments validate against that function's parameters."""
    assert calls, "no tool calls"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed, call
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


async def streamed(c, lenient: bool = False, **kwargs) -> tuple[str, list[tuple[str, dict | None]], str]:
    """(content, calls, finish_reason) of a streamed reply, each call (name, parsed arguments); `lenient`: a call
    the limit cut (arguments that do not parse) is (name, None)."""
    out = await stream_chat(c, **kwargs)
    assert all(e["id"] and e["id"].startswith("call_") for e in out.calls.values())

    def args(text):
        try:
            return json.loads(text)
        except ValueError:
            if not lenient:
                raise
            return None
    return out.content, [(e["name"], args(e["arguments"])) for _, e in sorted(out.calls.items())], out.finish


@pytest.mark.parametrize("tool_choice,parallel,allowed", [
    ("required", False, ("get_weather", "add")),
    ("required", True, ("get_weather", "add")),
    ({"type": "function", "function": {"name": "add"}}, True, ("add",)),
])
@pytest.mark.parametrize("path", ["prompted", "native"])
async def test_forced_calls_always_validate_on_the_tiny_model(request, path, tool_choice, parallel, allowed):
    srv = request.getfixturevalue("tiny" if path == "prompted" else "tiny_native")
    async with client(srv) as c:  # three seeds at once: one batch of six samples
        replies = await asyncio.gather(*(c.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel,
            temperature=1.0, seed=seed, n=2, max_tokens=1000) for seed in range(3)))  # room for 8 parallel calls
        for seed, reply in enumerate(replies):
            for choice in reply.choices:
                assert choice.finish_reason == "tool_calls", (seed, choice.message.content)
                assert choice.message.content is None
                calls = check_calls(choice.message.tool_calls, allowed)
                if not parallel or isinstance(tool_choice, dict):
                    assert len(calls) == 1
    await wait_idle(srv)


async def test_auto_on_a_template_without_tools_always_parses(tiny):
    async with client(tiny) as c:
        for seed in range(4):
            reply = await c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0,
                                                    seed=seed, max_tokens=120)
            choice = reply.choices[0]
            if choice.finish_reason == "tool_calls":
                check_calls(choice.message.tool_calls)
            else:  # a text answer, unwrapped from {"content": ...} (salvaged when max_tokens cut it)
                assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
                assert not choice.message.content.startswith('{"content"')


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
async def test_streamed_calls_reassemble_to_the_non_streamed_ones(tiny, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=1000)
    async with client(tiny) as c:
        reply = await c.chat.completions.create(**kwargs)
        content, calls, finish = await streamed(c, **kwargs)
    choice = reply.choices[0]
    assert finish == choice.finish_reason
    expected = [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls or []]
    assert calls == expected
    assert content == (choice.message.content or "")
    if tool_choice == "required":
        assert finish == "tool_calls" and calls


async def test_tool_history_and_tool_choice_none(tiny):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_abc", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "21 degrees, sunny"}]
    async with client(tiny) as c:
        for choice in ("auto", "none"):
            reply = await c.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice=choice,
                                                    max_tokens=8, temperature=0)
            assert reply.choices[0].message.role == "assistant"
        plain = await c.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
        assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nonsense"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice"),
])
async def test_bad_tools_are_400s_naming_the_parameter(tiny, extra, param):
    async with client(tiny) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **extra)
    assert info.value.body["param"] == param, info.value.body


# --- LangChain, for real ---------------------------------------------------------------------------------


def _langchain(srv):
    lc = pytest.importorskip("langchain_openai")
    return lc.ChatOpenAI(base_url=srv.url + "/v1", api_key="none", model=MODEL, temperature=0, max_tokens=200,
                         max_retries=0)


# Sync calls: LangChain caches its async HTTP client across tests, and each async test has its own event loop.
def test_langchain_bind_tools_and_tool_message(tiny):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from pydantic import BaseModel, Field

    class AddArgs(BaseModel):  # bounded: a random model could write digits until max_tokens
        a: int = Field(ge=0, le=99)
        b: int = Field(ge=0, le=99)

    @tool(args_schema=AddArgs)
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = _langchain(tiny)
    ai = llm.bind_tools([add], tool_choice="add").invoke([HumanMessage("What is 2 + 3?")])
    assert [c["name"] for c in ai.tool_calls] == ["add"], ai
    args = ai.tool_calls[0]["args"]
    assert set(args) == {"a", "b"} and all(isinstance(v, int) and 0 <= v <= 99 for v in args.values())
    result = ToolMessage(str(add.invoke(args)), tool_call_id=ai.tool_calls[0]["id"])
    final = llm.bind_tools([add]).invoke([HumanMessage("What is 2 + 3?"), ai, result])
    assert isinstance(final.content, str)


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_with_structured_output(tiny, method):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        """A weather forecast."""

        city: str = Field(max_length=10)
        unit: Literal["celsius", "fahrenheit"]
        high: int = Field(ge=-40, le=50)

    out = _langchain(tiny).with_structured_output(Forecast, method=method).invoke("Forecast for Paris?")
    assert isinstance(out, Forecast)


# What LangChain 1.x (langchain-openai 1.7) sends, captured from its client: bind_tools + a tool message, then
# with_structured_output by function_calling and by json_schema. Checked even where LangChain is not installed
# (max_tokens added: a random model's free text answer would otherwise run to the end of the context).
LANGCHAIN_BODIES = [
    {"model": "tiny", "stream": False, "messages": [
        {"content": "What is 2 + 3?", "role": "user"},
        {"content": None, "role": "assistant", "tool_calls": [
            {"type": "function", "id": "call_1", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
        {"content": "5", "role": "tool", "tool_call_id": "call_1"}],
     "temperature": 0.0, "tools": [{"type": "function", "function": {
         "name": "add", "description": "Add two integers.", "parameters": {
             "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
             "type": "object"}}}]},
    {"model": "tiny", "stream": False, "messages": [{"content": "Forecast for Paris?", "role": "user"}],
     "parallel_tool_calls": False, "temperature": 0.0,
     "tool_choice": {"type": "function", "function": {"name": "Forecast"}},
     "tools": [{"type": "function", "function": {
         "name": "Forecast", "description": "A weather forecast.", "parameters": {
         "properties": {"city": {"maxLength": 10, "type": "string"},
                        "unit": {"enum": ["celsius", "fahrenheit"], "type": "string"}},
         "required": ["city", "unit"], "type": "object"}}}]},
    {"model": "tiny", "stream": False, "messages": [{"content": "Forecast for Paris?", "role": "user"}],
     "response_format": {"type": "json_schema", "json_schema": {"schema": {
         "description": "A weather forecast.", "properties": {
             "city": {"maxLength": 10, "title": "City", "type": "string"},
             "unit": {"enum": ["celsius", "fahrenheit"], "title": "Unit", "type": "string"}},
         "required": ["city", "unit"], "title": "Forecast", "type": "object", "additionalProperties": False},
         "name": "Forecast", "strict": True}}, "temperature": 0.0},
]


@pytest.mark.parametrize("index", range(len(LANGCHAIN_BODIES)))
async def test_langchain_request_bodies_literally(tiny, index):
    import aiohttp

    body = {**LANGCHAIN_BODIES[index], "max_tokens": 64 if index == 0 else 400}
    async with aiohttp.ClientSession() as session:
        async with session.post(tiny.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            reply = await resp.json()
    message = reply["choices"][0]["message"]
    if index == 0:  # after the result: `add` was just answered, so the prompted grammar only allows an answer
        assert not message.get("tool_calls") and isinstance(message["content"], str)
    elif index == 1:
        [call] = message["tool_calls"]
        assert call["function"]["name"] == "Forecast" and reply["choices"][0]["finish_reason"] == "tool_calls"
        jsonschema.validate(json.loads(call["function"]["arguments"]), body["tools"][0]["function"]["parameters"])
    else:
        jsonschema.validate(json.loads(message["content"]), body["response_format"]["json_schema"]["schema"])


# --- the real model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(smol_server):
    return smol_server


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice,allowed", [
    ("required", ("get_weather", "add")),
    ({"type": "function", "function": {"name": "get_weather"}}, ("get_weather",))])
async def test_smollm2_forced_calls_validate(smol, tool_choice, allowed):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=200)
    async with client(smol) as c:  # sampled, greedy and greedy streamed at once: one batch
        *replies, (_, streamed_calls, finish) = await asyncio.gather(
            *(c.chat.completions.create(temperature=t, seed=3, **kwargs) for t in (0.8, 0.0)),
            streamed(c, temperature=0, **kwargs))
        for reply in replies:
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            calls = check_calls(choice.message.tool_calls, allowed)
        assert (streamed_calls, finish) == (calls, "tool_calls")  # greedy and streamed: the same calls
    await wait_idle(smol)


@pytest.mark.slow
async def test_smollm2_auto_round_trip(smol):
    messages = [{"role": "system", "content": "You are a weather assistant. Use the tools to look up the weather."},
                {"role": "user", "content": "What is the weather in Paris right now, in celsius?"}]
    async with client(smol) as c:
        first = await c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                                max_tokens=200)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        [(name, args)] = check_calls(choice.message.tool_calls)
        assert name == "get_weather"
        call = choice.message.tool_calls[0]
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "21 degrees celsius and sunny"}]
        final = await c.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                                max_tokens=200)
        answer = final.choices[0]
        assert answer.finish_reason == "stop" and answer.message.tool_calls is None, answer.message
        assert answer.message.content and not answer.message.content.lstrip().startswith("{")
        # streamed, the same turn gives the same text
        content, calls, finish = await streamed(c, model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                                max_tokens=200)
        assert (content, calls, finish) == (answer.message.content, [], "stop")
    await wait_idle(smol)


# --- max_tokens, streamed pieces, hostile output (issue 21) ---------------------------------------------------


async def raw_stream(srv, body: dict) -> list[dict]:
    """Every chunk of a streamed chat completion, as JSON."""
    import aiohttp

    chunks = []
    async with aiohttp.ClientSession() as session:
        async with session.post(srv.url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    assert all("error" not in c for c in chunks), chunks[-1]
    return chunks


@pytest.mark.parametrize("path", ["prompted", "native"])
async def test_calls_complete_before_max_tokens_come_back_as_tool_calls(request, path):
    srv = request.getfixturevalue("tiny" if path == "prompted" else "tiny_native")
    kwargs = dict(model=MODEL, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=1000)

    async def one(c, city: str) -> int:  # greedy: the cut reply is a prefix of the full one
        asked = {**kwargs, "messages": [{"role": "user", "content": f"What is the weather in {city}?"}]}
        full = await c.chat.completions.create(**asked)
        calls = full.choices[0].message.tool_calls
        limit = full.usage.completion_tokens - 6  # inside the last call (or its closing bracket)
        cut, chunks = await asyncio.gather(c.chat.completions.create(**{**asked, "max_tokens": limit}),
                                           raw_stream(srv, {**asked, "max_tokens": limit}))
        choice = cut.choices[0]
        assert choice.finish_reason == "length"
        assert choice.message.content in (None, "")  # never the grammar's text
        got = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or []]
        assert got == [(t.function.name, t.function.arguments) for t in calls[:len(got)]]
        assert len(got) >= len(calls) - 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert not "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
        pieces: dict[int, list] = {}
        for ch in chunks:
            for d in ch["choices"][0]["delta"].get("tool_calls") or []:
                pieces.setdefault(d["index"], []).append(d)
        assert len(pieces) in (len(got), len(got) + 1)  # and the start and pieces of a cut call
        for i, call in enumerate(choice.message.tool_calls or []):
            first, *rest = pieces[i]
            assert first["function"] == {"name": call.function.name, "arguments": ""} and first["id"]
            assert "".join(d["function"]["arguments"] for d in rest) == call.function.arguments
            assert len(rest) > 1  # the arguments came as they were generated
        return len(got)

    async with client(srv) as c:  # the four cities at once
        kept = sum(await asyncio.gather(*(one(c, city) for city in ("Paris", "Rome", "Oslo", "Lima"))))
    assert kept, "no reply had a call complete before the limit"
    await wait_idle(srv)


async def test_streamed_calls_arrive_name_first_and_the_client_reassembles_them(tiny):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=1000)
    chunks = await raw_stream(tiny, kwargs)
    deltas = [d for ch in chunks for d in ch["choices"][0]["delta"].get("tool_calls") or []]
    assert deltas and set(deltas[0]) == {"index", "id", "type", "function"} and deltas[0]["function"]["name"]
    assert sum(1 for d in deltas if d["index"] == 0) > 2
    async with client(tiny) as c:
        reply = await c.chat.completions.create(**kwargs)
        _, calls, finish = await streamed(c, **kwargs)  # the openai client's chunks, joined by index
        final = None
        async with c.beta.chat.completions.stream(**kwargs) as stream:  # the SDK's own accumulation
            final = await stream.get_final_completion()
    expected = [(t.function.name, json.loads(t.function.arguments)) for t in reply.choices[0].message.tool_calls]
    assert calls == expected and finish == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments))
            for t in final.choices[0].message.tool_calls] == expected


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
@pytest.mark.parametrize("path", ["prompted", "native"])
async def test_output_pushed_to_brackets_is_never_a_500(request, path, tool_choice):
    import aiohttp

    srv = request.getfixturevalue("tiny" if path == "prompted" else "tiny_native")
    async with aiohttp.ClientSession() as session:
        async with session.post(srv.url + "/tokenize", json={"prompt": "[[", "add_special_tokens": False}) as resp:
            ids = (await resp.json())["tokens"]
        body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 300,
                "logit_bias": {str(i): 100 for i in set(ids)}}
        async with session.post(srv.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            message = (await resp.json())["choices"][0]["message"]
    for call in message.get("tool_calls") or []:
        json.loads(call["function"]["arguments"])
    chunks = await raw_stream(srv, body)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    await wait_idle(srv)


@pytest.mark.slow
async def test_smollm2_required_cut_by_max_tokens_is_never_grammar_text(smol):
    """The issue's case (a forced weather call cut by max_tokens): no JSON in `content`, a stream names the call."""
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0)
    async with client(smol) as c:
        whole = await c.chat.completions.create(max_tokens=120, **kwargs)
        [complete] = check_calls(whole.choices[0].message.tool_calls, ("get_weather",))
        limit = whole.usage.completion_tokens - 5  # inside the arguments
        reply, (content, calls, finish) = await asyncio.gather(c.chat.completions.create(max_tokens=limit, **kwargs),
                                                               streamed(c, lenient=True, max_tokens=limit, **kwargs))
    choice = reply.choices[0]
    assert choice.finish_reason == finish == "length"
    assert not choice.message.content and not content and choice.message.tool_calls is None
    assert calls == [("get_weather", None)]  # its start and argument pieces went out; they do not parse
    await wait_idle(smol)
