"""The Responses API (`POST /v1/responses`): the translation to the chat request and the event builder as pure
functions, checked against the `openai` package's own models; then, through `sluice serve` on the tiny model,
the real `openai` client (streamed and not, instructions, a forced function call and its result's follow-up
turn, text.format json_schema), the 400s, and an `openai-agents` agent with one function tool."""

from __future__ import annotations

import json

import pytest

from sluice.scheduling.outcomes import FinishReason
from sluice.service.api.errors import RequestError
from sluice.service.api.formatting import Choice
from sluice.service.api.openapi import openapi_spec
from sluice.service.api.reasoning import ReasoningParser
from sluice.service.api.responses import ResponseBuilder, head
from sluice.service.api.responses_request import parse_body, renamed, to_chat_request
from sluice.service.api.tool_parsers import ToolOutput
from sluice.service.engine.outputs import EngineOutput
from tests.support.server import MODEL, Server, wait_idle
from tests.support.tools import long_tiny

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

EVENT = TypeAdapter(ResponseStreamEvent)
ADD_PARAMS = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": -5, "maximum": 5}},
    "required": ["a", "b"], "additionalProperties": False}
ADD = {"type": "function", "name": "add", "description": "Add two small integers.", "parameters": ADD_PARAMS,
       "strict": True}
FORECAST = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}


# ---- the translation -----------------------------------------------------------------------------------


def test_items_become_the_chat_request():
    m = parse_body({
        "model": "tiny", "instructions": "Be brief.", "max_output_tokens": 40, "temperature": 0.5, "top_k": 4,
        "tools": [ADD], "tool_choice": {"type": "function", "name": "add"}, "parallel_tool_calls": False,
        "store": True, "reasoning": {"effort": "low"}, "metadata": {"k": "v"}, "include": ["x"], "unknown": 1,
        "input": [
            {"role": "user", "content": "What is 2 + 3?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Let me add.", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
            {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": '{"a": 1, "b": 1}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "5"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "2"}]},
        ]})
    req = to_chat_request(m)
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": a}}
             for i, a in ((1, '{"a": 2, "b": 3}'), (2, '{"a": 1, "b": 1}'))]
    assert req.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": calls},
        {"role": "tool", "content": "5", "tool_call_id": "call_1"},
        {"role": "tool", "content": "2", "tool_call_id": "call_2"}]
    assert req.chat and req.max_tokens == 40 and req.params.temperature == 0.5 and req.params.top_k == 4
    assert req.tools.functions == [{"name": "add", "description": ADD["description"], "parameters": ADD_PARAMS}]
    assert (req.tools.choice, req.tools.named, req.tools.parallel) == ("named", "add", False)


def test_text_format_is_response_format_and_a_string_is_one_user_message():
    fmt = {"type": "json_schema", "name": "Forecast", "schema": FORECAST, "strict": True}
    req = to_chat_request(parse_body({"input": "Forecast?", "text": {"format": fmt}}))
    assert req.messages == [{"role": "user", "content": "Forecast?"}]
    so = req.params.structured_output
    assert (so.kind, json.loads(so.spec), so.param) == ("json", FORECAST, "response_format.json_schema.schema")
    assert to_chat_request(parse_body({"input": "x", "text": {"format": {"type": "json_object"}}})).params \
        .structured_output.kind == "json_object"
    assert to_chat_request(parse_body({"input": "x", "text": {"format": {"type": "text"}}})).params \
        .structured_output is None


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "5"}]}, "input[0].call_id"),
    ({"input": 5}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
])
def test_bad_bodies_name_the_parameter(body, param):
    with pytest.raises(RequestError) as info:
        to_chat_request(parse_body(body))
    assert info.value.param == param and info.value.status == 400, info.value.to_dict()


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "tools": [{**ADD, "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}]},
     "tools[0].parameters"),
    ({"input": "x", "tools": [ADD], "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice.name"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "f", "schema": {"type": "object", "not": {}}}}},
     "text.format.schema"),
    ({"input": []}, "input"),
])
def test_chat_path_errors_are_renamed(body, param):
    with pytest.raises(RequestError) as info:
        try:
            to_chat_request(parse_body(body))
        except RequestError as e:
            raise renamed(e) from None
    assert info.value.param == param, info.value.to_dict()
    assert "response_format" not in info.value.message and ".function" not in info.value.message


# ---- the builder, against the openai package's models --------------------------------------------------


def _outputs(texts: list[str], reason: FinishReason) -> list[EngineOutput]:
    return [EngineOutput("r", t, [1] * (i + 1), [], i == len(texts) - 1, reason if i == len(texts) - 1 else None,
                         7, 3 * (i + 1), 2) for i, t in enumerate(texts)]


def _build(choice: Choice, texts: list[str], reason=FinishReason.STOP, tools=None) -> tuple[list[dict], dict]:
    m = parse_body({"input": "x", **({"tools": [ADD], "tool_choice": "required"} if tools else {})})
    builder = ResponseBuilder(head(m, "resp_1", "tiny"), choice)
    events = builder.start()
    for out in _outputs(texts, reason):
        events += builder.feed(out)
    events += builder.finish()
    return events, builder.response()


def _check_stream(events: list[dict], final: dict) -> None:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENT.validate_python(e)
    Response.model_validate(final)
    assert events[-1]["response"] == final


def test_a_reasoning_reply_streams_its_items_in_order():
    choice = Choice(0, 0, reasoning=ReasoningParser())
    events, final = _build(choice, ["<thi", "nk>Let me", " think</think>", "Paris", " it is"])
    _check_stream(events, final)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.completed" and final["status"] == "completed"
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text",
                                                                          "text": "Let me think"}]
    assert message["content"][0]["text"] == "Paris it is" and message["status"] == "completed"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == "Paris it is" and Response.model_validate(final).output_text == "Paris it is"
    assert final["usage"]["input_tokens"] == 7 and final["usage"]["output_tokens"] == 15
    assert final["usage"]["total_tokens"] == 22 and final["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


def test_calls_stream_as_function_call_items_and_a_cut_call_is_dropped():
    calls = '[{"name": "add", "arguments": {"a": 2, "b": 3}}, {"name": "add", "arguments": {"a": 1'
    events, final = _build(Choice(0, 0, tools=ToolOutput("constrained")), [calls[:20], calls[20:50], calls[50:]],
                           FinishReason.LENGTH, tools=True)
    _check_stream(events, final)
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["type"] == "response.incomplete"
    [call] = final["output"]
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "add", {"a": 2, "b": 3})
    assert call["call_id"].startswith("call_") and call["status"] == "completed"
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [d["status"] for d in done] == ["completed", "incomplete"]  # the stream told of the cut one
    pieces = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                     and e["item_id"] == call["id"])
    assert pieces == call["arguments"]


def test_an_empty_reply_is_an_empty_message():
    events, final = _build(Choice(0, 0), [""])
    _check_stream(events, final)
    [message] = final["output"]
    assert message["content"][0]["text"] == "" and message["type"] == "message"


def test_the_request_is_echoed_at_most_once_and_reasoning_settings_are_bounded():
    big = "x" * 300_000
    tools = [{**ADD, "name": f"f{i}", "description": big} for i in range(3)]  # inactive: never in the prompt
    m = parse_body({"input": "x", "instructions": "Be brief.", "tools": tools, "tool_choice": "none", "user": big,
                    "reasoning": {"effort": "low", "summary": "auto", "anything": big}})
    builder = ResponseBuilder(head(m, "resp_1", "tiny"), Choice(0, 0))
    events = builder.start()
    for out in _outputs(["Hi"], FinishReason.STOP):
        events += builder.feed(out)
    events += builder.finish()
    _check_stream(events, builder.response())
    for opening in events[:2]:  # the snapshots before the reply: without the echoes a client makes large
        assert opening["response"]["tools"] == [] and opening["response"]["instructions"] is None
        assert opening["response"]["user"] is None
    final = events[-1]["response"]
    assert final["instructions"] == "Be brief." and [t["name"] for t in final["tools"]] == ["f0", "f1", "f2"]
    assert final["user"] == big and final["reasoning"] == {"effort": "low", "summary": "auto"}  # unknown keys dropped
    sent = sum(len(json.dumps(e)) for e in events)
    assert sent < 1.1 * 4 * len(big), sent  # once: tools and user, not three times
    with pytest.raises(RequestError) as info:
        parse_body({"input": "x", "reasoning": {"effort": big}})
    assert info.value.param == "reasoning.effort" and big not in info.value.message


def test_openapi_describes_the_route():
    spec = openapi_spec("test")
    op = spec["paths"]["/v1/responses"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
    assert {"input", "instructions", "tools", "text", "max_output_tokens", "previous_response_id"} <= set(
        spec["components"]["schemas"]["ResponsesRequest"]["properties"])


# ---- through the server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(model_dir, tmp_path_factory):
    """The tiny model with room for a tool prompt; its template knows nothing of tools (the prompted path)."""
    path = long_tiny(model_dir, tmp_path_factory.mktemp("tiny") / "model")
    srv = Server(path, tmp_path_factory.mktemp("logs"), "--num-kv-blocks", "512").wait_ready(timeout=600)
    yield srv
    srv.stop()


def client(srv) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


async def _raw(srv, body: dict) -> tuple[int, dict | list[dict]]:
    """The status and JSON of a response, or (streamed) its events with their `event:` names checked."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.post(srv.url + "/v1/responses", json=body) as resp:
            if not body.get("stream") or resp.status != 200:
                return resp.status, await resp.json()
            events, name = [], None
            async for line in resp.content:
                if line.startswith(b"event: "):
                    name = line[7:].strip().decode()
                elif line.startswith(b"data: "):
                    events.append(json.loads(line[6:]))
                    assert events[-1]["type"] == name
            return resp.status, events


@pytest.mark.anyio
async def test_the_openai_client_streamed_and_not(tiny):
    kwargs = dict(model=MODEL, instructions="Answer in one word.", input="What is the capital of France?",
                  max_output_tokens=12, temperature=0)
    async with client(tiny) as c:
        reply = await c.responses.create(**kwargs)
        assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == MODEL
        assert reply.status in ("completed", "incomplete") and reply.instructions == kwargs["instructions"]
        [message] = reply.output
        assert message.type == "message" and message.content[0].type == "output_text"
        assert reply.usage.output_tokens <= 12 and reply.usage.total_tokens == (
            reply.usage.input_tokens + reply.usage.output_tokens)
        if reply.status == "incomplete":
            assert reply.incomplete_details.reason == "max_output_tokens"
        text, final = "", None
        async for event in await c.responses.create(stream=True, **kwargs):
            if event.type == "response.output_text.delta":
                text += event.delta
            final = event
    assert final.type == f"response.{reply.status}" and text == reply.output_text == final.response.output_text
    status, raw = await _raw(tiny, {**kwargs, "stream": False})
    assert status == 200 and Response.model_validate(raw).output_text == reply.output_text
    await wait_idle(tiny)


@pytest.mark.anyio
async def test_raw_stream_events_match_the_spec(tiny):
    status, events = await _raw(tiny, {"model": MODEL, "input": "Hi", "max_output_tokens": 6, "stream": True})
    assert status == 200
    _check_stream(events, events[-1]["response"])


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["input item", "reasoning setting"])
async def test_a_900_kb_reasoning_input_is_not_echoed(tiny, where):
    import aiohttp

    big = "x" * 900_000
    if where == "input item":  # an earlier reply's thinking: left out of the prompt, and out of the reply
        body = {"input": [{"type": "reasoning", "id": "rs_1", "summary": [],
                           "content": [{"type": "reasoning_text", "text": big}]}, {"role": "user", "content": "Hi"}]}
    else:  # unknown keys of `reasoning` are dropped, not echoed
        body = {"input": "Hi", "reasoning": {"effort": "low", "note": big}}
    body.update(model=MODEL, max_output_tokens=4, temperature=0)
    async with aiohttp.ClientSession() as session:
        for stream in (True, False):
            async with session.post(tiny.url + "/v1/responses", json={**body, "stream": stream}) as resp:
                raw = await resp.read()
            assert resp.status == 200, raw[:300]
            assert len(raw) < 64 * 1024, (stream, len(raw))  # well under the input, let alone 2x or 3x it
            if not stream:
                assert json.loads(raw)["reasoning"] == ({"effort": None, "summary": None} if where == "input item"
                                                        else {"effort": "low", "summary": None})
    await wait_idle(tiny)


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_call_and_its_result_follow_up(tiny, stream):
    ask = [{"role": "user", "content": "What is 2 + 3?"}]
    async with client(tiny) as c:
        kwargs = dict(model=MODEL, tools=[ADD], tool_choice="required", parallel_tool_calls=False, temperature=0,
                      max_output_tokens=200)
        if stream:
            final = None
            async for event in await c.responses.create(input=ask, stream=True, **kwargs):
                final = event
            first = final.response
        else:
            first = await c.responses.create(input=ask, **kwargs)
        [call] = first.output
        assert call.type == "function_call" and call.name == "add" and first.status == "completed"
        args = json.loads(call.arguments)
        jsonschema.validate(args, ADD_PARAMS)
        history = ask + [call.model_dump(exclude_none=True),
                         {"type": "function_call_output", "call_id": call.call_id, "output": str(sum(args.values()))}]
        # auto right after the result: the prompted grammar only allows an answer (as the chat path does)
        second = await c.responses.create(input=history, **{**kwargs, "tool_choice": "auto", "max_output_tokens": 40})
    assert [item.type for item in second.output] == ["message"], second.output
    await wait_idle(tiny)


@pytest.mark.anyio
async def test_text_format_json_schema_yields_valid_json(tiny):
    fmt = {"type": "json_schema", "name": "Forecast", "schema": FORECAST, "strict": True}
    async with client(tiny) as c:
        for seed in range(2):
            reply = await c.responses.create(model=MODEL, input="Forecast for Paris?", text={"format": fmt},
                                             temperature=1.0, max_output_tokens=400, extra_body={"seed": seed})
            assert reply.status == "completed"
            jsonschema.validate(json.loads(reply.output_text), FORECAST)
            assert reply.text.format.type == "json_schema"


@pytest.mark.anyio
@pytest.mark.parametrize("body,param", [
    ({"input": "x", "previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "tools": [{**ADD, "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}]},
     "tools[0].parameters"),
    ({"input": "x", "max_output_tokens": 100000}, "input"),
])
async def test_bad_requests_are_400s_naming_the_parameter(tiny, body, param):
    async with client(tiny) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.responses.create(model=MODEL, **body)
    assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body


@pytest.mark.anyio
async def test_an_openai_agents_agent_with_a_function_tool(tiny):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen = []

    async def add(ctx, arguments: str) -> str:
        args = json.loads(arguments)
        seen.append(args)
        return str(args["a"] + args["b"])

    tool = agents.FunctionTool(name="add", description="Add two small integers.", params_json_schema=ADD_PARAMS,
                               on_invoke_tool=add, strict_json_schema=True)
    async with client(tiny) as c:
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=c)
        # the tool's result is the answer: a random model's free-text turn after it would have no bound
        agent = agents.Agent(name="adder", instructions="Use the add tool.", tools=[tool], model=model,
                             tool_use_behavior="stop_on_first_tool",
                             model_settings=agents.ModelSettings(tool_choice="required", max_tokens=200,
                                                                 parallel_tool_calls=False, temperature=0))
        for streamed in (False, True):
            if streamed:
                run = agents.Runner.run_streamed(agent, "What is 2 + 3?", max_turns=3)
                async for _ in run.stream_events():
                    pass
                result = run
            else:
                result = await agents.Runner.run(agent, "What is 2 + 3?", max_turns=3)
            kinds = [item.type for item in result.new_items]
            assert kinds == ["tool_call_item", "tool_call_output_item"], kinds
            assert result.final_output == str(seen[-1]["a"] + seen[-1]["b"])
    assert len(seen) == 2 and seen[0] == seen[1] and jsonschema.validate(seen[0], ADD_PARAMS) is None
    await wait_idle(tiny)
