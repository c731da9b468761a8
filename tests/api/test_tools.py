"""Tool calling, without a server: request validation, the reply grammar, prompt rendering on both paths, and
every output parser on literal model replies, streamed and not."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from sluice.service.api.errors import RequestError
from sluice.service.api.protocol import parse_chat
from sluice.service.api.tool_parsers import ToolOutput, parse, stream_deltas
from sluice.service.api.tools import (
    ToolPlan,
    detect_parser,
    just_answered,
    plan_tools,
    reply_schema,
    template_args,
)
from tests.support.tools import NATIVE_TEMPLATE, reassemble, stream_pieces

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["tz"]}}}
MSG = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**body):
    return parse_chat({"messages": MSG, **body})


# ---- request validation -------------------------------------------------------------------------------

def test_defaults_and_choices():
    req = chat(tools=[WEATHER, TIME])
    assert (req.tools.choice, req.tools.parallel, req.tools.active) == ("auto", True, True)
    assert [f["name"] for f in req.tools.functions] == ["get_weather", "get_time"]
    named = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                 parallel_tool_calls=False)
    assert (named.tools.choice, named.tools.named, named.tools.parallel) == ("named", "get_time", False)
    assert chat(tools=[WEATHER], tool_choice="none").tools.active is False
    assert chat(tools=[], tool_choice="none").tools is None
    # no parameters: any object with no declared properties
    assert chat(tools=[{"type": "function", "function": {"name": "ping"}}]).tools.functions[0]["parameters"] == {
        "type": "object", "properties": {}}


BAD = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [5]}, "tools[0]"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x", "description": 5}}]}, "tools[0].function.description"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "x", "parameters": {"type": "nonsense"}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "x", "parameters": [1]}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"messages": [{"role": "tool", "content": "20C"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "a", "function": "f"}]}]},
     "messages[0].tool_calls[0].function"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": 5}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_tool_requests_name_the_parameter(body, param):
    with pytest.raises(RequestError) as e:
        parse_chat({"messages": MSG, **body})
    assert e.value.status == 400 and e.value.param == param, e.value


def test_tools_on_completions_are_refused():
    from sluice.service.api.protocol import parse_completion

    with pytest.raises(RequestError) as e:
        parse_completion({"prompt": "x", "tools": [WEATHER]})
    assert e.value.param == "tools"


# ---- the reply grammar --------------------------------------------------------------------------------

def _compiler():
    xgr = pytest.importorskip("xgrammar")
    from tests.support.tiny import tokenizer

    tok = tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    return xgr, xgr.GrammarCompiler(info, max_threads=1)


def _accepts(xgr, compiled, value) -> bool:
    m = xgr.GrammarMatcher(compiled)
    return m.accept_string(json.dumps(value))


CALL = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
OTHER = {"name": "get_time", "arguments": {"tz": 2}}


@pytest.mark.parametrize("choice,parallel,good,bad", [
    ("required", True, [[CALL], [CALL, OTHER]], [CALL, {"content": "hi"}, [{**OTHER, "arguments": {"tz": 99}}]]),
    ("required", False, [CALL, OTHER], [[CALL], {"content": "hi"}, {"name": "nope", "arguments": {}}]),
    ({"type": "function", "function": {"name": "get_time"}}, True, [OTHER], [CALL, [OTHER]]),
    ("auto", True, [CALL, [CALL, OTHER], {"content": "It is sunny."}],
     [{"content": 5}, {**CALL, "arguments": {"city": "Paris"}}, {"answer": "x"}]),
    ("auto", False, [CALL, {"content": "x"}], [[CALL]]),
])
def test_reply_schema_allows_exactly_the_declared_calls(choice, parallel, good, bad):
    xgr, compiler = _compiler()
    spec = chat(tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=parallel).tools
    compiled = compiler.compile_json_schema(json.dumps(reply_schema(spec, native=False)), any_whitespace=False)
    for value in good:
        assert _accepts(xgr, compiled, value), value
    for value in bad:
        assert not _accepts(xgr, compiled, value), value


def test_a_prompted_auto_reply_after_results_may_not_repeat_the_answered_functions():
    xgr, compiler = _compiler()
    req = parse_chat({"messages": HISTORY, "tools": [WEATHER, TIME]})
    assert just_answered(req.messages) == {"get_weather"}
    plan_tools(req, SimpleNamespace(chat_template="{{ m.content }}"))
    compiled = compiler.compile_json_schema(req.params.structured_output.spec, any_whitespace=False)
    assert _accepts(xgr, compiled, OTHER) and _accepts(xgr, compiled, {"content": "21C in Paris"})
    assert not _accepts(xgr, compiled, CALL)
    only = parse_chat({"messages": HISTORY, "tools": [WEATHER]})
    plan_tools(only, SimpleNamespace(chat_template="{{ m.content }}"))
    assert json.loads(only.params.structured_output.spec)["properties"] == {"content": {"type": "string"}}
    forced = parse_chat({"messages": HISTORY, "tools": [WEATHER], "tool_choice": "required"})
    plan_tools(forced, SimpleNamespace(chat_template="{{ m.content }}"))  # forced: the client's word wins
    compiled = compiler.compile_json_schema(forced.params.structured_output.spec, any_whitespace=False)
    assert _accepts(xgr, compiled, [CALL])
    assert just_answered(HISTORY[:2]) == set() and just_answered(HISTORY[:3]) == {"get_weather"}


def test_plan_per_template_and_choice():
    plain = SimpleNamespace(chat_template="{{ m['content'] }}")
    hermes = SimpleNamespace(chat_template="{% if tools %}<tool_call>{% endif %}")
    auto = chat(tools=[WEATHER])
    plan = plan_tools(auto, plain)
    assert (plan.native, plan.parser) == (False, "constrained")
    assert auto.params.structured_output.param == "tools"
    auto = chat(tools=[WEATHER])
    plan = plan_tools(auto, hermes)
    assert (plan.native, plan.parser, auto.params.structured_output) == (True, "hermes", None)
    assert plan_tools(chat(tools=[WEATHER]), hermes, "mistral").parser == "mistral"
    forced = chat(tools=[WEATHER], tool_choice="required")
    assert plan_tools(forced, hermes).parser == "constrained" and forced.params.structured_output is not None
    none = chat(tools=[WEATHER], tool_choice="none")
    assert plan_tools(none, plain).active is False and none.params.structured_output is None
    assert detect_parser("[TOOL_CALLS]") == "mistral" and detect_parser("<|python_tag|>") == "llama3_json"
    assert detect_parser("{{ tools }}") == "json"


# ---- rendering the conversation -----------------------------------------------------------------------

HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "25C"},
]


def test_prompted_path_renders_tools_and_history_as_text():
    req = parse_chat({"messages": HISTORY, "tools": [WEATHER]})
    plan = ToolPlan(req.tools, native=False, parser="constrained")
    messages, kwargs = template_args(plan, req.messages)
    assert kwargs == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert "get_weather" in messages[0]["content"] and '{"content":' in messages[0]["content"]
    calls = json.loads(messages[2]["content"])
    assert calls == [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                     {"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}]
    assert messages[3]["content"] == ("Tool result of get_weather (call_1): 21C\n"
                                      "Tool result of get_weather (call_2): 25C")
    # the tiny model's template (no tools) renders it
    from tests.support.tiny import tokenizer

    text = tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "Tool result of get_weather (call_2): 25C" in text


def test_history_without_tools_still_renders_as_text():
    req = parse_chat({"messages": HISTORY})
    messages, _ = template_args(ToolPlan(None, native=False, parser="none"), req.messages)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]



def test_native_path_passes_tools_and_calls_as_objects():
    from tests.support.tiny import tokenizer

    tok = tokenizer()
    original, tok.chat_template = tok.chat_template, NATIVE_TEMPLATE
    try:
        req = parse_chat({"messages": HISTORY, "tools": [WEATHER]})
        plan = plan_tools(req, tok)
        assert (plan.native, plan.parser) == (True, "hermes")
        messages, kwargs = template_args(plan, req.messages)
        assert kwargs["tools"][0]["function"]["name"] == "get_weather"
        assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
        assert "# Tools" in text and text.endswith("<|im_start|>assistant\n")
    finally:
        tok.chat_template = original


# ---- output parsers ----------------------------------------------------------------------------------

PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
ROME = ("get_weather", {"city": "Rome", "unit": "celsius"})
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>', "Let me check.", [PARIS]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>\n'
               '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}</tool_call>',
     "", [PARIS, ROME]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}', "", [PARIS]),
    ("hermes", "No tools needed: it is 4.", "No tools needed: it is 4.", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}', "", [PARIS, ROME]),
    ("llama3_json", "Paris is sunny {mostly}.", "Paris is sunny {mostly}.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}]', "", [PARIS, ROME]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', "", [PARIS]),
    ("mistral", "Bonjour", "Bonjour", []),
    ("json", 'Sure: {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}', "Sure:", [PARIS]),
    ("json", '{"tool_calls": [{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\", \\"unit\\": '
             '\\"celsius\\"}"}]}', "", [ROME]),
    ("json", 'A set {1, 2} and {"a": 1}', 'A set {1, 2} and {"a": 1}', []),
    ("constrained", '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}', "", [PARIS]),
    ("constrained", '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                    '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}]', "", [PARIS, ROME]),
    ("constrained", '{"content": "It is \\"sunny\\"\\nin Paris."}', 'It is "sunny"\nin Paris.', []),
    ("constrained", '{"content": "cut off \\u00e9t\\', "cut off ét", []),
]


def _simple(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parsers(parser, text, content, calls):
    parsed = parse(text, parser)
    assert parsed.content == content
    assert _simple(parsed.calls) == calls
    for c in parsed.calls:
        assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) > 10



@pytest.mark.parametrize("parser,text,content,calls", CASES)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_pieces_reassemble_to_the_same_reply(parser, text, content, calls, piece):
    chunks = stream_pieces(parser, [text[i:i + piece] for i in range(0, len(text), piece)])
    streamed = "".join(text for text, _, _, _ in chunks)
    assert streamed.strip() == content
    got = reassemble(chunks)
    assert _simple(got) == calls
    whole = parse(text, parser).calls  # the arguments text itself is the finished reply's
    assert [c["function"]["arguments"] for c in got] == [c["function"]["arguments"] for c in whole]
    assert chunks[-1][2] == ("tool_calls" if calls else "stop")
    if piece == 1 and calls and '"tool_calls"' not in text:  # name first, then arguments as they are generated
        assert all(c["pieces"] > 1 for c in got)
    if parser in ("hermes", "mistral") and calls:  # nothing of the markup leaks into the content
        assert "<tool_call>" not in streamed and "[TOOL_CALLS]" not in streamed


@pytest.mark.parametrize("piece", [1, 2, 5])
def test_a_constrained_text_answer_streams_as_it_is_decoded(piece):
    answer = 'Caf\u00e9 \U0001f600 "quoted"\n\\ tab\t end'
    text = json.dumps({"content": answer})  # \u escapes, a surrogate pair, quotes, backslashes
    assert "\\ud83d\\ude00" in text
    tools = ToolOutput("constrained")
    outs = [SimpleNamespace(text=text[i:i + piece], logprobs=[], finished=False, finish_reason=None)
            for i in range(0, len(text), piece)]
    outs[-1].finished, outs[-1].finish_reason = True, "stop"
    pieces = [[c[0] for c in stream_deltas(tools, out) if c[0]] for out in outs]
    assert "".join(p for ps in pieces for p in ps) == answer
    assert sum(len(ps) for ps in pieces[: len(pieces) // 2]) > 0  # the first half streamed before the end
    assert parse(text, "constrained").content == answer


def test_tool_schemas_are_meta_checked_fast_and_never_fetch_an_unknown_schema_url():
    import time

    from sluice.service.api.errors import RequestError
    from sluice.service.api.tools import _check_schema

    props = {f"p{i}": {"type": "string", "description": "d" * 30} for i in range(100)}
    started = time.perf_counter()
    for _ in range(128):
        _check_schema({"type": "object", "properties": props}, "tools[0].function.parameters")
    assert time.perf_counter() - started < 1.0  # the pure-Python validator took ~2 s here
    _check_schema({"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object"}, "p")
    for bad in ({"$schema": "http://169.254.169.254/latest", "type": "object"},
                {"type": "object", "properties": {"a": {"type": "strin"}}}):
        with pytest.raises(RequestError) as e:
            _check_schema(bad, "tools[0].function.parameters")
        assert e.value.param == "tools[0].function.parameters" and e.value.status == 400
