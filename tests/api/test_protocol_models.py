"""The protocol from one source: the pydantic models validate, /openapi.json is generated from them, an error's
param is its path, and the replies formatting.py writes have the response models' shape."""

from __future__ import annotations

import re
import time
from collections import namedtuple

import pytest

from sluice.service.api.formatting import Choice, ResponseFormat
from sluice.service.api.openapi import openapi_spec
from sluice.service.api.protocol import RequestError, parse_chat, parse_completion
from sluice.service.api.protocol_responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    ErrorResponse,
)
from sluice.service.api.structured import _GUIDED
from tests.support import REPO

MSG = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def refusal(body: dict, chat: bool = True) -> RequestError:
    with pytest.raises(RequestError) as e:
        (parse_chat if chat else parse_completion)(body)
    assert e.value.status == 400 and e.value.to_dict()["error"]["param"] == e.value.param
    return e.value


@pytest.mark.parametrize("body,param,words", [
    ({"messages": [*MSG * 3, {"role": "user", "content": 5}]}, "messages[3].content", "string or a list"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters", "must be an object"),
    ({"messages": MSG, "stop": ["a", "b", 7]}, "stop[2]", "must be a string, got 7"),
    ({"messages": MSG, "temperature": True}, "temperature", "must be a number, got true"),
    ({"messages": MSG, "n": 2.0}, "n", "must be an integer, got 2.0"),
    ({"messages": MSG, "top_p": 0}, "top_p", "greater than 0"),
    ({"messages": MSG, "seed": 2**70}, "seed", "less than or equal to 9223372036854775807"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "'system', 'developer', 'user'"),
    ({"messages": MSG, "logit_bias": {"1": 5, "2": 300}}, "logit_bias", "between -100 and 100"),
    ({"messages": MSG, "logit_bias": {str(2**31): 5}}, "logit_bias", "token ids"),
    ({"messages": MSG, "tool_choice": {"type": "function", "function": {"name": "bad name"}}},
     "tool_choice.function.name", "must match"),
    ({"messages": MSG, "structured_outputs": {"json": 5}}, "structured_outputs.json", "schema object"),
    ({"messages": MSG, "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage", "boolean"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]},
     "messages[0].tool_calls[0].function.arguments", "JSON string"),
])
def test_the_param_is_the_path_and_the_message_names_it(body, param, words):
    e = refusal(body)
    assert e.param == param and e.message.startswith(f"'{param}' ") and words in e.message, e.message


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_no_nan_or_infinity(literal):
    assert refusal({"messages": MSG, "temperature": float(literal)}).param == "temperature"
    assert refusal({"prompt": "x", "logit_bias": {"5": float(literal)}}, chat=False).param == "logit_bias"


def test_extras_are_accepted_and_unknown_fields_ignored():
    r = parse_chat({"messages": MSG, "ignore_eos": True, "min_tokens": 3, "allowed_token_ids": [5, 5, 6],
                    "priority": -2, "cache_salt": "t", "guided_choice": ["a", "b"], "metadata": {"x": [1]},
                    "reasoning_effort": "low"})
    p = r.params
    assert (p.ignore_eos, p.min_tokens, p.allowed_token_ids, r.priority, p.cache_salt) == (True, 3, [5, 6], -2, "t")
    assert p.structured_output.kind == "choice"


def test_history_calls_come_out_in_one_form():
    r = parse_chat({"messages": [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"function": {"name": "g", "arguments": {"b": "é"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]})
    assert r.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "call_1", "type": "function", "function": {"name": "g", "arguments": '{"b": "é"}'}}]}
    assert r.messages[2] == {"role": "tool", "content": "1", "tool_call_id": "c1"}


@pytest.mark.parametrize("body,chat", [
    ({"prompt": [1] + [-1] * 300_000}, False),
    ({"prompt": "x", "allowed_token_ids": ["x"] * 300_000}, False),
    ({"prompt": "x", "logit_bias": {str(i): "x" for i in range(200_000)}}, False),
    ({"messages": [{"role": "user", "content": [{"type": "image"}] * 1000}] * 4000}, True),
])
def test_a_long_bad_list_costs_its_first_bad_item(body, chat):
    started = time.perf_counter()
    refusal(body, chat)
    assert time.perf_counter() - started < 0.5  # every error collected and converted took 2.4 s


# ---- /openapi.json ---------------------------------------------------------------------------------------

def test_the_document_declares_every_parameter_the_server_reads():
    """Drift the other way: a parameter read off the raw body (tools.py, structured.py) but not declared."""
    spec = openapi_spec("test")
    schemas = spec["components"]["schemas"]
    declared = set(schemas["CompletionRequest"]["properties"]) | set(schemas["ChatCompletionRequest"]["properties"])
    api = REPO / "service" / "api"
    read = {name for module in ("protocol.py", "tools.py", "structured.py")
            for name in re.findall(r'body\.get\("(\w+)"\)', (api / module).read_text())}
    assert {"tools", "response_format", "structured_outputs"} <= read
    assert (read | set(_GUIDED)) - declared == {"functions", "function_call"}  # legacy: refused by name
    assert spec["openapi"] == "3.1.0" and schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] == 4096
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        op = spec["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + model)
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


def test_schemathesis_loads_the_document():
    schemathesis = pytest.importorskip("schemathesis")
    schema = schemathesis.openapi.from_dict(openapi_spec("test"))
    assert {op.ok().path for op in schema.get_all_operations()} == {"/v1/completions", "/v1/chat/completions",
                                                                   "/v1/responses", "/v1/embeddings"}


# ---- the replies have the response models' shape ---------------------------------------------------------

Lp = namedtuple("Lp", "token_id logprob top")


@pytest.mark.parametrize("chat", [False, True])
def test_formatted_replies_validate_against_the_response_models(chat):
    from tests.support.tiny import tokenizer

    body = {"messages": MSG} if chat else {"prompt": "x"}
    req = (parse_chat if chat else parse_completion)({**body, "logprobs": True if chat else 2, "stream": True,
                                                       "stream_options": {"include_usage": True}})
    fmt = ResponseFormat(req, "id-1", "tiny", tokenizer())
    choice = Choice(0, 0, text=["Hel", "lo"], logprobs=[Lp(5, -0.5, [(5, -0.5), (6, -2.0)])], finish_reason="stop")
    calls = [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 0}}
    full, chunk = (ChatCompletion, ChatCompletionChunk) if chat else (Completion, Completion)
    full.model_validate(fmt.response([choice], usage), strict=True)
    chunk.model_validate(fmt.chunk(choice, "Hel", None, logprobs=choice.logprobs), strict=True)
    chunk.model_validate(fmt.chunk(choice, "", "length", role=chat), strict=True)
    chunk.model_validate(fmt.usage_chunk(usage), strict=True)
    if chat:
        choice.tool_calls = calls
        assert full.model_validate(fmt.response([choice], usage)).choices[0].message.tool_calls[0].id == "call_0"
        chunk.model_validate(fmt.chunk(choice, "", "tool_calls", tool_calls=[{"index": 0, **calls[0]}]))
    ErrorResponse.model_validate(RequestError("x", "stop[2]").to_dict(), strict=True)
