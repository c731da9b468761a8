"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`): the translation to the chat request,
the reply builder and the ping keep-alive as pure functions, checked against the `anthropic` package's own models;
then, through one `sluice serve` on the tiny model (with an API key, and a fault on prompts holding token 0), the
real `anthropic` client: text streamed and not, a forced tool call and its tool_result turn, streamed tool input,
count_tokens against usage, Claude Code's billing header and the prefix cache, and the errors as the client's own
exception classes."""

from __future__ import annotations

import asyncio
import inspect
import json
import uuid

import pytest

from sluice.scheduling.outcomes import ErrorCode, FinishReason
from sluice.service.api.anthropic import PING, MessagesAPI, Pinged
from sluice.service.api.anthropic_errors import error_body
from sluice.service.api.anthropic_reply import MessageBuilder
from sluice.service.api.anthropic_request import parse_body, to_chat_request
from sluice.service.api.errors import ApiErrorCode, RequestError
from sluice.service.api.formatting import Choice
from sluice.service.api.reasoning import ReasoningParser
from sluice.service.api.tool_parsers import ToolOutput
from sluice.service.engine.outputs import EngineOutput
from tests.support.server import MODEL, Server, wait_idle
from tests.support.tools import long_tiny

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
from anthropic.lib.streaming._messages import accumulate_event  # noqa: E402
from anthropic.types import Message, RawMessageStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

EVENT = TypeAdapter(RawMessageStreamEvent)
KEY = "sk-test-" + uuid.uuid4().hex
ADD_SCHEMA = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": -5, "maximum": 5}},
    "required": ["a", "b"], "additionalProperties": False}
ADD = {"name": "add", "description": "Add two small integers.", "input_schema": ADD_SCHEMA}
BILLING = "x-anthropic-billing-header: cc_version=2.0.14; cc_entrypoint=cli; cch={};"
GREEDY = {"temperature": 0}  # the SDK's create() no longer declares the sampling fields: sent as extras
LONG_SYSTEM = "You are a helpful assistant. Answer in one short sentence, politely and clearly. " * 4


# ---- the translation -----------------------------------------------------------------------------------


def test_blocks_become_the_chat_request():
    m = parse_body({
        "model": "tiny", "max_tokens": 40, "temperature": 0.5, "top_p": 0.9, "top_k": 4, "stop_sequences": ["END"],
        "metadata": {"user_id": "u"}, "unknown": 1, "thinking": {"type": "disabled"},
        "system": [{"type": "text", "text": BILLING.format("abc")}, {"type": "text", "text": "Be brief.",
                                                                    "cache_control": {"type": "ephemeral"}}],
        "tools": [ADD], "tool_choice": {"type": "tool", "name": "add", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "sig"}, {"type": "redacted_thinking", "data": "x"},
                {"type": "text", "text": "Let me add."},
                {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}},
                {"type": "tool_use", "id": "toolu_2", "name": "add", "input": {"a": 1, "b": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "overflow"}]},
                {"type": "text", "text": "And now?"}]},
        ]})
    req = to_chat_request(m)
    calls = [{"id": f"toolu_{i}", "type": "function", "function": {"name": "add", "arguments": a}}
             for i, a in ((1, '{"a": 2, "b": 3}'), (2, '{"a": 1, "b": 1}'))]
    assert req.messages == [  # the billing header left out; text parts flattened by the chat path
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": calls},
        {"role": "tool", "content": "5", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: overflow", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "And now?"}]
    assert req.chat and req.max_tokens == 40 and req.params.temperature == 0.5 and req.params.top_k == 4
    assert req.params.top_p == 0.9 and req.params.stop == ["END"]
    assert req.tools.functions == [{"name": "add", "description": ADD["description"], "parameters": ADD_SCHEMA}]
    assert (req.tools.choice, req.tools.named, req.tools.parallel) == ("named", "add", False)
    assert req.template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize("choice,expected", [("auto", "auto"), ("any", "required"), ("none", "none")])
def test_tool_choice_maps_onto_chats(choice, expected):
    req = to_chat_request(parse_body({"model": "tiny", "max_tokens": 5, "tools": [ADD], "tool_choice": {
        "type": choice}, "messages": [{"role": "user", "content": "x"}]}))
    assert req.tools.choice == expected and req.tools.parallel


@pytest.mark.parametrize("body,param,words", [
    ({}, "max_tokens", "required"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     "messages[0].content[0].type", "'image' content blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "messages[0].content[0].content[0].type", "'image'"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "{"}]}, "messages[1]",
     "prefill"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "must be 'user' or 'assistant'"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]}, "tools[0].type",
     "server tool"),
    ({"tools": [{**ADD, "input_schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}]},
     "tools[0].input_schema", "tools[0].input_schema"),
    ({"tools": [ADD], "tool_choice": {"type": "tool", "name": "sub"}}, "tool_choice.name", "'sub'"),
    ({"stop_sequences": ["ok", ""]}, "stop_sequences[1]", "stop_sequences[1]"),
    ({"temperature": 3}, "temperature", "temperature"),
])
def test_bad_bodies_name_the_field(body, param, words):
    full = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], **body}
    if param == "max_tokens":
        del full["max_tokens"]
    with pytest.raises(RequestError) as info:
        to_chat_request(parse_body(full))
    e = info.value
    assert e.param == param and e.status == 400 and words in e.message, e.to_dict()
    assert ".function" not in e.message and "'stop'" not in e.message and "'stop[" not in e.message
    assert error_body(e) == {"type": "error", "error": {"type": "invalid_request_error", "message": e.message}}


@pytest.mark.parametrize("code,kind", [(ApiErrorCode.INVALID_REQUEST, "invalid_request_error"),
                                       (ApiErrorCode.INVALID_API_KEY, "authentication_error"),
                                       (ApiErrorCode.NOT_FOUND, "not_found_error"),
                                       (ApiErrorCode.REQUEST_TOO_LARGE, "request_too_large"),
                                       (ApiErrorCode.RATE_LIMIT_EXCEEDED, "rate_limit_error"),
                                       (ErrorCode.INTERNAL_ERROR, "api_error"),
                                       (ApiErrorCode.LOADING, "overloaded_error")])
def test_statuses_have_anthropics_error_types(code, kind):
    assert error_body(RequestError("m", code=code))["error"]["type"] == kind


# ---- the builder, against the anthropic package's models -------------------------------------------------


def _outputs(texts: list[str], reason: FinishReason, stop=None) -> list[EngineOutput]:
    last = len(texts) - 1
    return [EngineOutput("r", t, [1] * (i + 1), [], i == last, reason if i == last else None, 7, 3 * (i + 1), 2,
                         stop_reason=stop if i == last else None) for i, t in enumerate(texts)]


def _build(choice: Choice, texts: list[str], reason=FinishReason.STOP, stop=None) -> tuple[list[dict], dict]:
    builder = MessageBuilder("msg_1", "tiny", choice, 7)
    events = []
    for out in _outputs(texts, reason, stop):
        events += builder.feed(out)
    events = builder.start() + events + builder.finish()
    return events, builder.message()


def _check_stream(events: list[dict], final: dict) -> Message:
    """Every event is one of the SDK's; the SDK's own accumulator rebuilds the final message from them."""
    snapshot, more = None, {"json_bufs": {}} if "json_bufs" in inspect.signature(accumulate_event).parameters else {}
    for e in events:
        snapshot = accumulate_event(event=EVENT.validate_python(e), current_snapshot=snapshot, **more)
    message = Message.model_validate(final)
    assert snapshot.model_dump(exclude_none=True) == message.model_dump(exclude_none=True)
    return message


def test_a_reasoning_reply_streams_thinking_then_text():
    events, final = _build(Choice(0, 0, reasoning=ReasoningParser()),
                           ["<thi", "nk>Let me", " think</think>", "Paris", " it is"])
    _check_stream(events, final)
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop"]
    assert final["content"] == [{"type": "thinking", "thinking": "Let me think", "signature": ""},
                                {"type": "text", "text": "Paris it is"}]
    assert final["stop_reason"] == "end_turn" and final["stop_sequence"] is None
    assert final["usage"] == {"input_tokens": 5, "output_tokens": 15, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 2}


def test_stop_sequence_and_max_tokens():
    _, final = _build(Choice(0, 0), ["Hello"], FinishReason.STOP, stop="END")
    assert (final["stop_reason"], final["stop_sequence"]) == ("stop_sequence", "END")
    _, final = _build(Choice(0, 0), ["Hello"], FinishReason.STOP, stop=2)  # a stop token id: the turn ended
    assert (final["stop_reason"], final["stop_sequence"]) == ("end_turn", None)
    _, final = _build(Choice(0, 0), ["Hello"], FinishReason.LENGTH)
    assert (final["stop_reason"], final["stop_sequence"]) == ("max_tokens", None)
    events, final = _build(Choice(0, 0), [""])  # a reply always has a block
    _check_stream(events, final)
    assert final["content"] == [{"type": "text", "text": ""}]


def test_calls_stream_as_tool_use_blocks_and_a_cut_call_is_dropped():
    calls = '[{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "add", "arguments": {"a": 1'
    pieces = [calls[i:i + 5] for i in range(0, len(calls), 5)]  # as a token or so per output
    events, final = _build(Choice(0, 0, tools=ToolOutput("constrained")), pieces, FinishReason.LENGTH)
    Message.model_validate(final)
    for e in events:
        EVENT.validate_python(e)
    assert final["stop_reason"] == "max_tokens"
    [call] = final["content"]
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_") and call["input"] == {"a": 2, "b": 3}
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [s["type"] for s in starts] == ["tool_use", "tool_use"]  # the stream told of the cut one
    pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == call["input"]
    events, final = _build(Choice(0, 0, tools=ToolOutput("constrained")), [calls[:48], "}}]"])
    _check_stream(events, final)
    assert final["stop_reason"] == "tool_use" and [b["input"] for b in final["content"]] == [{"a": 2, "b": 3}]


@pytest.mark.anyio
async def test_a_quiet_stream_is_pinged_and_loses_no_output():
    async def slow():
        for out in _outputs(["Hel", "lo"], FinishReason.STOP):
            await asyncio.sleep(0.25)
            yield out

    pinged = Pinged(slow(), interval=0.1)
    got = [x async for x in pinged]
    pinged.close()
    assert [x.text for x in got if x is not PING] == ["Hel", "lo"]
    assert got[0] is PING and got.count(PING) >= 2

    builder = MessageBuilder("msg_1", "tiny", Choice(0, 0), 7)
    api = MessagesAPI(None, None, None, None)
    raw = b"".join([chunk async for chunk in api._events(Pinged(slow(), interval=0.1), builder)])
    events = _sse_events(raw)
    assert [e["type"] for e in events[:2]] == ["message_start", "ping"] and events[-1]["type"] == "message_stop"
    assert events[0]["message"]["usage"]["input_tokens"] == 7  # before any output: the prompt's length
    _check_stream([e for e in events if e["type"] != "ping"], builder.message())


def _sse_events(raw: bytes) -> list[dict]:
    """Strict: `event: <type>` / `data: <json with that type>` pairs separated by blank lines."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = []
    for chunk in text[:-2].split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), chunk
        events.append(json.loads(data[6:]))
        assert events[-1]["type"] == name[7:]
    return events


# ---- through the server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(model_dir, tmp_path_factory):
    """The tiny model with room for a tool prompt (the prompted path), an API key, and a step fault on any prompt
    holding token 0 (`<|endoftext|>`, which no other test's prompt holds)."""
    path = long_tiny(model_dir, tmp_path_factory.mktemp("tiny") / "model")
    srv = Server(path, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "512", "--api-key", KEY,
                 "--max-request-body-bytes", "200000", faults="token:0").wait_ready(timeout=600)
    yield srv
    srv.stop()


def client(srv, **kwargs) -> anthropic.AsyncAnthropic:
    kwargs.setdefault("api_key", KEY)
    return anthropic.AsyncAnthropic(base_url=srv.url, max_retries=0, **kwargs)


async def _raw(srv, body: dict, headers: dict | None = None) -> tuple[int, dict | list[dict]]:
    """The status and JSON of a response, or (streamed) its events with their `event:` names checked."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(srv.url + "/v1/messages", json=body,
                                headers=headers or {"x-api-key": KEY}) as resp:
            if not body.get("stream") or resp.status != 200:
                return resp.status, await resp.json()
            return resp.status, _sse_events(await resp.read())


def _same(a: Message, b: Message) -> None:
    """Two replies to one greedy request agree (ids aside; the second may read more of the prompt from cache)."""
    strip = [{k: v for k, v in block.to_dict().items() if k != "id"} for block in a.content]
    assert strip == [{k: v for k, v in block.to_dict().items() if k != "id"} for block in b.content]
    assert (a.stop_reason, a.stop_sequence, a.usage.output_tokens) == (b.stop_reason, b.stop_sequence,
                                                                      b.usage.output_tokens)
    assert (a.usage.input_tokens + a.usage.cache_read_input_tokens
            == b.usage.input_tokens + b.usage.cache_read_input_tokens)


@pytest.mark.anyio
async def test_text_streamed_and_not(tiny):
    kwargs = dict(model=MODEL, max_tokens=12, extra_body=GREEDY, system="Answer in one word.",
                  messages=[{"role": "user", "content": "What is the capital of France?"}])
    async with client(tiny) as c:
        reply = await c.messages.create(**kwargs)
        assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
        assert reply.model == MODEL and reply.stop_reason in ("end_turn", "max_tokens")
        [block] = reply.content
        assert block.type == "text" and reply.usage.output_tokens <= 12
        assert reply.usage.cache_creation_input_tokens == 0
        async with c.messages.stream(**kwargs) as stream:
            text = "".join([t async for t in stream.text_stream])
            streamed = await stream.get_final_message()
    _same(reply, streamed)
    assert text == block.text
    body = {k: v for k, v in kwargs.items() if k != "extra_body"}
    status, events = await _raw(tiny, {**body, **GREEDY, "stream": True})
    assert status == 200
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:-2] == ["content_block_start", *["content_block_delta"] * (len(kinds) - 5), "content_block_stop"]
    _check_stream(events, {**streamed.to_dict(), "id": events[0]["message"]["id"]})
    await wait_idle(tiny)


@pytest.mark.anyio
async def test_a_forced_tool_use_and_its_tool_result_turn(tiny):
    ask = [{"role": "user", "content": "What is 2 + 3?"}]
    kwargs = dict(model=MODEL, max_tokens=200, extra_body=GREEDY, tools=[ADD])
    async with client(tiny) as c:
        first = await c.messages.create(messages=ask, tool_choice={"type": "tool", "name": "add"}, **kwargs)
        [call] = first.content
        assert call.type == "tool_use" and call.name == "add" and call.id.startswith("toolu_")
        assert first.stop_reason == "tool_use"
        jsonschema.validate(call.input, ADD_SCHEMA)
        for result in (str(sum(call.input.values())), [{"type": "text", "text": "5"}]):
            history = ask + [{"role": "assistant", "content": [b.to_dict() for b in first.content]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                           "content": result, "is_error": isinstance(result, list)}]}]
            # auto right after the result: the prompted grammar only allows an answer (as the chat path does)
            second = await c.messages.create(messages=history, tool_choice={"type": "auto"},
                                             **{**kwargs, "max_tokens": 30})
            assert [b.type for b in second.content] == ["text"] and second.stop_reason in ("end_turn", "max_tokens")
    await wait_idle(tiny)


@pytest.mark.anyio
async def test_streamed_tool_input_arrives_in_pieces(tiny):
    kwargs = dict(model=MODEL, max_tokens=200, extra_body=GREEDY, tools=[ADD],
                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  messages=[{"role": "user", "content": "Add 4 and 1."}])
    async with client(tiny) as c:
        reply = await c.messages.create(**kwargs)
        pieces: dict[int, list[str]] = {}
        async with c.messages.stream(**kwargs) as stream:
            async for event in stream:
                if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                    pieces.setdefault(event.index, []).append(event.delta.partial_json)
            streamed = await stream.get_final_message()
    _same(reply, streamed)
    [call] = streamed.content
    assert call.type == "tool_use" and call.name == "add" and streamed.stop_reason == "tool_use"
    assert len(pieces[0]) > 1 and json.loads("".join(pieces[0])) == call.input
    jsonschema.validate(call.input, ADD_SCHEMA)
    await wait_idle(tiny)


@pytest.mark.anyio
async def test_count_tokens_is_the_replys_prompt(tiny):
    unique = uuid.uuid4().hex  # its first block is no other prompt's: nothing of it is cached yet
    bodies = [dict(messages=[{"role": "user", "content": f"{unique} What is 2 + 3?"}]),
              dict(system=LONG_SYSTEM, messages=[{"role": "user", "content": "Hi"}], tools=[ADD],
                   tool_choice={"type": "auto"})]
    async with client(tiny) as c:
        counts, replies = [], []
        for body in bodies:
            counts.append((await c.messages.count_tokens(model=MODEL, **body)).input_tokens)
            replies.append(await c.messages.create(model=MODEL, max_tokens=3, **body))
        beta = await c.beta.messages.count_tokens(model=MODEL, **bodies[1])  # ?beta=true
    usages = [r.usage for r in replies]
    assert usages[0].cache_read_input_tokens == 0 and counts[0] == usages[0].input_tokens  # nothing cached
    assert counts[1] == usages[1].input_tokens + usages[1].cache_read_input_tokens  # cached or not, the same prompt
    assert beta.input_tokens == counts[1] > counts[0]


@pytest.mark.anyio
async def test_the_billing_header_block_does_not_end_the_cached_prefix(tiny):
    system = uuid.uuid4().hex + LONG_SYSTEM  # its first block is no other prompt's
    ask = [{"role": "user", "content": "Hi"}]
    async with client(tiny) as c:
        plain = await c.messages.count_tokens(model=MODEL, system=system, messages=ask)
        usages = []
        for cch in ("a1b2c", "f9e8d"):
            blocks = [{"type": "text", "text": BILLING.format(cch)}, {"type": "text", "text": system}]
            count = await c.messages.count_tokens(model=MODEL, system=blocks, messages=ask)
            assert count.input_tokens == plain.input_tokens  # the header is not in the prompt
            reply = await c.beta.messages.create(model=MODEL, max_tokens=2, system=blocks, messages=ask,
                                                 extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"})
            usages.append(reply.usage)
    assert usages[0].cache_read_input_tokens == 0
    # all of the prompt's whole blocks but the last token's: read from the cache
    assert usages[1].cache_read_input_tokens >= plain.input_tokens - 16, usages
    assert usages[1].input_tokens + usages[1].cache_read_input_tokens == plain.input_tokens


@pytest.mark.anyio
async def test_errors_are_the_clients_own_exceptions(tiny):
    ask = [{"role": "user", "content": "Hi"}]
    async with client(tiny) as c:
        with pytest.raises(anthropic.BadRequestError) as info:
            await c.post("/v1/messages", body={"model": MODEL, "messages": ask}, cast_to=Message)
        assert info.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                              "message": "'max_tokens' is required"}}
        with pytest.raises(anthropic.BadRequestError) as info:
            await c.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
        assert "'image' content blocks are not supported" in info.value.body["error"]["message"]
        with pytest.raises(anthropic.NotFoundError) as info:
            await c.messages.create(model="claude-sonnet-4-5", max_tokens=5, messages=ask)
        assert info.value.body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.BadRequestError) as info:  # the chat path's context rule, in Anthropic's shape
            await c.messages.create(model=MODEL, max_tokens=5000, messages=ask)
        assert "maximum context length" in info.value.body["error"]["message"]
        with pytest.raises(getattr(anthropic, "RequestTooLargeError", anthropic.APIStatusError)) as info:
            await c.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x" * 300_000}])
        assert info.value.status_code == 413 and info.value.body["error"]["type"] == "request_too_large"
        for stream in (False, True):  # a step that fails before the first output: a real status, streamed or not
            with pytest.raises(anthropic.InternalServerError) as info:
                await c.messages.create(model=MODEL, max_tokens=5, stream=stream,
                                        messages=[{"role": "user", "content": "<|endoftext|> boom"}])
            assert info.value.status_code == 500 and info.value.body["error"]["type"] == "api_error"
            assert info.value.response.headers["x-should-retry"] == "false"
    await wait_idle(tiny)


@pytest.mark.anyio
async def test_x_api_key_and_bearer_and_the_open_root(tiny):
    import aiohttp

    ask = [{"role": "user", "content": "Hi"}]
    async with client(tiny, api_key=None, default_headers={"x-api-key": KEY}) as c:
        reply = await c.messages.create(model=MODEL, max_tokens=2, messages=ask)  # x-api-key alone
        assert reply.type == "message"
    async with client(tiny) as c:  # this client sends the key as a Bearer token
        assert (await c.messages.create(model=MODEL, max_tokens=2, messages=ask)).type == "message"
    async with client(tiny, api_key=None, default_headers={"x-api-key": "wrong"}) as c:
        with pytest.raises(anthropic.AuthenticationError) as info:
            await c.messages.create(model=MODEL, max_tokens=2, messages=ask)
        assert info.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(anthropic.AuthenticationError):
            await c.messages.count_tokens(model=MODEL, messages=ask)
    status, body = await _raw(tiny, {"model": MODEL, "max_tokens": 2, "messages": ask}, headers={"x-api-key": "no"})
    assert status == 401 and body["type"] == "error" and "x-api-key" in body["error"]["message"]
    async with aiohttp.ClientSession() as session:
        async with session.head(tiny.url + "/") as resp:  # Claude Code's probe: open, like /health
            assert resp.status == 200
        async with session.get(tiny.url + "/v1/models", headers={"x-api-key": KEY}) as resp:
            assert resp.status == 200
        async with session.get(tiny.url + "/v1/models", headers={"x-api-key": "no"}) as resp:
            assert resp.status == 401 and "error" in await resp.json()  # OpenAI's shape off /v1/messages
        async with session.post(tiny.url + "/v1/messages?beta=true", json={"model": MODEL, "max_tokens": 2,
                                                                            "messages": ask, "future_field": 1},
                                headers={"x-api-key": KEY, "anthropic-version": "2023-06-01",
                                         "anthropic-beta": "interleaved-thinking-2025-05-14"}) as resp:
            assert resp.status == 200 and (await resp.json())["type"] == "message"
